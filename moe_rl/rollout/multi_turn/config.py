"""`rollout.multi_turn.*`: agentic rollouts where an environment answers between the model's turns."""

from __future__ import annotations

from dataclasses import dataclass

BUILTIN_ENVS = ("toy", "math_retry", "calculator")


@dataclass
class MultiTurnConfig:
    """Multi-turn rollouts (rollout/multi_turn/): the model answers, the environment replies (an observation
    appended as tokens, never by re-rendering the conversation), the model continues. Only the model's own
    tokens are trained; routes are stitched append-only across turns."""

    env: str = "none"
    """none (single-turn rollouts) | toy (the toy reward per turn, random observation tokens between turns; the
    tiny model learns it on CPU) | math_retry (answer checked, "wrong, try again", reward discounted per turn) |
    calculator (a calculator tool called with <tool_call>...</tool_call>) | module:Class (your own environment:
    rollout/multi_turn/environment.py has the interface and a complete example)."""
    max_turns: int = 3
    """Model turns per trajectory (>= 1); the environment may end a trajectory earlier."""
    max_observation_tokens: int = 64
    """Longest observation (template markers included): longer content is cut to fit, and counted in
    multi_turn/observations_truncated."""
    max_context_tokens: int = 0
    """Total tokens of a trajectory (prompt, turns, observations); a trajectory that would exceed it ends
    (counted in multi_turn/ended_context_limit). 0: the engine's context length."""
    env_timeout_s: float = 60.0
    """Per-turn limit on an environment's reset/step; a trajectory whose environment is slower ends (counted in
    multi_turn/ended_env_timeout), as one whose environment raises does (multi_turn/ended_env_error)."""
    prefix_caching: bool = True
    """Let the engine reuse the KV of earlier turns (route capture then records only the positions the engine
    computes; the record is stitched append-only). Turned off with a message where the capture cannot do that
    (native capture)."""
    missing_routes: str = "error"
    """A position of a trajectory the engine computed in no turn and no trajectory with the same tokens recorded
    (so it has no route; not expected with vLLM): error (stop, naming the sample, turn and position) | live (a
    marked row the actor's live router routes; counted in routes/missing_fraction; needs top-k >= 2)."""
