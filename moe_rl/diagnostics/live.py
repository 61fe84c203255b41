"""`moe-rl-diagnose live`: one rollout with route capture, scored by the Megatron actor with its
own routing and with the engine's routes replayed; every rank writes its dump, rank 0 reports.

Under torchrun each rank runs its own engine on its share of the prompts (the trainer's
per-rank topology) and the actor uses `--ep` expert parallelism over the world.
"""

from __future__ import annotations

import json
from pathlib import Path

from moe_rl.actor.config import ParallelConfig
from moe_rl.diagnostics.output import write_report
from moe_rl.rollout.config import HeadDtype, RolloutConfig, SamplingConfig
from moe_rl.routing.model_layout import MoELayout, moe_layout


def read_prompts(path: str, limit: int) -> list[str]:
    """jsonl with a `prompt` field, or plain text with one prompt a line."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--prompts {path} does not exist")
    lines = [line for line in p.read_text().splitlines() if line.strip()]
    prompts = []
    for i, line in enumerate(lines):
        if line.lstrip().startswith("{"):
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {i + 1}: not valid JSON ({e})") from None
            if "prompt" not in row:
                raise ValueError(f"{path} line {i + 1}: no `prompt` field (keys: {sorted(row)})")
            prompts.append(str(row["prompt"]))
        else:
            prompts.append(line)
    if not prompts:
        raise ValueError(f"--prompts {path} holds no prompts")
    return prompts[:limit]


def live(args) -> dict | None:
    """`moe-rl-diagnose live` on this rank: roll out its share of the prompts, score them with the actor and write
    its dump; rank 0 then writes the report and returns it (the other ranks return None)."""
    # torch, transformers and megatron-core (the actor's process groups): when `live` runs, not on import
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from moe_rl.actor.model import load_hf_config
    from moe_rl.actor.parallel import destroy_distributed, init_distributed
    from moe_rl.diagnostics.report import load_dumps

    if not Path(args.model, "config.json").is_file():
        raise FileNotFoundError(f"--model {args.model}: no config.json there")
    hf_cfg = load_hf_config(args.model)
    layout = moe_layout(hf_cfg)  # ValueError naming the config for a model without MoE layers
    prompts = read_prompts(args.prompts, args.samples)
    parallel = ParallelConfig(ep=args.ep)
    init_distributed(parallel, seed=args.seed)
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = prompts[rank::world]
    if not mine:
        raise ValueError(f"{len(prompts)} prompts cannot feed {world} ranks")
    out = Path(args.out)
    tok = AutoTokenizer.from_pretrained(args.model)
    padded = _rollout(args, layout, tok, mine, rank)
    _score_and_dump(args, parallel, hf_cfg, layout, padded, out / "dump")
    dist.barrier()
    report = None
    if rank == 0:
        data, metas, files = load_dumps(out / "dump")
        report = write_report(args, data, metas, files, tok)
    dist.barrier()
    destroy_distributed()
    return report


def _rollout(args, layout: MoELayout, tok, prompts: list[str], rank: int):
    """One sample per prompt of this rank's `prompts` from a vLLM engine capturing routes, as a right-padded batch
    as long as the longest sequence over all ranks (collective)."""
    # torch.distributed and vLLM (the engine): when `live` runs, not on import
    from moe_rl.common.distributed import world_max
    from moe_rl.rollout.engine import RolloutEngine

    rollout_cfg = RolloutConfig(
        model=args.model,
        dtype=args.dtype,
        head_dtype=HeadDtype(args.head_dtype),
        capture="auto",
        seed=args.seed,
        kv_cache_gib=args.kv_cache_gib,
    )
    with RolloutEngine(rollout_cfg, layout.moe_layers, layout.num_experts, layout.topk) as engine:
        sampling = SamplingConfig(
            n=1, temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed + rank * len(prompts)
        )
        batch = engine.generate([tok(p)["input_ids"] for p in prompts], sampling)
    longest = max(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids, strict=True))
    return batch.to_padded(pad_id=tok.pad_token_id or 0, min_length=world_max(longest)[0])


def _score_and_dump(args, parallel, hf_cfg, layout: MoELayout, padded, dump_dir: Path) -> None:
    """Score the `padded` rollout with the Megatron actor twice (its own routing, the engine's routes replayed) and
    write this rank's dump of both to `dump_dir`."""
    # torch and megatron-core (the actor): when `live` runs, not on import
    from moe_rl.actor.forward import routing_views
    from moe_rl.actor.model import ModelOptions, load_model
    from moe_rl.actor.replay import RouteReplay
    from moe_rl.rollout import dump

    actor_dtype = args.actor_dtype or args.dtype
    chunks = load_model(args.model, parallel, ModelOptions(dtype=actor_dtype)).chunks
    replay = RouteReplay(chunks, layout.moe_layers, verify="count")
    views = routing_views(chunks, padded.input_ids, padded.attention_mask, None, replay, padded.routes)
    dump.write_rank(
        dump_dir,
        0,
        padded,
        views,
        replay.dispatch_check(),
        model_path=str(args.model),
        model=dump.model_fingerprint(hf_cfg, layout),
        actor_dtype=actor_dtype,
        rollout_dtype=args.dtype,
        router_replay="r3",
        n=1,
    )
