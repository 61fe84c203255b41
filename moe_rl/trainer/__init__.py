"""The RL loop and its run-time services (logging)."""
