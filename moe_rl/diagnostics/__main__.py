from moe_rl.diagnostics.cli import main

if __name__ == "__main__":
    main()
