"""Multi-turn (agentic) rollouts: the agent loop (loop.py), environments (environment.py, builtin_envs.py),
append-only routes across turns (routes.py), their metrics (metrics.py) and settings (config.py)."""
