"""torchrun worker: Megatron actor vs transformers under one parallel layout.

  torchrun --nproc-per-node=2 -m tests.distributed.parity_worker --tp 2 --out DIR MODEL [MODEL ...]
  (several layouts of one world size in one launch: tests/distributed/jobs.py)

For each model folder, writes DIR/<model name>.rank<r>.json with logit, log-prob and router
differences against transformers and the HF -> Megatron -> HF round-trip result.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def check_model(path: str, parallel, out_dir: Path, seed: int) -> None:
    from megatron.core import parallel_state as ps

    from moe_rl.actor.context_parallel import local_positions, seq_multiple
    from moe_rl.actor.forward import compute_logprobs, run_schedule, split_microbatches
    from moe_rl.actor.model import build_model, load_hf_config
    from moe_rl.actor.replay import record_topk
    from moe_rl.actor.weights import HFCheckpoint, export_hf_state_dict, load_hf_weights
    from moe_rl.routing.layout import rank_positions
    from tests.reference import hf_forward, load_hf, random_batch

    cfg = load_hf_config(path)
    chunks, conv = build_model(cfg, parallel)
    load_hf_weights(chunks, conv, path)
    for c in chunks:
        c.eval()
    # Same batch on every rank (one data-parallel replica is enough for parity).
    ids, mask = random_batch(cfg.vocab_size, batch=4, length=16, seed=seed)  # every CP x SP slice has real tokens
    ref_logits, ref_topk = hf_forward(load_hf(path), ids, mask)
    real = mask.bool()

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    logits_out: list[torch.Tensor] = []

    def keep_logits(logits, mb):
        logits_out.append(logits.detach())
        return logits.new_zeros(()), {}

    mbs = split_microbatches(ids, mask, micro_batch_size=2, pad_multiple=seq_multiple())
    seq = mbs[0].input_ids.shape[1]
    with torch.no_grad(), record_topk(chunks) as recorded:
        run_schedule(chunks, mbs, keep_logits, forward_only=True)

    result: dict = {"rank": dist.get_rank(), "model": Path(path).name}
    if logits_out:  # last pipeline stage: this rank's vocab slice at its (context-parallel) positions
        pos = local_positions(seq)
        keep = pos < ids.shape[1]
        meg = torch.cat(logits_out, 0)[:, keep]
        v_local = meg.shape[-1]
        lo = tp_rank * v_local
        hi = min(lo + v_local, cfg.vocab_size)
        ref = ref_logits[:, pos[keep], lo:hi]
        diff = (meg[..., : hi - lo] - ref)[real[:, pos[keep]]].abs().max().item()
        result["logits_max_abs_diff"] = diff
        result["logits_scale"] = ref_logits[real].abs().max().item()

    lp = compute_logprobs(chunks, ids, mask, micro_batch_size=2)["logprobs"]
    ref_lp = torch.log_softmax(ref_logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    result["logprobs_max_abs_diff"] = ((lp[:, 1:] - ref_lp) * mask[:, 1:]).abs().max().item()

    # Router top-k: megatron rows are s * b_mb + b over this rank's CP slice, then its TP slice (SP).
    positions = rank_positions(
        seq,
        tp,
        tp_rank,
        ps.get_context_parallel_world_size(),
        ps.get_context_parallel_rank(),
        parallel.sequence_parallel,
    )
    s_local = len(positions)
    mismatches, compared = {}, 0
    for layer, per_forward in recorded.items():
        bad = 0
        for mb, rec in zip(mbs, per_forward, strict=True):
            rec = rec.reshape(s_local, len(mb.index), -1).permute(1, 0, 2)  # [b, s_local, K]
            for bi, row in enumerate(mb.index.tolist()):
                for s in range(s_local):
                    pos = positions[s]
                    if pos >= ids.shape[1] or not real[row, pos]:
                        continue
                    compared += 1
                    if set(rec[bi, s].tolist()) != set(ref_topk[layer][row, pos].tolist()):
                        bad += 1
        mismatches[layer] = bad
    result["router_mismatches"] = mismatches
    result["router_compared"] = compared
    result["moe_layers_on_rank"] = sorted(recorded)

    exported = export_hf_state_dict(chunks, conv)
    ckpt = HFCheckpoint(path)
    from moe_rl.actor.hf_export import untrained_mtp_tensors

    trained = set(ckpt.weight_map) - set(untrained_mtp_tensors(path, cfg))  # MTP layers are not the actor's
    missing = sorted(trained - set(exported))
    extra = sorted(set(exported) - set(ckpt.weight_map))
    unequal = [k for k in exported if k in ckpt.weight_map and not torch.equal(exported[k], ckpt.get(k))]
    result["roundtrip"] = {"missing": missing, "extra": extra, "unequal": unequal, "n": len(exported)}
    (out_dir / f"{Path(path).name}.rank{dist.get_rank()}.json").write_text(json.dumps(result))


def run(argv: list[str]) -> None:
    """One layout: every model given, each on a freshly set-up megatron parallel state."""
    from moe_rl.actor.config import ParallelConfig
    from moe_rl.actor.parallel import init_distributed

    p = argparse.ArgumentParser()
    p.add_argument("models", nargs="+")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--etp", type=int, default=1)
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--first-stage-layers", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    parallel = ParallelConfig(tp=a.tp, pp=a.pp, ep=a.ep, etp=a.etp, cp=a.cp, first_stage_layers=a.first_stage_layers)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for i, m in enumerate(a.models):
        init_distributed(parallel, seed=1234)
        check_model(m, parallel, out, seed=a.seed + i)


def main() -> None:
    from moe_rl.actor.parallel import destroy_distributed

    run(sys.argv[1:])
    destroy_distributed()


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    from moe_rl.trainer.signals import run_then_exit

    run_then_exit(main)
