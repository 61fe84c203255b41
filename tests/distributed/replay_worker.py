"""torchrun worker: routing replay under one parallel layout.

  torchrun --nproc-per-node=N -m tests.distributed.replay_worker --tp 2 --out DIR MODEL
  (several models and layouts of one world size in one launch: tests/distributed/jobs.py)

Writes DIR/rank<r>.json with:
  holds_routes              whether this rank holds the routes of its tensor/context-parallel group; the
                            others are given zero-width routes throughout, as the trainer gives them
  recorded_width            positions of the routes a recording pass left on this rank (0 off the holder)
  record_replay_identical   replaying the routes a forward recorded gives bit-identical log-probs (R2)
  recorded_vs_hf_mismatch   recorded routes (gathered over SP on the holder) vs transformers' router top-k
  forced_vs_hf              max |logp| difference: replayed random routes vs transformers forced to them
  forced_vs_live            max |logp| difference between replayed random routes and live routing
  router_grad_min           smallest |grad| norm over this rank's routers under replay
  recompute_grad_max_diff   grads with full activation recompute vs without (same replayed routes)
  after_second_model        replay of the first model is unchanged after building a second one
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def train_grads(chunks, replay, ids, mask, routes, micro_batch_size):
    """One forward+backward with replayed routes; returns {param name: grad}."""
    from moe_rl.actor.forward import run_schedule, split_microbatches, vocab_parallel_logprobs

    for c in chunks:
        c.train()
        c.zero_grad(set_to_none=True)
    from megatron.core import parallel_state as ps

    mbs = split_microbatches(
        ids, mask, micro_batch_size, pad_multiple=ps.get_tensor_model_parallel_world_size(), extra={"routes": routes}
    )
    n = mask[:, 1:].sum()

    def step(logits, mb):
        lp, _ = vocab_parallel_logprobs(logits[:, :-1], mb.input_ids[:, 1:], with_entropy=False)
        return -(lp * mb.attention_mask[:, 1:]).sum() / n, {}

    with replay.replay(mbs):
        run_schedule(chunks, mbs, step, forward_only=False)
    grads = {}
    for i, c in enumerate(chunks):
        for name, p in c.named_parameters():
            grads[f"{i}.{name}"] = None if p.grad is None else p.grad.detach().clone()
    return grads


def run(argv: list[str]) -> None:
    """One model under one layout (megatron's parallel state set up for it)."""
    from megatron.core import parallel_state as ps

    from moe_rl.actor.config import ParallelConfig
    from moe_rl.actor.forward import compute_logprobs
    from moe_rl.actor.model import ModelOptions, build_model, load_hf_config
    from moe_rl.actor.parallel import init_distributed
    from moe_rl.actor.replay import RouteReplay, holds_routes
    from moe_rl.actor.weights import load_hf_weights
    from moe_rl.routing.model_layout import moe_layout
    from tests.reference import hf_forward, hf_forward_forced, load_hf, random_batch, random_routes

    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    parallel = ParallelConfig(tp=a.tp, pp=a.pp, ep=a.ep)
    init_distributed(parallel)
    cfg = load_hf_config(a.model)
    lay = moe_layout(cfg)

    def build(recompute=None):
        chunks, conv = build_model(cfg, parallel, ModelOptions(recompute=recompute))
        load_hf_weights(chunks, conv, a.model)
        return chunks, RouteReplay(chunks, lay.moe_layers, verify=True)

    chunks, replay = build()
    ids, mask = random_batch(cfg.vocab_size, batch=4, length=12, seed=5)
    res: dict = {"rank": dist.get_rank()}

    holder = res["holds_routes"] = holds_routes()
    live = compute_logprobs(chunks, ids, mask, micro_batch_size=2, replay=replay, record=True)
    res["recorded_width"] = live["routes"].shape[1]
    rep = compute_logprobs(chunks, ids, mask, micro_batch_size=2, replay=replay, routes=live["routes"])
    res["record_replay_identical"] = bool(torch.equal(live["logprobs"], rep["logprobs"]))

    # recorded routes of this rank's layers vs transformers' own top-k on real tokens (where they are held)
    hf = load_hf(a.model)
    _, ref_topk = hf_forward(hf, ids, mask)
    mine = {h.layer for h in replay.hooks}
    bad = None
    if holder:
        bad = 0
        for col, layer in enumerate(lay.moe_layers):
            if layer in mine:
                got = live["routes"][:, :, col].long().sort(-1).values
                want = ref_topk[layer].sort(-1).values
                bad += int(((got != want).any(-1) & mask.bool()).sum())
    res["recorded_vs_hf_mismatch"] = bad
    res["layers_on_rank"] = sorted(mine)

    every = random_routes(4, 12, len(lay.moe_layers), lay.topk, lay.num_experts, seed=9)
    forced = every if holder else every[:, :0]  # a peer's positions come from its group's holder
    lp_forced = compute_logprobs(chunks, ids, mask, micro_batch_size=2, replay=replay, routes=forced)["logprobs"]
    hf_logits = hf_forward_forced(hf, ids, mask, {layer: every[:, :, c] for c, layer in enumerate(lay.moe_layers)})
    hf_lp = torch.log_softmax(hf_logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    m = mask[:, 1:].float()
    res["forced_vs_hf"] = ((lp_forced[:, 1:] - hf_lp) * m).abs().max().item()
    res["forced_vs_live"] = ((lp_forced - live["logprobs"])[:, 1:] * m).abs().max().item()

    g_plain = train_grads(chunks, replay, ids, mask, forced, micro_batch_size=1)
    routers = [k for k in g_plain if k.endswith("mlp.router.weight")]
    res["router_grad_min"] = min(float(g_plain[k].norm()) for k in routers) if routers else None

    chunks2, replay2 = build(recompute="full")  # a second model in the same process
    g_rec = train_grads(chunks2, replay2, ids, mask, forced, micro_batch_size=1)
    diffs = [float((g_plain[k] - g_rec[k]).abs().max()) for k in g_plain if g_plain[k] is not None]
    res["recompute_grad_max_diff"] = max(diffs)
    res["recompute_replays"] = sum(h.recomputes for h in replay2.hooks)
    res["grads_compared"] = len(diffs)
    chunks3, replay3 = build(recompute="selective")  # core attention + MoE layer recompute
    g_sel = train_grads(chunks3, replay3, ids, mask, forced, micro_batch_size=1)
    res["selective_recompute_replays"] = sum(h.recomputes for h in replay3.hooks)
    res["selective_recompute_grad_max_diff"] = max(
        float((g_plain[k] - g_sel[k]).abs().max()) for k in g_plain if g_plain[k] is not None
    )
    again = compute_logprobs(chunks, ids, mask, micro_batch_size=2, replay=replay, routes=forced)["logprobs"]
    res["after_second_model"] = bool(torch.equal(again, lp_forced))
    res["pp"] = ps.get_pipeline_model_parallel_world_size()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    Path(a.out, f"rank{dist.get_rank()}.json").write_text(json.dumps(res))


def main() -> None:
    from moe_rl.actor.parallel import destroy_distributed

    run(sys.argv[1:])
    destroy_distributed()


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    from moe_rl.trainer.signals import run_then_exit

    run_then_exit(main)
