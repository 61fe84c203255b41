"""Score an HF model folder on a built-in task's split through the vLLM engine: pass@1 greedy and pass@k of k samples
at a temperature (a prompt passes when one of its k samples ends with the right answer).

Examples:
  python -m moe_rl.tools.evaluate --model runs/sft_2026-11-27_20-00-00/hf --split test --n 500
  python -m moe_rl.tools.evaluate --model OUT/rl/hf --operands 3 --digits 2 --k 8 --temperature 1.0 --out eval.json

Prints one JSON line: {"pass@1": ..., "pass@<k>": ..., "problems": n, "split": ..., "seconds": ...}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from moe_rl.data.config import ArithmeticConfig, Split
from moe_rl.data.rewards import numeric_answer_reward
from moe_rl.data.tasks import generate
from moe_rl.rollout.config import RolloutConfig, SamplingConfig


def evaluate(
    model: str, cfg: ArithmeticConfig, split: str, n: int, seed: int, k: int, temperature: float, max_tokens: int
) -> dict[str, float]:
    """pass@1 (greedy) and pass@k over `n` problems of `split`, in one engine."""
    # heavy: transformers and the vLLM engine, imported on first use
    from transformers import AutoConfig, AutoTokenizer

    from moe_rl.rollout.engine import RolloutEngine
    from moe_rl.routing.model_layout import moe_layout

    start = time.perf_counter()
    problems = generate(cfg, split, n, seed)
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = tokenizer([p.prompt for p in problems])["input_ids"]  # as the trainer's prompt source does
    answers = [str(p.answer) for p in problems]
    lay = moe_layout(AutoConfig.from_pretrained(model))
    engine_cfg = RolloutConfig(model=model, dtype="float32", capture="none")
    out = {}
    with RolloutEngine(engine_cfg, lay.moe_layers, lay.num_experts, lay.topk) as engine:
        for name, samples, temp in (("pass@1", 1, 0.0), (f"pass@{k}", k, temperature)):
            batch = engine.generate(
                prompts, SamplingConfig(n=samples, temperature=temp, max_tokens=max_tokens, seed=seed)
            )
            texts = tokenizer.batch_decode(batch.response_ids, skip_special_tokens=True)
            correct = numeric_answer_reward(texts, [answers[i] for i in batch.prompt_index], batch.response_ids)
            solved = [0.0] * n
            for i, c in zip(batch.prompt_index, correct, strict=True):
                solved[i] = max(solved[i], c)
            out[name] = sum(solved) / n
    return out | {"problems": n, "split": split, "seconds": round(time.perf_counter() - start, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m moe_rl.tools.evaluate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", required=True, help="HF model folder (an SFT or RL run's hf/)")
    parser.add_argument("--split", choices=[s.value for s in Split], default="test")
    parser.add_argument("--n", type=int, default=500, help="problems scored")
    parser.add_argument("--seed", type=int, default=7, help="which problems of the split, and the sampling seed")
    parser.add_argument("--k", type=int, default=8, help="samples per problem for pass@k")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of pass@k")
    parser.add_argument("--max-tokens", type=int, default=64, help="longest response")
    parser.add_argument("--out", help="also write the JSON line to this file")
    for name, value in asdict(ArithmeticConfig()).items():
        parser.add_argument(
            f"--{name}", type=type(value), default=value, help="the task's setting (as data.arithmetic)"
        )
    a = parser.parse_args(argv)
    if not (Path(a.model) / "config.json").is_file():
        parser.error(f"--model {a.model}: no config.json there (an HF folder, e.g. an SFT run's hf/)")
    cfg = ArithmeticConfig(**{k: getattr(a, k) for k in asdict(ArithmeticConfig())})
    cfg.check(prefix="--")
    result = evaluate(a.model, cfg, a.split, a.n, a.seed, a.k, a.temperature, a.max_tokens)
    line = json.dumps(result)
    print(line)
    if a.out:
        Path(a.out).write_text(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
