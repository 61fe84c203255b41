"""Export a training checkpoint's actor to a Hugging Face folder that transformers and vLLM load.

The checkpoint's model/ is a megatron-core sharded checkpoint, so the export runs under any
parallel layout (world 1 by default) whatever layout trained it. Config, tokenizer and
generation config come from the HF folder the run started from (trainer.json's model_path, or
--model); weights are written as sharded safetensors with an index. Multi-token-prediction layers
of that folder (DeepSeek-V3 / GLM-4.5 `num_nextn_predict_layers`), which the actor does not train,
are copied unchanged so speculative decoding keeps its draft layers.

A LoRA run's checkpoint (actor.lora) holds the adapters only: the export rebuilds them on the base folder and
writes OUT/merged/ (the base weights with W + (alpha / r) B A, an HF folder like any other) and OUT/adapter/ (a PEFT
adapter folder over the base; attention adapters only: PEFT 0.21 cannot hold the others, and the export says which
and skips the folder).

Examples:
  python -m moe_rl.tools.export_hf runs/2026-11-22_08-00-00/checkpoints/step_000030 --out /tmp/actor-hf
  python -m moe_rl.tools.export_hf runs/my-run/checkpoints --out /tmp/actor-hf        # the newest checkpoint
  python -m moe_rl.tools.export_hf CKPT --out /tmp/actor-hf --model /data/Qwen3-30B-A3B --dtype bfloat16
  torchrun --nproc-per-node=2 -m moe_rl.tools.export_hf CKPT --out /tmp/actor-hf --ep 2
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch.distributed as dist

from moe_rl.actor import lora
from moe_rl.actor.config import LoraConfig, ParallelConfig
from moe_rl.actor.hf_export import write_hf_folder, write_peft_folder
from moe_rl.actor.model import build_model, load_hf_config, load_model
from moe_rl.actor.parallel import destroy_distributed, init_distributed
from moe_rl.trainer import checkpoint


def resolve_checkpoint(path: str | Path) -> Path:
    """A step_* folder, or a checkpoint root (its newest complete checkpoint)."""
    path = Path(path)
    if (path / "model").is_dir():
        return path
    newest = checkpoint.latest(path) if path.is_dir() else None
    if newest is None:
        raise FileNotFoundError(f"{path} is neither a checkpoint step folder (with model/) nor a folder with `latest`")
    return newest


def export(
    ckpt: str | Path, out: str | Path, model: str | None = None, dtype: str | None = None, parallel=None
) -> Path:
    """Collective when distributed; rank 0 writes `out`. Returns the output folder."""
    ckpt = resolve_checkpoint(ckpt)
    state = checkpoint.saved_state(ckpt)
    if model is None:
        if "model_path" not in state:
            raise FileNotFoundError(
                f"{ckpt}/trainer.json is missing; pass --model HF_DIR (the folder the run started from)"
            )
        model = state["model_path"]
    provenance = {"checkpoint": str(ckpt), "source_model": str(model)}
    parallel = parallel or ParallelConfig()
    if "lora" not in state:
        chunks, conv = build_model(load_hf_config(model), parallel)
        checkpoint.load_model(ckpt, chunks)
        return write_hf_folder(chunks, conv, model, out, dtype, provenance)
    cfg = LoraConfig(**state["lora"])
    loaded = load_model(model, parallel)  # the base weights: the checkpoint holds the adapters only
    lora.attach(loaded.chunks, cfg)
    checkpoint.load_model(ckpt, loaded.chunks)
    out = Path(out)
    write_hf_folder(loaded.chunks, loaded.conv, model, out / "merged", dtype, provenance | {"lora": state["lora"]})
    try:
        write_peft_folder(loaded.chunks, loaded.conv, model, out / "adapter", cfg)
    except ValueError as e:
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"[moe-rl] {out / 'adapter'} not written: {e}")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m moe_rl.tools.export_hf",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("checkpoint", help="checkpoint step folder (…/checkpoints/step_000030) or the checkpoints folder")
    p.add_argument("--out", required=True, help="output HF folder")
    p.add_argument("--model", help="source HF folder for config/tokenizer (default: trainer.json's model_path)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="weight dtype (default: the config's)")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size of this export job")
    p.add_argument("--ep", type=int, default=1, help="expert parallel size of this export job")
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel size of this export job")
    a = p.parse_args(argv)

    parallel = ParallelConfig(tp=a.tp, pp=a.pp, ep=a.ep)
    init_distributed(parallel)
    out = export(a.checkpoint, a.out, a.model, a.dtype, parallel)
    if dist.get_rank() == 0:
        print(f"[moe-rl] exported {resolve_checkpoint(a.checkpoint)} -> {out}")
    destroy_distributed()


if __name__ == "__main__":
    main()
