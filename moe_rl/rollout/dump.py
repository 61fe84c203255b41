"""Rollout dumps: what the trainer saw in one step, for the diagnostic CLI and train-from-dump.

One safetensors file per rank and step, `<dir>/step_000003/rank_00001.safetensors`:

  input_ids, attention_mask, loss_mask   [B, T]  right-padded prompt+response, 1 on response tokens
  rollout_logprobs                       [B, T]  mu: the engine's log-probs (0 off the response)
  rewards                                [B]     samples of one prompt are consecutive (sampling.n);
                                                 absent in moe-rl-diagnose live dumps
  logprobs_replay                        [B, T]  pi_old with the engine's routes replayed
  logprobs_live                          [B, T]  pi_old with the actor's own routing
  routes                                 [B, T, L_moe, K]  the engine's routes (when captured)
  routes_live                            [B, T, L_moe, K]  the actor's own routes
  policy_version                         [B]     the actor step whose weights sampled each sample
  turn_index                             [B, T]  multi-turn: the turn that sampled each token, -1 on the
                                                 prompt, observations and padding (loss_mask is 1 on
                                                 sampled tokens only)
  versions                               [B, T]  in-flight: the version that sampled each response token, -1
                                                 elsewhere (policy_version is each sample's oldest)
  (log-prob entry t scores token t given tokens < t)

Metadata (strings): `meta` = JSON with step, rank, world_size, dp_rank (the data-parallel rank whose samples the
file holds: its TP/PP/CP peers write the same ones), model path, `model` fingerprint
(model_type, vocab_size, num_layers, moe_layers, num_experts, topk), actor/engine dtypes,
router_replay mode, sampling.n and `replay_check` ({token_layers, mismatched}: router rows
dispatched under replay before the update and how many went to other experts than replayed).
The fingerprint is what refuses a dump from another model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

REQUIRED = ("input_ids", "attention_mask", "loss_mask", "rollout_logprobs")
PER_TOKEN = (
    "attention_mask",
    "loss_mask",
    "rollout_logprobs",
    "logprobs_replay",
    "logprobs_live",
    "turn_index",
    "versions",
)


class DumpError(ValueError):
    """A rollout dump that is missing, malformed or from another model."""


def model_fingerprint(hf_config, layout) -> dict:
    return {
        "model_type": hf_config.model_type,
        "vocab_size": int(hf_config.vocab_size),
        "num_layers": int(hf_config.num_hidden_layers),
        "moe_layers": list(layout.moe_layers),
        "num_experts": int(layout.num_experts),
        "topk": int(layout.topk),
    }


def rank_file(root: str | Path, step: int, rank: int) -> Path:
    return Path(root) / f"step_{step:06d}" / f"rank_{rank:05d}.safetensors"


def write(path: str | Path, tensors: dict[str, torch.Tensor], meta: dict) -> Path:
    # heavy: safetensors, imported on first use
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items() if v is not None}, str(path), {"meta": json.dumps(meta)})
    return path


def write_rank(
    root: str | Path,
    step: int,
    padded,
    views: dict[str, torch.Tensor | None],
    replay_check: tuple[int, int],
    rewards: torch.Tensor | None = None,
    policy_version: torch.Tensor | None = None,
    turn_index: torch.Tensor | None = None,
    versions: torch.Tensor | None = None,
    **meta,
) -> Path:
    """This rank's dump of one step: a PaddedBatch, the routing views of
    `moe_rl.actor.forward.routing_views`, RouteReplay.dispatch_check(), the policy version that sampled
    each sample ([B], trainer.max_staleness) and metadata (model_path, model fingerprint, actor/rollout
    dtypes, router_replay, n)."""
    # heavy: megatron-core, imported on first use
    from megatron.core import parallel_state as ps

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    # TP/PP/CP peers dump the same samples: readers that pool ranks (moe-rl-diagnose offline) keep one per dp_rank
    dp_rank = ps.get_data_parallel_rank() if ps.model_parallel_is_initialized() else rank
    meta = {
        "step": step,
        "rank": rank,
        "world_size": world,
        "dp_rank": dp_rank,
        **meta,
        "replay_check": {"token_layers": replay_check[0], "mismatched": replay_check[1]},
    }
    tensors = {
        "input_ids": padded.input_ids,
        "attention_mask": padded.attention_mask,
        "loss_mask": padded.loss_mask,
        "rollout_logprobs": padded.rollout_logprobs,
        "rewards": rewards,
        "policy_version": policy_version,
        "turn_index": turn_index,
        "versions": versions,
        "routes": padded.routes,
        **views,
    }
    return write(rank_file(root, step, rank), tensors, meta)


def read(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """Load one rank file and check its shapes; raises DumpError naming the file and key."""
    # heavy: safetensors, imported on first use
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise DumpError(f"rollout dump {path} does not exist")
    try:
        with safe_open(str(path), "pt") as f:
            meta = json.loads((f.metadata() or {}).get("meta", "null"))
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    except Exception as e:  # safetensors raises its own types for truncated or foreign files
        raise DumpError(f"{path} is not a readable safetensors rollout dump: {e}") from e
    if not isinstance(meta, dict) or "model" not in meta:
        raise DumpError(f"{path} has no moe-rl dump metadata (written by another tool?)")
    missing = [k for k in REQUIRED if k not in tensors]
    if missing:
        raise DumpError(f"{path} lacks {missing}")
    b, t = tensors["input_ids"].shape
    for k in PER_TOKEN:
        if k in tensors and tuple(tensors[k].shape) != (b, t):
            raise DumpError(f"{path}: {k} has shape {tuple(tensors[k].shape)}, input_ids has {(b, t)}")
    for k in ("rewards", "policy_version"):
        if k in tensors and tuple(tensors[k].shape) != (b,):
            raise DumpError(f"{path}: {k} has shape {tuple(tensors[k].shape)}, expected ({b},)")
    m = meta["model"]
    for k in ("routes", "routes_live"):
        if k in tensors and tuple(tensors[k].shape) != (b, t, len(m["moe_layers"]), m["topk"]):
            raise DumpError(
                f"{path}: {k} has shape {tuple(tensors[k].shape)}, expected "
                f"{(b, t, len(m['moe_layers']), m['topk'])} (samples, tokens, MoE layers, top-k)"
            )
    return tensors, meta


def step_folders(root: str | Path) -> list[Path]:
    root = Path(root)
    if not root.is_dir():
        raise DumpError(f"dump folder {root} does not exist")
    steps = sorted(p for p in root.glob("step_*") if p.is_dir())
    if not steps and root.name.startswith("step_") and any(root.glob("rank_*.safetensors")):
        steps = [root]
    if not steps:
        raise DumpError(f"{root} holds no step_*/rank_*.safetensors rollout dumps")
    return steps
