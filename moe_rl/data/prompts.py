"""Prompt sources: the built-in toy prompts, a built-in task's problems (moe_rl/data/tasks.py), jsonl/parquet files
or a `Dataset.save_to_disk` folder.

A row holds a prompt string (`data.prompt_key`) or a chat conversation (`data.messages_key`: a list
of {"role": str, "content": str}). With `data.apply_chat_template=true` every prompt is rendered by
the tokenizer's chat template (a prompt string as one user message); a conversation is never
flattened into text without it. Each prompt is tokenized once here and keeps its token ids.

Files are read here line by line (jsonl) or with pyarrow (parquet) so that every bad row is
reported with its file and line; nothing is skipped silently. Prompts longer than
min(data.max_prompt_tokens, the engine's context - sampling.max_tokens) are an error naming the
line, or are dropped with a count when `data.overlong_prompts=drop`.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from moe_rl.data.config import OVERLONG_POLICIES, ArithmeticConfig, Split
from moe_rl.data.tasks import generate


class DataError(ValueError):
    """A prompt file that cannot be used as it is; the message names the file and line."""


@dataclass
class Prompt:
    text: str
    """The prompt as the engine sees it: the row's prompt string, or its rendering by the chat
    template (data.apply_chat_template); "" for a `messages` row not rendered yet."""
    answer: str | None = None
    source: str = ""
    """Where the prompt came from (`file:line`, `file:row N`, or `toy:i`), for error messages."""
    messages: list[dict] | None = None
    """The row's chat conversation, if it had one instead of a prompt string."""
    ids: list[int] | None = None
    """Token ids of `text`, set by PromptSource when it is given a tokenizer."""


TOY_WORDS = [
    "count",
    "the",
    "numbers",
    "one",
    "two",
    "three",
    "quick",
    "brown",
    "fox",
    "experts",
    "route",
    "tokens",
    "answer",
    "question",
    "what",
    "is",
    "reward",
    "learning",
]


class PromptSource:
    """Endless shuffled prompts; each data-parallel rank reads its own disjoint stream.

    `tokenizer` (a Hugging Face tokenizer): every prompt is rendered (apply_chat_template) and
    tokenized once, its ids kept on the Prompt. A rendered prompt is tokenized without special
    tokens (the template holds them); a plain one as `tokenizer(text)` does.
    `max_prompt_tokens` (data.max_prompt_tokens) and `context_limit` (the engine's context -
    sampling.max_tokens): prompts longer than the smaller are an error naming their line
    (overlong="error") or are dropped before sharding, so every rank drops the same rows.
    """

    def __init__(
        self,
        task: str,
        path: str = "",
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        seed: int = 0,
        dp_rank: int = 0,
        dp_size: int = 1,
        *,
        messages_key: str = "messages",
        tokenizer=None,
        apply_chat_template: bool = False,
        max_prompt_tokens: int | None = None,
        context_limit: int | None = None,
        overlong: str = "error",
        answers_for: str | None = None,
        problems: tuple[ArithmeticConfig, Split, int] | None = None,
    ):
        """`answers_for`: what needs every prompt's reference answer (a reward or an environment), named in the
        error when a prompt has none; None: answers are optional. `problems` (task=arithmetic): the task's
        settings, the split and how many distinct problems of it to draw with `seed`."""
        if overlong not in OVERLONG_POLICIES:
            raise ValueError(f"data.overlong_prompts={overlong!r}: choose one of {OVERLONG_POLICIES}")
        self.items = _load(task, path, prompt_key, answer_key, messages_key, seed, problems)
        _render_and_tokenize(self.items, tokenizer, apply_chat_template, messages_key)
        # the longest prompt kept (None: no limit) and the setting it comes from, for messages
        self.token_limit, self.limit_name = _token_limit(max_prompt_tokens, context_limit)
        self.dropped = 0
        if self.token_limit is not None:
            if tokenizer is None:
                raise ValueError("a prompt token limit needs the tokenizer")
            self.items, self.dropped = _check_lengths(self.items, self.token_limit, self.limit_name, overlong)
        if answers_for is not None and (bare := next((p for p in self.items if p.answer is None), None)):
            raise DataError(
                f"{bare.source}: the prompt has no answer (data.answer_key={answer_key!r}), and {answers_for} needs "
                "one for every prompt"
            )
        if len(self.items) < dp_size:
            raise DataError(f"{len(self.items)} prompts cannot feed {dp_size} data-parallel ranks")
        self.items = self.items[dp_rank::dp_size]
        self.rng = random.Random(seed + 1000 * dp_rank)
        self.order: list[int] = []
        self.position = 0  # prompts consumed (saved in checkpoints to resume the stream)

    @classmethod
    def from_config(
        cls,
        data,
        *,
        seed: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        path: str | None = None,
        task: str | None = None,
        tokenizer=None,
        context_limit: int | None = None,
        answers_for: str | None = None,
        problems: tuple[ArithmeticConfig, Split, int] | None = None,
    ) -> PromptSource:
        """The prompts data.* (moe_rl.config.DataConfig) names: its task, file, keys, chat template and limits;
        `path` and `task` in place of data.path and data.task (validation reads data.val_path as a file)."""
        return cls(
            data.task if task is None else task,
            data.path if path is None else path,
            data.prompt_key,
            data.answer_key,
            seed,
            dp_rank,
            dp_size,
            messages_key=data.messages_key,
            tokenizer=tokenizer,
            apply_chat_template=data.apply_chat_template,
            max_prompt_tokens=data.max_prompt_tokens,
            context_limit=context_limit,
            overlong=data.overlong_prompts,
            answers_for=answers_for,
            problems=problems,
        )

    def skip(self, count: int) -> None:
        """Fast-forward `count` prompts: a resumed run continues the same stream."""
        self.next(count)

    def next(self, count: int) -> list[Prompt]:
        out = []
        for _ in range(count):
            if not self.order:
                self.order = list(range(len(self.items)))
                self.rng.shuffle(self.order)
            out.append(self.items[self.order.pop()])
            self.position += 1
        return out


def _load(task: str, path: str, prompt_key: str, answer_key: str, messages_key: str, seed: int, problems) -> list:
    """The prompts of the toy task, of a built-in task's split (`problems`), or of a prompt file."""
    if task == "toy":
        rng = random.Random(seed)
        words = [" ".join(rng.choice(TOY_WORDS) for _ in range(rng.randint(2, 8))) for _ in range(512)]
        return [Prompt(w, source=f"toy:{i}") for i, w in enumerate(words)]
    if task == "arithmetic":
        cfg, split, count = problems
        drawn = generate(cfg, split, count, seed)
        return [Prompt(p.prompt, str(p.answer), source=f"{task}:{split}:{i}") for i, p in enumerate(drawn)]
    if task == "reasoning_gym":
        # heavy: reasoning_gym, imported on first use
        from moe_rl.data.reasoning_gym import task_prompts

        cfg, split, _ = problems
        return task_prompts(cfg, split, Prompt)
    return read_prompt_file(path, prompt_key, answer_key, messages_key)


def _render_and_tokenize(items: list[Prompt], tokenizer, apply_chat_template: bool, messages_key: str) -> None:
    """Render every prompt with the chat template (data.apply_chat_template; a chat row needs it) and keep its token
    ids: a rendered prompt tokenized without special tokens (the template holds them), a plain one as
    `tokenizer(text)` does."""
    if apply_chat_template:
        if tokenizer is None:
            raise ValueError("data.apply_chat_template=true needs the model's tokenizer")
        render_chat(items, tokenizer)
    else:
        chat = next((p for p in items if p.messages is not None), None)
        if chat is not None:
            raise DataError(
                f"{chat.source}: a chat {messages_key!r} row needs data.apply_chat_template=true (the "
                "conversation is rendered by the tokenizer's chat template, never joined into plain text)"
            )
    if tokenizer is not None:
        ids = tokenizer([p.text for p in items], add_special_tokens=not apply_chat_template)["input_ids"]
        for p, prompt_ids in zip(items, ids, strict=True):
            p.ids = prompt_ids


def render_chat(items: list[Prompt], tokenizer) -> None:
    """Set each prompt's text to its chat-template rendering, ending with the assistant's turn."""
    # heavy: jinja2, imported on first use
    from jinja2 import TemplateError

    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            f"data.apply_chat_template=true, but the tokenizer of {tokenizer.name_or_path or 'the model'} has no "
            "chat template (chat_template.jinja, or chat_template in tokenizer_config.json); add one to the model "
            "folder, or set data.apply_chat_template=false and use plain prompt rows"
        )
    for p in items:
        messages = p.messages if p.messages is not None else [{"role": "user", "content": p.text}]
        try:
            p.text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except (TemplateError, ValueError) as e:
            raise DataError(f"{p.source}: the chat template rejects this conversation: {e}") from e


def _token_limit(max_prompt_tokens: int | None, context_limit: int | None) -> tuple[int | None, str]:
    """The smaller of the two limits and the setting to name in errors."""
    if max_prompt_tokens is not None and max_prompt_tokens < 1:
        raise ValueError(f"data.max_prompt_tokens={max_prompt_tokens}: must be at least 1 (or null: no limit)")
    if max_prompt_tokens is not None and (context_limit is None or max_prompt_tokens <= context_limit):
        return max_prompt_tokens, f"data.max_prompt_tokens={max_prompt_tokens}"
    if context_limit is not None:
        return context_limit, "the engine's context (rollout.max_model_len) less sampling.max_tokens"
    return None, ""


def _check_lengths(items: list[Prompt], limit: int, limit_name: str, policy: str) -> tuple[list[Prompt], int]:
    kept = [p for p in items if len(p.ids) <= limit]
    if len(kept) < len(items) and policy == "error":
        first = next(p for p in items if len(p.ids) > limit)
        fix = "raise data.max_prompt_tokens" if limit_name.startswith("data.") else "raise rollout.max_model_len"
        raise DataError(
            f"{first.source}: the prompt has {len(first.ids)} tokens, more than the {limit} allowed by {limit_name} "
            f"({len(items) - len(kept)} of {len(items)} prompts are too long). Shorten them, {fix}, or set "
            "data.overlong_prompts=drop."
        )
    if not kept:
        raise DataError(f"every one of the {len(items)} prompts is longer than {limit} tokens ({limit_name})")
    return kept, len(items) - len(kept)


def read_prompt_file(path: str, prompt_key: str, answer_key: str, messages_key: str = "messages") -> list[Prompt]:
    """Prompts of a jsonl or parquet file or a `Dataset.save_to_disk` folder; a DataError names the
    file and line (`file:line`, `file:row N` counting from 1) of any bad row."""
    items = [_prompt(where, row, prompt_key, answer_key, messages_key) for where, row in read_rows(path)]
    if not items:
        raise DataError(f"{path}: holds no prompts (empty file)")
    return items


def read_rows(path: str):
    """(where, row) of each row of a jsonl or parquet file or a `Dataset.save_to_disk` folder; `where` is `file:line`
    or `file:row N` (counting from 1)."""
    p = Path(path)
    if p.is_dir():
        return _dataset_folder_rows(p)
    if p.is_file():
        return _parquet_rows(p) if p.suffix == ".parquet" else _jsonl_rows(p)
    raise FileNotFoundError(f"data.path={path!r} does not exist")


def _prompt(where: str, row, prompt_key: str, answer_key: str, messages_key: str) -> Prompt:
    """One row as a Prompt; a missing (or null) key counts as absent."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    text, messages = row.get(prompt_key), row.get(messages_key)
    if text is None and messages is None:
        raise DataError(
            f"{where}: no key data.prompt_key={prompt_key!r} or data.messages_key={messages_key!r} "
            f"(keys: {sorted(row)})"
        )
    if text is not None and messages is not None:
        raise DataError(
            f"{where}: has both {prompt_key!r} and {messages_key!r}; keep one, or point data.prompt_key or "
            "data.messages_key at the one to use"
        )
    answer = row.get(answer_key)
    answer = None if answer is None else str(answer)
    if messages is None:
        if not isinstance(text, str) or not text.strip():
            raise DataError(f"{where}: {prompt_key!r} must be a non-empty string, got {text!r:.80}")
        return Prompt(text, answer, where)
    check_messages(where, messages, messages_key)
    return Prompt("", answer, where, messages=messages)


def check_messages(where: str, messages, messages_key: str) -> None:
    """A DataError naming the row (`where`) unless `messages` is a non-empty list of {"role", "content"} strings."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: {messages_key!r} must be a non-empty list of messages, got {messages!r:.80}")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise DataError(
                f"{where}: {messages_key!r}[{i}] must be an object with string 'role' and 'content', got {m!r:.80}"
            )


def _jsonl_rows(path: Path):
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            where = f"{path}:{number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{where}: not UTF-8 ({e.reason} at byte {e.start} of the line)") from None
            if not line.strip():
                continue
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None


def _parquet_rows(path: Path):
    # heavy: pyarrow, imported on first use
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{path}: not a readable parquet file ({e})") from None
    for number, row in enumerate(table.to_pylist(), start=1):
        yield f"{path}:row {number}", row


def _dataset_folder_rows(path: Path):
    """Rows of a folder written by `datasets.Dataset.save_to_disk`."""
    # heavy: datasets, imported on first use
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except FileNotFoundError as e:
        raise DataError(f"{path}: a folder, but not a Hugging Face dataset saved with save_to_disk ({e})") from None
    if isinstance(ds, datasets.DatasetDict):
        raise DataError(
            f"{path}: a DatasetDict with splits {list(ds)}; point data.path at one split's folder "
            f"(e.g. {path / next(iter(ds), 'train')})"
        )
    for number, row in enumerate(ds.to_list(), start=1):
        yield f"{path}:row {number}", row
