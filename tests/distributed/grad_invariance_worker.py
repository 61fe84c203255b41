"""torchrun worker: one actor update on a fixed global batch, split over micro-batches, DP, EP, TP
and PP (plain, or interleaved with vpp = 2), with the fused kernels (actor.fused_logprob,
algorithm.fused_loss) on or off, padded or packed (actor.packing, bins of PACK_TOKENS tokens).

  torchrun --nproc-per-node=N -m tests.distributed.grad_invariance_worker MODEL --out DIR \
      --layouts dp ep --micro-batch-sizes 2 1 --losses gspo ppo [--fused on off] [--packing off on]

Every rank builds the same global batch of 8 sequences (seeded; uneven prompt and response
lengths, rollout log-probs that make the correction drop tokens and sequences, random R3
routes). Each variant (layout x micro-batch size x loss) builds a fresh `Actor` from the HF
weights and runs `Actor.train` once: the trainer's update, with its global token/sequence
counts, 2 mini-batches (2 optimizer steps), gradient sync, clipping and Adam. Losses: GSPO
(seq-mean-token-mean) with seq-mask (a new mask: rank 0 keeps fewer sequences than rank 1),
GSPO with IcePop (the default objective), PPO (token-mean) with IcePop (token weights).

Rank 0 writes DIR/<variant>.pt with HF-named full tensors (experts gathered over EP, TP shards
joined): the synced gradient before each optimizer step ("grads", one dict per step), the
parameters after the update ("params"), the mean grad norm ("grad_norm"), every metric of the
update ("metrics") and the old-log-prob pass ("old": log-probs and entropy, at temperature 1
and 0.7); DIR/initial.pt holds the weights before it. A variant with the fused kernels off is
saved with the suffix "_unfused", a packed one with "_packed", one with megatron's distributed optimizer (GPU:
tests/gpu/test_distributed_optimizer.py) with "_distopt".

A data-parallel rank takes, from each global mini-batch of 4 rows, its contiguous share, so
that the union over ranks of local mini-batch i is global mini-batch i (rows 4i..4i+3).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import torch

BATCH = 8
MINI_BATCHES = 2
PROMPT_LENS = [3, 5, 2, 4, 6, 3, 2, 5]
RESPONSE_LENS = [9, 2, 6, 1, 4, 11, 7, 3]  # uneven: per-micro-batch normalisation would show
# k = pi_old / mu = exp(-noise): noise 2 puts a token outside IcePop's band (weight 0) and its
# sequence outside seq-mask's (sequence dropped: rows 0 and 5 under GSPO + seq-mask).
MASKED_ROW = 5  # every response token of this row
MASKED_TOKEN = (0, PROMPT_LENS[0] + 1)
# Far below Adam's eps (1e-8 per element): Adam runs in its linear regime (update ~ lr * g / eps),
# so the updated parameters reflect the gradient values instead of their signs.
GRAD_CLIP = 1e-6
PACK_TOKENS = 24  # several bins per mini-batch, of 1 to 3 samples (lengths 5 to 17)


def global_batch(vocab: int, num_moe_layers: int, num_experts: int, topk: int, seed: int) -> dict:
    """The same [B, T] tensors on every rank (log-prob noise, advantages and routes included)."""
    g = torch.Generator().manual_seed(seed)
    t = max(p + r for p, r in zip(PROMPT_LENS, RESPONSE_LENS, strict=True))
    ids = torch.zeros(BATCH, t, dtype=torch.long)
    attn = torch.zeros(BATCH, t, dtype=torch.long)
    loss_mask = torch.zeros(BATCH, t)
    for i, (p, r) in enumerate(zip(PROMPT_LENS, RESPONSE_LENS, strict=True)):
        ids[i, : p + r] = torch.randint(1, vocab, (p + r,), generator=g)
        attn[i, : p + r] = 1
        loss_mask[i, p : p + r] = 1
    noise = 0.05 * torch.randn(BATCH, t, generator=g)  # rollout log-probs = old + noise
    noise[MASKED_ROW] = 2.0
    noise[MASKED_TOKEN] = 2.0
    rng = np.random.default_rng(seed)
    routes = np.stack([rng.permutation(num_experts)[:topk] for _ in range(BATCH * t * num_moe_layers)]).reshape(
        BATCH, t, num_moe_layers, topk
    )
    return {
        "input_ids": ids,
        "attention_mask": attn,
        "loss_mask": loss_mask,
        "noise": noise * loss_mask,
        "advantages": torch.randn(BATCH, generator=g),
        "routes": torch.from_numpy(routes.astype(np.uint8)),
    }


def local_rows(dp_rank: int, dp_size: int) -> torch.Tensor:
    """This DP rank's rows: its share of every global mini-batch, mini-batch by mini-batch."""
    per_mini = BATCH // MINI_BATCHES
    share = per_mini // dp_size
    return torch.cat(
        [
            torch.arange(i * per_mini + dp_rank * share, i * per_mini + (dp_rank + 1) * share)
            for i in range(MINI_BATCHES)
        ]
    )


def hf_tensors(actor, of_grad: bool = False) -> dict[str, torch.Tensor]:
    """Full HF-named tensors (gathered over EP) of the parameters, or of their gradients.

    Gradients go through the same export by standing in for the parameters' data: the HF
    conversion only slices, concatenates and renames, which is as valid for gradients.
    Collective: every rank calls it."""
    from moe_rl.actor.weights import export_hf_state_dict

    params = [p for c in actor.chunks for p in c.parameters()]
    saved = [p.data for p in params]
    try:
        if of_grad:
            for p in params:  # megatron's DDP (actor.distributed_optimizer) keeps them in main_grad
                grad = p.grad if p.grad is not None else getattr(p, "main_grad", None)
                p.data = grad.to(p.dtype) if grad is not None else torch.zeros_like(p)
        return {k: v.clone() for k, v in export_hf_state_dict(actor.chunks, actor.conv).items()}
    finally:
        for p, d in zip(params, saved, strict=True):
            p.data = d


def adapter_tensors(actor, of_grad: bool = False) -> dict[str, torch.Tensor]:
    """Every LoRA factor (or its gradient) whole, by global name, on every rank. Collective."""
    from moe_rl.actor import lora
    from moe_rl.actor.weights import global_name
    from moe_rl.common.distributed import all_gather_objects

    mine = {}
    for local, chunk, adapter in lora.adapters(actor.chunks):
        gname = global_name(f"{local}.weight", chunk).removesuffix(".weight")
        for which in ("a", "b"):
            mine[f"{gname}.lora.{which}"] = lora.gather(adapter, which, grad=of_grad).clone()
    return {k: v for part in all_gather_objects(mine) for k, v in part.items()}


def run_variant(
    model: str,
    layout: str,
    mbs: int,
    loss: str,
    batch: dict,
    out: Path,
    fused: bool = True,
    packing: bool = False,
    distributed_optimizer: bool = False,
    lora_rank: int = 0,
) -> str:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from moe_rl.actor import lora
    from moe_rl.actor.actor import Actor
    from moe_rl.actor.config import LoraConfig, ParallelConfig
    from moe_rl.actor.forward import compute_logprobs
    from moe_rl.actor.parallel import init_distributed
    from moe_rl.common.batch import PaddedBatch
    from moe_rl.config import ActorConfig, AlgorithmConfig, TrainConfig
    from moe_rl.objectives import Objective
    from moe_rl.objectives.config import GSPOConfig, IcePopConfig, PPOConfig, SeqMaskConfig
    from moe_rl.routing.layout import layer_columns

    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    parallel = ParallelConfig(
        ep=world if layout == "ep" else 1,
        tp=world if layout == "tp" else 1,
        cp=world if layout == "cp" else 1,
        pp=world if layout in ("pp", "vpp") else 1,
        vpp=2 if layout == "vpp" else None,
        etp=world if layout == "etp" else 1,  # expert tensor parallel alone: each expert's linears split, TP=1
    )
    init_distributed(parallel, seed=1234)
    algorithms = {
        "gspo": AlgorithmConfig(loss=GSPOConfig(), correction=SeqMaskConfig()),
        "gspo-icepop": AlgorithmConfig(loss=GSPOConfig(), correction=IcePopConfig()),
        "ppo": AlgorithmConfig(loss=PPOConfig(agg="token-mean"), correction=IcePopConfig()),
    }
    algorithms[loss].fused_loss = fused
    cfg = TrainConfig(
        parallel=parallel,
        algorithm=algorithms[loss],
        actor=ActorConfig(
            router_replay="r3",
            lr=3e-3,
            grad_clip=GRAD_CLIP,
            mini_batches=MINI_BATCHES,
            micro_batch_size=mbs,
            fused_logprob=fused,
            packing=packing,
            max_tokens_per_micro_batch=PACK_TOKENS,
            distributed_optimizer=distributed_optimizer,
            lora=LoraConfig(rank=lora_rank, alpha=2.0 * lora_rank, targets=["all", "router"]),
        ),
    )
    actor = Actor(cfg.actor, cfg.model, cfg.parallel, model, record_routes=False)
    if lora_rank:  # B != 0 (the same numbers in every layout), or A's gradients would be zero
        lora.init_adapters(actor.chunks, seed=5, b_std=0.05)
    objective = Objective(cfg.algorithm, group_size=1)

    rows = local_rows(ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())
    stage = layer_columns(actor.route_layers, actor.layout.moe_layers)  # PP: this stage's route columns
    padded = PaddedBatch(
        batch["input_ids"][rows],
        batch["attention_mask"][rows],
        batch["loss_mask"][rows],
        torch.zeros(len(rows), batch["input_ids"].shape[1]),
        batch["routes"][rows][:, :, stage],
    )
    old = actor.old_logprobs(padded)
    hot = compute_logprobs(
        actor.chunks,
        padded.input_ids,
        padded.attention_mask,
        mbs,
        temperature=0.7,
        fused=fused,
        routes=padded.routes,
        replay=actor.replay,
        pack=actor.pack_plan(padded),
    )
    padded.rollout_logprobs = (old.logprobs + batch["noise"][rows]) * padded.loss_mask

    # The synced gradient of each mini-batch, taken just before its optimizer step (which clips in place).
    grads: list[dict[str, torch.Tensor]] = []
    step = actor.optimizer.step

    def snapshot_then_step():
        grads.append(adapter_tensors(actor, of_grad=True) if lora_rank else hf_tensors(actor, of_grad=True))
        return step()

    actor.optimizer.step = snapshot_then_step
    metrics = actor.train(padded, old, batch["advantages"][rows], objective, on_skip=lambda skipped, i: skipped)
    assert metrics["actor/skipped_steps"] == 0, metrics
    assert len(grads) == MINI_BATCHES, len(grads)
    params = hf_tensors(actor) | (adapter_tensors(actor) if lora_rank else {})  # LoRA: merged weights + factors
    name = f"w{world}_{layout}_mbs{mbs}_{loss}" + ("" if fused else "_unfused") + ("_packed" if packing else "")
    name += "_distopt" if distributed_optimizer else ""
    name += f"_lora{lora_rank}" if lora_rank else ""
    if dist.get_rank() == 0:
        olds = {"logprobs": old.logprobs, "entropy": old.entropy, "logprobs_t0.7": hot["logprobs"]}
        olds["entropy_t0.7"] = hot["entropy"]
        saved = {"grads": grads, "params": params, "grad_norm": metrics["actor/grad_norm"], "metrics": metrics}
        torch.save({**saved, "old": olds}, out / f"{name}.pt")
        if not (out / "initial.pt").exists():
            from moe_rl.actor.weights import HFCheckpoint

            ckpt = HFCheckpoint(model)
            torch.save({k: ckpt.get(k) for k in params if ".lora." not in k}, out / "initial.pt")
    return name


def main() -> None:
    from moe_rl.actor.model import load_hf_config
    from moe_rl.actor.parallel import destroy_distributed
    from moe_rl.routing.model_layout import moe_layout

    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--out", required=True)
    p.add_argument("--layouts", nargs="+", choices=("dp", "ep", "tp", "pp", "vpp", "cp", "etp"), default=["dp"])
    p.add_argument("--micro-batch-sizes", nargs="+", type=int, required=True)
    p.add_argument("--losses", nargs="+", choices=("gspo", "gspo-icepop", "ppo"), default=["gspo", "ppo"])
    p.add_argument("--fused", nargs="+", choices=("on", "off"), default=["on"])
    p.add_argument("--packing", nargs="+", choices=("off", "on"), default=["off"])
    p.add_argument("--lora", type=int, default=0, help="actor.lora.rank (0: full training)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    layout = moe_layout(load_hf_config(a.model))
    batch = global_batch(
        load_hf_config(a.model).vocab_size, len(layout.moe_layers), layout.num_experts, layout.topk, a.seed
    )
    for lay in a.layouts:
        for mbs in a.micro_batch_sizes:
            for loss in a.losses:
                for fused in a.fused:
                    for packing in a.packing:
                        name = run_variant(
                            a.model, lay, mbs, loss, batch, out, fused == "on", packing == "on", lora_rank=a.lora
                        )
                        print(f"[grad_invariance] {name} done", flush=True)
    destroy_distributed()


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    from moe_rl.trainer.signals import run_then_exit

    run_then_exit(main)
