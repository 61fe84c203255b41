"""reasoning-gym tasks (the `reasoning-gym` package: procedural datasets, each with its own verifier) as rows in
verl's RL schema, and the reward that scores a response with the dataset's own `score_answer`.

Draws. A reasoning-gym dataset builds entry `idx` from `random.Random(seed + idx)`, so two draws overlap exactly when
their `seed + idx` ranges do. Every (split, seed) here owns its own range of those numbers: split train, val and test
start at 0, 2^30 and 2^31, and seed s of a split at `start + s * 2^20`, so train, validation and test (and two seeds
of one split) never build an entry from the same random stream. Questions are distinct within a draw, and a held-out
draw drops any question of the train draw it is given (`exclude`): small task spaces repeat questions across streams.
Which dataset a row comes from is a weighted choice (the datasets' weights) from a stream of its own.

Rows (verl's schema): `data_source` "reasoning_gym/<dataset>", `prompt` [{"role": "user", "content": question}],
`ability` (the dataset's category, e.g. "arithmetic"), `reward_model` {"style": "rule", "ground_truth": answer},
`extra_info` {"split", "index", "dataset", "question", "metadata", "settings"}: metadata and settings as JSON
strings (their keys differ per dataset, which one parquet schema cannot hold), what `score_answer` needs.

Answers. The prompt is the dataset's question as it is, without reasoning-gym's system prompts asking for
`<answer>` tags: a tiny model learns a bare answer, or a short worked step ending in it (`64+20=84`, the SFT
responses of `sft_row(row, "worked")`), far sooner than a tag format. `compute_score` therefore takes the last
`<answer>...</answer>` (reasoning_gym.utils.extract_answer, as reasoning-gym's own evaluation does) when the response
has one; otherwise the whole response, stripped, and, when it holds an `=`, what follows the last `=`: the score is
the better of the dataset's `score_answer` on the two.
"""

from __future__ import annotations

import json
import random
from functools import cache

from moe_rl.common.errors import ConfigError
from moe_rl.data.config import ReasoningGymConfig, ReasoningGymDataset

SOURCE_PREFIX = "reasoning_gym/"
SPLIT_STARTS = {"train": 0, "val": 2**30, "test": 2**31}
"""The first `seed + idx` of each split's range (2^30 numbers each; all below 2^32, reasoning-gym's seed range)."""
SEED_STRIDE = 2**20
"""Numbers of a split's range that one seed owns: at most this many entries per dataset per draw."""
MAX_SEED = 2**30 // SEED_STRIDE  # 1024 seeds per split
TRIES_PER_ROW = 50  # give up drawing when the task space is this exhausted (repeats and excluded questions)


DatasetSpec = ReasoningGymDataset  # one dataset of a mix: weight and settings (data.reasoning_gym.datasets)


def parse_datasets(names: str) -> dict[str, DatasetSpec]:
    """`name[:weight],name[:weight]` (the CLI's --datasets) as specs with default settings."""
    out = {}
    for item in filter(None, (s.strip() for s in names.split(","))):
        name, _, weight = item.partition(":")
        try:
            out[name] = DatasetSpec(weight=float(weight) if weight else 1.0)
        except ValueError:
            raise ConfigError(f"--datasets {item!r}: the weight after ':' must be a number") from None
    return out


def check_datasets(datasets: dict[str, DatasetSpec], prefix: str = "data.reasoning_gym.datasets") -> None:
    """Refuse an unknown dataset, a weight <= 0 or settings the dataset's config rejects, naming the key."""
    # heavy: reasoning_gym (imports its ~100 datasets), imported on first use
    import reasoning_gym

    if not datasets:
        raise ConfigError(f"{prefix}: name at least one reasoning-gym dataset")
    for name, spec in datasets.items():
        if name not in reasoning_gym.factory.DATASETS:
            raise ConfigError(f"{prefix}.{name}: not a reasoning-gym dataset (e.g. basic_arithmetic, chain_sum)")
        if not spec.weight > 0:
            raise ConfigError(f"{prefix}.{name}.weight: {spec.weight}: must be > 0")
        for key in ("seed", "size"):
            if key in spec.settings:
                raise ConfigError(f"{prefix}.{name}.settings.{key}: set by the draw (the split and seed), not here")
        try:
            _dataset(name, json.dumps(spec.settings, sort_keys=True), 0)
        except (TypeError, AssertionError, ValueError) as e:
            raise ConfigError(f"{prefix}.{name}.settings: {spec.settings}: the dataset refuses them ({e})") from None


def seed_range(split: str, seed: int) -> tuple[int, int]:
    """The `seed + idx` numbers a draw of (`split`, `seed`) builds its entries from: [start, end)."""
    if split not in SPLIT_STARTS:
        raise ConfigError(f"split {split!r}: choose one of {sorted(SPLIT_STARTS)}")
    if not 0 <= seed < MAX_SEED:
        raise ConfigError(f"seed {seed}: choose 0 to {MAX_SEED - 1}")
    start = SPLIT_STARTS[split] + seed * SEED_STRIDE
    return start, start + SEED_STRIDE


def generate(
    datasets: dict[str, DatasetSpec], split: str, n: int, seed: int, exclude: set[str] | frozenset = frozenset()
) -> list[dict]:
    """`n` rows in verl's schema with distinct questions, none in `exclude` (e.g. the train draw's questions)."""
    check_datasets(datasets)
    start, _ = seed_range(split, seed)
    names = list(datasets)
    weights = [datasets[m].weight for m in names]
    settings = {m: json.dumps(datasets[m].settings, sort_keys=True) for m in names}
    pick = random.Random(f"reasoning_gym:{split}:{seed}")  # which dataset each row is drawn from
    next_idx = dict.fromkeys(names, 0)
    seen, rows = set(exclude), []
    while len(rows) < n:
        name = pick.choices(names, weights)[0]
        idx = next_idx[name]
        if idx >= SEED_STRIDE or idx > TRIES_PER_ROW * (n + 10):
            raise ConfigError(
                f"{n} distinct {split} questions asked of {names}, but after {idx} draws of {name} only "
                f"{len(rows)} new ones came: widen the datasets' settings or ask for fewer"
            )
        next_idx[name] += 1
        entry = _dataset(name, settings[name], start)[idx]
        if entry["question"] in seen:
            continue
        seen.add(entry["question"])
        rows.append(_row(name, entry, settings[name], split, len(rows)))
    return rows


def _row(name: str, entry: dict, settings: str, split: str, index: int) -> dict:
    ds = _dataset(name, settings, 0)
    return {
        "data_source": SOURCE_PREFIX + name,
        "prompt": [{"role": "user", "content": entry["question"]}],
        "ability": ds.category,
        "reward_model": {"style": "rule", "ground_truth": str(entry["answer"])},
        "extra_info": {
            "split": split,
            "index": index,
            "dataset": name,
            "question": entry["question"],
            "metadata": json.dumps(entry["metadata"], default=str),
            "settings": settings,
        },
    }


RESPONSES = ("answer", "worked")
"""SFT responses: the bare answer, or a worked step ending in it where the dataset's metadata has the expression."""


def worked_response(row: dict) -> str:
    """The expression written out, then `=` and the answer (`64+20=84`; spaces dropped: the byte-level tokenizer
    spends a token on each), for datasets whose entries hold their `expression` (basic_arithmetic, chain_sum); the
    bare answer for the others. A tiny model learns the answer far sooner after restating the operands next to it,
    as the built-in arithmetic task's solutions do."""
    answer = row["reward_model"]["ground_truth"]
    expression = json.loads(row["extra_info"]["metadata"]).get("expression")
    return f"{expression.replace(' ', '')}={answer}" if isinstance(expression, str) else answer


def sft_row(row: dict, response: str = "answer") -> dict:
    """A verl row as an SFT conversation (TRL's `messages`): the question, then the assistant's turn: the answer
    (`response="answer"`) or a worked step ending in it (`"worked"`, `worked_response`)."""
    if response not in RESPONSES:
        raise ConfigError(f"SFT response {response!r}: choose one of {RESPONSES}")
    content = worked_response(row) if response == "worked" else row["reward_model"]["ground_truth"]
    return {"messages": [*row["prompt"], {"role": "assistant", "content": content}]}


@cache
def _dataset(name: str, settings: str, seed: int):
    """The dataset `name` with `settings` (JSON) whose entry idx comes from Random(seed + idx); cached, since some
    datasets load word lists when built."""
    # heavy: reasoning_gym (imports its ~100 datasets), imported on first use
    import reasoning_gym

    return reasoning_gym.create_dataset(name, **json.loads(settings), seed=seed, size=SEED_STRIDE)


def extract(solution_str: str) -> list[str]:
    """The candidate answers of a response: the last <answer>...</answer> if there is one; else the whole response
    stripped and, when it holds an `=` (a worked step, `64+20=84`), what follows the last `=`, stripped."""
    # heavy: reasoning_gym (imports its ~100 datasets), imported on first use
    from reasoning_gym.utils import extract_answer

    tagged = extract_answer(solution_str)
    if tagged is not None:
        return [tagged]
    whole = solution_str.strip()
    return [whole, whole.rpartition("=")[2].strip()] if "=" in whole else [whole]


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """verl's reward signature: the dataset's own `score_answer` on the response's answer (`extract`; of two
    candidates, the better score: a bare answer that holds `=` keeps its score). The entry is rebuilt from the row:
    its answer `ground_truth`, its question and metadata from `extra_info`."""
    if not data_source.startswith(SOURCE_PREFIX):
        raise ValueError(f"data_source {data_source!r} is not a reasoning-gym one ({SOURCE_PREFIX}<dataset>)")
    name = data_source[len(SOURCE_PREFIX) :]
    info = extra_info or {}
    metadata = info.get("metadata") or "{}"
    entry = {
        "question": info.get("question", ""),
        "answer": ground_truth,
        "metadata": json.loads(metadata) if isinstance(metadata, str) else dict(metadata),
    }
    ds = _dataset(name, info.get("settings") or "{}", 0)
    return max(float(ds.score_answer(answer, entry)) for answer in extract(solution_str))


def passes(score: float) -> bool:
    """A response counts as solved (pass@k) only with the full score: some datasets give partial credit."""
    return score >= 1.0


def task_rows(cfg: ReasoningGymConfig, split: str) -> list[dict]:
    """data.task=reasoning_gym: the train draw, or the val draw without the train draw's questions."""
    train = generate(cfg.datasets, "train", cfg.train_size, cfg.seed)
    if split == "train":
        return train
    return generate(cfg.datasets, split, cfg.val_size, cfg.seed, {r["extra_info"]["question"] for r in train})


def task_prompts(cfg: ReasoningGymConfig, split: str, prompt_cls) -> list:
    """data.task=reasoning_gym's prompts (moe_rl.data.prompts.Prompt, passed in to keep this module apart from the
    loaders): the row's chat messages, its ground truth as the answer, its data_source and every column."""
    out = []
    for i, row in enumerate(task_rows(cfg, split)):
        p = prompt_cls("", row["reward_model"]["ground_truth"], f"reasoning_gym:{split}:{i}", messages=row["prompt"])
        p.data_source, p.row = row["data_source"], row  # Prompt's fields (issue 79's contract)
        out.append(p)
    return out
