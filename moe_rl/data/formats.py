"""Which columns of a row hold what (data.format): verl's RL schema, TRL's dataset formats, or moe-rl's own keys.

- verl: `prompt` is a list of chat messages, the reference answer is `reward_model.ground_truth`, and `data_source`,
  `ability`, `extra_info` ride along with the row.
- trl: `prompt` is a string (standard) or chat messages (conversational); `completion` (SFT) the same; or one
  conversation under `messages`.
- plain: `data.prompt_key` holds a string, `data.messages_key` a chat, `data.answer_key` the answer (moe-rl's keys
  as they were before formats).
- auto (default): chosen from the columns of the first row.

Every key may be a dotted path into nested columns (`reward_model.ground_truth`, `extra_info.answer`); a key left at
its default takes the format's own column (verl's answer is `reward_model.ground_truth` unless data.answer_key is
set to another key; TRL's response is `completion` unless data.response_key is). A chat row of the verl or TRL
format is rendered with the tokenizer's chat template without data.apply_chat_template (their chats always are);
under plain it still needs the flag.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_rl.data.config import DataFormat
from moe_rl.data.files import DataError

MISSING = object()
"""What `lookup` returns for a path the row does not hold."""

DEFAULT_KEYS = {"prompt": "prompt", "messages": "messages", "answer": "answer", "response": "response"}
"""The keys' defaults (data.prompt_key, ...): a key left at its default takes the format's column."""

FORMAT_KEYS = {
    DataFormat.verl: {"answer": "reward_model.ground_truth"},
    DataFormat.trl: {"response": "completion"},
    DataFormat.plain: {},
}


def lookup(row: dict, path: str):
    """The value at `path` in `row`: a column of that exact name, else the dotted path through nested dicts (and
    list indices: `prompt.0.content`); MISSING when the row does not hold it. A null counts as missing."""
    if path in row:
        return MISSING if row[path] is None else row[path]
    value = row
    for part in path.split("."):
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return MISSING
    return MISSING if value is None else value


def is_chat(value) -> bool:
    """Whether `value` looks like chat messages (a list of dicts with a role); `check_messages` checks them whole."""
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)


def check_messages(where: str, messages, key: str) -> None:
    """A DataError naming the row (`where`) and the key unless `messages` is a non-empty list of
    {"role", "content"} strings."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: {key!r} must be a non-empty list of messages, got {messages!r:.80}")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise DataError(f"{where}: {key!r}[{i}] must be an object with string 'role' and 'content', got {m!r:.80}")


@dataclass(frozen=True)
class Keys:
    """The columns a dataset's rows are read by: the format (never auto) and each key, with why the format."""

    format: DataFormat
    prompt: str
    messages: str
    answer: str
    response: str
    reason: str

    @property
    def chat_rendered(self) -> bool:
        """Whether chat rows are rendered with the chat template without data.apply_chat_template (verl, trl)."""
        return self.format != DataFormat.plain

    def describe(self, where: str) -> str:
        """The start-up line naming the file and the format: `[moe-rl] data: <where>: format verl (...)`."""
        answer = f", answer {self.answer!r}" if self.answer else ""
        return f"[moe-rl] data: {where}: format {self.format} ({self.reason}); prompt {self.prompt!r}{answer}"


def detect(row, prompt_key: str, messages_key: str) -> tuple[DataFormat, str]:
    """The format of a dataset from its first row, and the reason, for the start-up line."""
    if not isinstance(row, dict):
        return DataFormat.plain, "the first row is not an object"
    prompt = lookup(row, prompt_key)
    if is_chat(prompt) and isinstance(row.get("reward_model"), dict):
        return DataFormat.verl, f"detected: {prompt_key!r} holds chat messages and the row has 'reward_model'"
    if is_chat(prompt):
        return DataFormat.trl, f"detected: {prompt_key!r} holds chat messages"
    if lookup(row, "completion") is not MISSING:
        return DataFormat.trl, "detected: the row has 'completion'"
    if is_chat(lookup(row, messages_key)):
        return DataFormat.trl, f"detected: {messages_key!r} holds chat messages"
    return DataFormat.plain, f"detected: {prompt_key!r} is not chat messages"


def resolve_keys(fmt: DataFormat | str, first_row, **keys: str) -> Keys:
    """The Keys of `fmt` (auto: detected from `first_row`) with the settings `keys` (prompt, messages, answer,
    response: data.prompt_key, ...), each left at its default replaced by the format's own column."""
    given = DEFAULT_KEYS | keys
    fmt = DataFormat(fmt)
    if fmt == DataFormat.auto:
        fmt, reason = detect(first_row, given["prompt"], given["messages"])
    else:
        reason = f"data.format={fmt}"
    own = FORMAT_KEYS[fmt]
    chosen = {k: own.get(k, v) if v == DEFAULT_KEYS[k] else v for k, v in given.items()}
    return Keys(fmt, chosen["prompt"], chosen["messages"], chosen["answer"], chosen["response"], reason)


def required(where: str, row: dict, path: str, setting: str):
    """The value at `path`, or a DataError naming the row, the setting and the path (and the keys the row has)."""
    value = lookup(row, path)
    if value is MISSING:
        raise DataError(f"{where}: no {setting}={path!r} in the row (null or absent; its keys: {sorted(present(row))})")
    return value


def present(row: dict) -> list[str]:
    """The row's keys that hold a value (datasets fills a column a row lacks with null)."""
    return [k for k, v in row.items() if v is not None]
