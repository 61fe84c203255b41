"""The value model of PPO with a critic (algorithm.advantage=gae): the actor's architecture with a scalar
value head, its own optimizer, routed like the actor (R2 replays its own values pass)."""
