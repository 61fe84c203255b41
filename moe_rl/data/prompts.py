"""Prompt sources: the built-in toy prompts, a built-in task's problems (moe_rl/data/tasks.py), or the rows of local
dataset files (moe_rl/data/files.py reads them as `datasets.load_dataset` does) in verl's, TRL's or moe-rl's own
format (moe_rl/data/formats.py; data.format).

A row holds a prompt string or a chat conversation (a list of {"role": str, "content": str}). A chat is rendered by
the tokenizer's chat template (under data.format=plain only with `data.apply_chat_template=true`, else it is an
error: never flattened into text); `data.apply_chat_template=true` or a `data.system_prompt` renders every prompt
(a prompt string as one user message). Each prompt is tokenized once here and keeps its token ids, and keeps its
whole row (`Prompt.row`) and `data_source` for the reward.

Every bad row is reported with its file and line (or row) and the key; nothing is skipped silently. Prompts longer
than min(data.max_prompt_tokens, the engine's context - sampling.max_tokens) are an error naming the line, or are
dropped with a count when `data.overlong_prompts=drop`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from moe_rl.data import humaneval
from moe_rl.data.config import OVERLONG_POLICIES, ArithmeticConfig, DataFormat, Split
from moe_rl.data.files import DataError, read_rows
from moe_rl.data.formats import MISSING, Keys, check_messages, lookup, present, required, resolve_keys
from moe_rl.data.tasks import generate

__all__ = ["DataError", "Prompt", "PromptSource", "check_messages", "read_prompt_file", "read_prompts", "read_rows"]


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
    data_source: str = ""
    """The row's `data_source` column (verl's: which dataset, which scorer); "" when the row has none."""
    row: dict = field(default_factory=dict)
    """Every column of the row as read (nested dicts and lists kept as they are)."""


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
    `keys` (task=file): the format and columns the rows were read by (its `describe` is the start-up line).
    """

    def __init__(
        self,
        task: str,
        path: str | list[str] = "",
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
        format: DataFormat | str = DataFormat.auto,  # noqa: A002 - the setting's name (data.format)
        split: str = "train",
        chat: ChatSettings | None = None,
    ):
        """`answers_for`: what needs every prompt's reference answer (a reward or an environment), named in the
        error when a prompt has none; None: answers are optional. `problems` (task=arithmetic): the task's
        settings, the split and how many distinct problems of it to draw with `seed`. `format`, `split`: how a
        file's rows are read (data.format, data.split); `chat`: data.system_prompt and data.chat_template_kwargs."""
        if overlong not in OVERLONG_POLICIES:
            raise ValueError(f"data.overlong_prompts={overlong!r}: choose one of {OVERLONG_POLICIES}")
        self.keys: Keys | None = None
        if task in ("toy", "arithmetic", "reasoning_gym", "humaneval"):
            self.items = _task_prompts(task, seed, problems)
        else:
            self.items, self.keys = read_prompts(path, prompt_key, answer_key, messages_key, format, split)
        chat = chat or ChatSettings()
        # reasoning-gym's rows are chats, rendered as a verl file's are
        chat_rendered = task == "reasoning_gym" or (self.keys is not None and self.keys.chat_rendered)
        _render_and_tokenize(self.items, tokenizer, apply_chat_template, chat, chat_rendered, messages_key)
        # the longest prompt kept (None: no limit) and the setting it comes from, for messages
        self.token_limit, self.limit_name = _token_limit(max_prompt_tokens, context_limit)
        self.dropped = 0
        if self.token_limit is not None:
            if tokenizer is None:
                raise ValueError("a prompt token limit needs the tokenizer")
            what = path or task
            self.items, self.dropped = _check_lengths(self.items, self.token_limit, self.limit_name, overlong, what)
        if answers_for is not None and (bare := next((p for p in self.items if p.answer is None), None)):
            key = self.keys.answer if self.keys is not None else answer_key
            raise DataError(
                f"{bare.source}: the prompt has no answer (data.answer_key={key!r}), and {answers_for} needs "
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
        path: str | list[str] | None = None,
        task: str | None = None,
        tokenizer=None,
        context_limit: int | None = None,
        answers_for: str | None = None,
        problems: tuple[ArithmeticConfig, Split, int] | None = None,
        split: str | None = None,
    ) -> PromptSource:
        """The prompts data.* (moe_rl.config.DataConfig) names: its task, file, format, keys, chat template and
        limits; `path`, `task` and `split` in place of data.path, data.task and data.split (validation reads each
        of data.val_path's sets as a file)."""
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
            format=data.format,
            split=data.split if split is None else split,
            chat=ChatSettings.of(data),
        )

    def describe(self, where: str) -> str | None:
        """The start-up line naming the file and its format (None for a built-in task)."""
        return None if self.keys is None else self.keys.describe(where)

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


@dataclass(frozen=True)
class ChatSettings:
    """How chats are rendered beyond the template itself: data.system_prompt and data.chat_template_kwargs."""

    system_prompt: str = ""
    """Prepended as a system message to every prompt (a chat that starts with its own system message keeps it)."""
    template_kwargs: dict = field(default_factory=dict)
    """Passed to `apply_chat_template` (e.g. Qwen3's enable_thinking=False)."""

    @classmethod
    def of(cls, data) -> ChatSettings:
        """The settings of a data section (RL's or SFT's)."""
        return cls(data.system_prompt, dict(data.chat_template_kwargs or {}))

    def conversation(self, messages: list[dict]) -> list[dict]:
        """`messages` with the system prompt in front (unless they start with a system message of their own)."""
        if not self.system_prompt or (messages and messages[0]["role"] == "system"):
            return messages
        return [{"role": "system", "content": self.system_prompt}, *messages]

    def render(self, tokenizer, messages: list[dict], generation_prompt: bool) -> str:
        """The chat template's text of `messages` (the system prompt in front), with the template kwargs."""
        return tokenizer.apply_chat_template(
            self.conversation(messages),
            add_generation_prompt=generation_prompt,
            tokenize=False,
            **self.template_kwargs,
        )


def _task_prompts(task: str, seed: int, problems) -> list[Prompt]:
    """The prompts of the toy task or of a built-in task's split (`problems`)."""
    if task == "toy":
        rng = random.Random(seed)
        words = [" ".join(rng.choice(TOY_WORDS) for _ in range(rng.randint(2, 8))) for _ in range(512)]
        return [Prompt(w, source=f"toy:{i}", data_source="toy") for i, w in enumerate(words)]
    if task == "reasoning_gym":
        # heavy: reasoning_gym, imported on first use
        from moe_rl.data.reasoning_gym import task_prompts

        cfg, split, _ = problems
        return task_prompts(cfg, split, Prompt)
    if task == "humaneval":
        cfg, split, _ = problems
        return humaneval.task_prompts(cfg, str(split), Prompt)
    cfg, split, count = problems
    drawn = generate(cfg, split, count, seed)
    return [
        Prompt(p.prompt, str(p.answer), f"{task}:{split}:{i}", data_source=task, row=p.row())
        for i, p in enumerate(drawn)
    ]


def _render_and_tokenize(
    items: list[Prompt], tokenizer, apply_chat_template: bool, chat: ChatSettings, chat_rendered: bool, messages_key
) -> None:
    """Render the prompts with the chat template and keep their token ids: every prompt under
    data.apply_chat_template or a data.system_prompt, else the chat rows (verl, trl; under plain a chat row without
    the flag is an error). A rendered prompt is tokenized without special tokens (the template holds them), a plain
    one as `tokenizer(text)` does."""
    every = apply_chat_template or bool(chat.system_prompt)
    if not every and not chat_rendered:
        first = next((p for p in items if p.messages is not None), None)
        if first is not None:
            raise DataError(
                f"{first.source}: a chat {messages_key!r} row needs data.apply_chat_template=true under "
                "data.format=plain (the conversation is rendered by the tokenizer's chat template, never joined "
                "into plain text; data.format=trl or verl renders chats by itself)"
            )
    rendered = [p for p in items if every or p.messages is not None]
    if rendered:
        if tokenizer is None:
            raise ValueError("rendering prompts with the chat template needs the model's tokenizer")
        render_chat(rendered, tokenizer, chat)
    if tokenizer is not None:
        for group, special in ((rendered, False), ([p for p in items if not (every or p.messages)], True)):
            if group:
                ids = tokenizer([p.text for p in group], add_special_tokens=special)["input_ids"]
                for p, prompt_ids in zip(group, ids, strict=True):
                    p.ids = prompt_ids


def render_chat(items: list[Prompt], tokenizer, chat: ChatSettings | None = None) -> None:
    """Set each prompt's text to its chat-template rendering, ending with the assistant's turn."""
    # heavy: jinja2, imported on first use
    from jinja2 import TemplateError

    chat = chat or ChatSettings()
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            "the prompts are rendered with a chat template (chat rows, a data.system_prompt or "
            f"data.apply_chat_template=true, but the tokenizer of {tokenizer.name_or_path or 'the model'} has no "
            "chat template "
            "(chat_template.jinja, or chat_template in tokenizer_config.json); add one to the model folder, or use "
            "plain prompt rows with data.apply_chat_template=false"
        )
    for p in items:
        messages = p.messages if p.messages is not None else [{"role": "user", "content": p.text}]
        try:
            p.text = chat.render(tokenizer, messages, generation_prompt=True)
        except (TemplateError, ValueError, TypeError) as e:
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


def _check_lengths(items: list[Prompt], limit: int, limit_name: str, policy: str, what) -> tuple[list[Prompt], int]:
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
        raise DataError(
            f"{what}: no prompt is left: every one of the {len(items)} prompts is longer than {limit} tokens "
            f"({limit_name}; data.overlong_prompts=drop dropped them all)"
        )
    return kept, len(items) - len(kept)


def read_prompts(
    path: str | list[str],
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    messages_key: str = "messages",
    format: DataFormat | str = DataFormat.auto,  # noqa: A002 - the setting's name (data.format)
    split: str = "train",
) -> tuple[list[Prompt], Keys]:
    """The prompts of local dataset files (moe_rl/data/files.py) read in `format` (auto: detected from the first
    row), and the Keys they were read by; a DataError names the file and line (`file:line`, `file:row N` from 1) and
    the key of any bad row."""
    rows = read_rows(path, split)
    if not rows:
        raise DataError(f"{path}: holds no prompts (empty file)")
    keys = resolve_keys(format, rows[0][1], prompt=prompt_key, answer=answer_key, messages=messages_key)
    return [row_prompt(where, row, keys) for where, row in rows], keys


def read_prompt_file(path: str, prompt_key: str, answer_key: str, messages_key: str = "messages", **how) -> list:
    """The Prompts of `read_prompts` (`how`: format, split)."""
    return read_prompts(path, prompt_key, answer_key, messages_key, **how)[0]


def row_prompt(where: str, row, keys: Keys) -> Prompt:
    """One row as a Prompt, read by `keys`; a missing (or null) key counts as absent, but a dotted answer path (a
    nested column: verl's reward_model.ground_truth) must be in every row."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    text, messages = lookup(row, keys.prompt), lookup(row, keys.messages)
    if keys.format != DataFormat.plain and isinstance(text, list):
        text, messages = MISSING, text  # a conversational prompt (verl's, TRL's)
        where_messages = keys.prompt
    else:
        where_messages = keys.messages
    if text is MISSING and messages is MISSING:
        raise DataError(
            f"{where}: no key data.prompt_key={keys.prompt!r} or data.messages_key={keys.messages!r} "
            f"(keys: {sorted(present(row))})"
        )
    if text is not MISSING and messages is not MISSING:
        raise DataError(
            f"{where}: has both {keys.prompt!r} and {keys.messages!r}; keep one, or point data.prompt_key or "
            "data.messages_key at the one to use"
        )
    if "." in keys.answer and keys.answer not in row:
        answer = required(where, row, keys.answer, "data.answer_key")
    else:
        answer = lookup(row, keys.answer)
    answer = None if answer is MISSING else str(answer)
    source = row.get("data_source")
    common = {"data_source": "" if source is None else str(source), "row": row}
    if messages is MISSING:
        if not isinstance(text, str) or not text.strip():
            raise DataError(f"{where}: {keys.prompt!r} must be a non-empty string, got {text!r:.80}")
        return Prompt(text, answer, where, **common)
    check_messages(where, messages, where_messages)
    return Prompt("", answer, where, messages=messages, **common)
