from moe_rl.diagnostics.cli import main

main()
