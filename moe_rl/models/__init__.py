"""HF-format model folders moe-rl creates itself (the built-in tiny MoE)."""
