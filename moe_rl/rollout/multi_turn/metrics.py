"""The step's multi_turn/* and routes/* metrics from the agent loop's per-sample counts, over the data-parallel
ranks (collective)."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from moe_rl.rollout.multi_turn.loop import END_REASONS


def multi_turn_metrics(info: dict[str, np.ndarray]) -> dict[str, float]:
    """multi_turn/turns_mean, observation_token_fraction, prefix_cache_hit_fraction (prompt tokens of turns after
    the first served from the cache), observations_truncated and ended_<reason> (counts), time/environment (the
    slowest engine's), routes/recomputed_fraction, routes/recomputed_disagreement and routes/missing_fraction
    (with route capture)."""
    # heavy: megatron-core, imported on first use
    from megatron.core import parallel_state as ps

    keys = [k for k in info if k != "env_wall_s"]
    sums = torch.tensor([float(np.sum(info[k])) for k in keys] + [float(len(info["turns"]))], dtype=torch.float64)
    env = torch.tensor([float(np.max(info["env_wall_s"], initial=0.0))], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sums, group=ps.get_data_parallel_group())
        dist.all_reduce(env, op=dist.ReduceOp.MAX)
    s = dict(zip([*keys, "samples"], sums.tolist(), strict=True))

    def ratio(a: float, b: float) -> float:
        return a / b if b else 0.0

    out = {
        "multi_turn/turns_mean": ratio(s["turns"], s["samples"]),
        "multi_turn/observation_token_fraction": ratio(
            s["observation_tokens"], s["observation_tokens"] + s["sampled_tokens"]
        ),
        "multi_turn/prefix_cache_hit_fraction": ratio(s["cached_tokens"], s["reprompted_tokens"]),
        "multi_turn/observations_truncated": s["observations_truncated"],
        "time/environment": float(env[0]),
    }
    out |= {f"multi_turn/ended_{r}": s[f"ended_{r}"] for r in END_REASONS}
    if "computed" in s:
        out["routes/recomputed_fraction"] = ratio(s["recomputed"], s["computed"])
        out["routes/recomputed_disagreement"] = ratio(s["recomputed_changed"], s["recomputed"])
        out["routes/missing_fraction"] = ratio(s["missing"], s["missing"] + s["computed"] - s["recomputed"])
    return out
