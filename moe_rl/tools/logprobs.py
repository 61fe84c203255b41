"""Print per-token log-probs and entropies of the Megatron actor for a few prompts.

Loads an HF MoE folder into megatron-core under the requested parallel layout and scores the
prompts (teacher forcing). Useful to check a model conversion before training.

Examples:
  python -m moe_rl.tools.logprobs --model /tmp/tiny-qwen3
  torchrun --nproc-per-node=2 -m moe_rl.tools.logprobs --model /tmp/tiny-qwen3 --tp 2
  torchrun --nproc-per-node=2 -m moe_rl.tools.logprobs --model /tmp/tiny-qwen3 --ep 2 \\
      --prompt "Question: what is 2 + 2? Answer: 4"
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from moe_rl.actor.config import ParallelConfig
from moe_rl.actor.forward import compute_logprobs
from moe_rl.actor.model import ModelOptions, load_model
from moe_rl.actor.parallel import destroy_distributed, init_distributed

DEFAULT_PROMPTS = ["Question: what is 12 + 30? Answer: 42", "The quick brown fox jumps over the lazy dog."]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m moe_rl.tools.logprobs",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, help="HF model folder (config.json, safetensors, tokenizer)")
    p.add_argument("--prompt", action="append", help="text to score (repeatable); default: two examples")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    p.add_argument("--ep", type=int, default=1, help="expert parallel size")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="actor dtype")
    a = p.parse_args(argv)

    # heavy: rich and transformers, imported on first use
    from rich.console import Console
    from rich.table import Table
    from transformers import AutoTokenizer

    parallel = ParallelConfig(tp=a.tp, pp=a.pp, ep=a.ep)
    init_distributed(parallel)
    loaded = load_model(a.model, parallel, ModelOptions(dtype=a.dtype))
    chunks, conv = loaded.chunks, loaded.conv
    tok = AutoTokenizer.from_pretrained(a.model)
    prompts = a.prompt or DEFAULT_PROMPTS
    enc = [tok(t)["input_ids"] for t in prompts]
    length = max(len(e) for e in enc)
    ids = torch.zeros(len(enc), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, e in enumerate(enc):
        ids[i, : len(e)] = torch.tensor(e)
        mask[i, : len(e)] = 1
    out = compute_logprobs(chunks, ids, mask)
    if dist.get_rank() == 0:
        console = Console()
        console.print(
            f"[bold]{conv.model_type}[/] {a.model}  world={dist.get_world_size()} "
            f"tp={a.tp} pp={a.pp} ep={a.ep} dtype={a.dtype}"
        )
        for i, text in enumerate(prompts):
            table = Table(title=f"prompt {i}: {text!r}")
            for col in ("pos", "token", "logprob", "entropy"):
                table.add_column(col, justify="right" if col != "token" else "left")
            for t in range(1, len(enc[i])):
                table.add_row(
                    str(t), repr(tok.decode([enc[i][t]])), f"{out['logprobs'][i, t]:.4f}", f"{out['entropy'][i, t]:.4f}"
                )
            console.print(table)
            n = len(enc[i]) - 1
            console.print(f"mean logprob {out['logprobs'][i, 1 : n + 1].sum() / n:.4f} over {n} tokens")
    destroy_distributed()


if __name__ == "__main__":
    main()
