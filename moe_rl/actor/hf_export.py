"""The actor's weights as a Hugging Face folder that transformers and vLLM load: config, tokenizer and generation
config copied from the folder the run started from, the weights as sharded safetensors with an index, and the
source's multi-token-prediction layers (which the actor does not train) copied unchanged."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from moe_rl.actor.model import load_hf_config
from moe_rl.actor.weights import HFCheckpoint, export_hf_state_dict
from moe_rl.common.distributed import all_gather_objects

# Files copied from the source HF folder next to the exported weights.
SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
    "chat_template.jinja",
)


def untrained_mtp_tensors(model_dir: str | Path, hf_cfg) -> dict[str, torch.Tensor]:
    """The source checkpoint's multi-token-prediction layers: `model.layers.{i}.*` for the
    `num_nextn_predict_layers` layers numbered from `num_hidden_layers`."""
    n = int(getattr(hf_cfg, "num_nextn_predict_layers", 0) or 0)
    if not n:
        return {}
    ckpt = HFCheckpoint(model_dir)
    first = hf_cfg.num_hidden_layers
    prefixes = tuple(f"model.layers.{i}." for i in range(first, first + n))
    return {k: ckpt.get(k) for k in ckpt.weight_map if k.startswith(prefixes)}


def write_hf_folder(
    chunks, conv, source_model: str, out: str | Path, dtype: str | None = None, provenance: dict | None = None
) -> Path:
    """Collective when distributed (the weights are gathered); rank 0 writes `out`, with `provenance` in
    moe_rl_export.json. `dtype`: the weights' (default: the source config's)."""
    # heavy: huggingface_hub, imported on first use
    from huggingface_hub import save_torch_state_dict

    hf_cfg = load_hf_config(source_model)
    state = export_hf_state_dict(chunks, conv)
    out = Path(out)
    if not dist.is_initialized() or dist.get_rank() == 0:
        target = getattr(torch, dtype) if dtype else getattr(hf_cfg, "dtype", None) or torch.float32
        if isinstance(target, str):
            target = getattr(torch, target)
        out.mkdir(parents=True, exist_ok=True)
        weights = {k: v.detach().to(target, copy=True) for k, v in state.items()}  # views share storage
        mtp = untrained_mtp_tensors(source_model, hf_cfg)
        if mtp:
            weights.update({k: v.to(target) for k, v in mtp.items()})
            print(
                f"[moe-rl] copied {len(mtp)} multi-token-prediction tensors unchanged from {source_model} (not trained)"
            )
        save_torch_state_dict(weights, out, max_shard_size="5GB")
        hf_cfg.dtype = target
        hf_cfg.save_pretrained(out)
        for name in SIDE_FILES:
            if (Path(source_model) / name).is_file():
                shutil.copy2(Path(source_model) / name, out / name)
        (out / "moe_rl_export.json").write_text(json.dumps(provenance or {"source_model": str(source_model)}))
    if dist.is_initialized():
        dist.barrier()
    return out


def write_peft_folder(chunks, conv, source_model: str | Path, out: str | Path, lora_cfg) -> Path:
    """A PEFT LoRA adapter folder (adapter_config.json, adapter_model.safetensors) of the actor's adapters that
    `peft.PeftModel.from_pretrained(<the source HF model>, out)` loads; `base_model_name_or_path` is the source
    folder's absolute path. Collective when distributed (the factors are gathered); rank 0 writes. ValueError naming
    an adapter PEFT cannot hold (moe_rl.actor.lora.PEFT_REFUSED), before anything is written."""
    # heavy: safetensors, imported on first use
    from safetensors.torch import save_file

    from moe_rl.actor.lora import PEFT_REFUSED, adapters, hf_adapter_tensors
    from moe_rl.actor.weights import global_name

    mine = [global_name(n, c) for n, c, _ in adapters(chunks) if ".self_attention." not in n]
    refused = [n for part in all_gather_objects(mine[:1]) for n in part]  # every rank refuses, or none
    if refused:
        raise ValueError(f"{refused[0]}: {PEFT_REFUSED}")
    tensors = hf_adapter_tensors(chunks, conv)
    if dist.is_initialized() and dist.get_world_size() > 1:  # pipeline stages and expert ranks hold other adapters
        parts: list[dict | None] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, tensors)
        tensors = {k: v for part in parts for k, v in (part or {}).items()}
    out = Path(out)
    if not dist.is_initialized() or dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        modules = sorted({k.split(".lora_")[0].rsplit(".", 1)[-1] for k in tensors})
        config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": str(Path(source_model).resolve()),
            "r": lora_cfg.rank,
            "lora_alpha": lora_cfg.alpha,
            "lora_dropout": lora_cfg.dropout,
            "target_modules": modules,
            "bias": "none",
            "fan_in_fan_out": False,
            "inference_mode": True,
            "init_lora_weights": True,
        }
        (out / "adapter_config.json").write_text(json.dumps(config, indent=1))
        weights = {f"base_model.model.{k}": v.contiguous() for k, v in tensors.items()}
        save_file(weights, str(out / "adapter_model.safetensors"))
    if dist.is_initialized():
        dist.barrier()
    return out
