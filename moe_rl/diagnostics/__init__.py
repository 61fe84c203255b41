"""Routing-mismatch diagnostics: `moe-rl-diagnose` (live / offline / compare)."""
