"""Supervised fine-tuning examples: a prompt and the response to learn, tokenized, with the tokens the loss counts.

From local dataset files (read as prompt files are, moe_rl/data/files.py, so a bad row is named by file and line;
data.format as for prompts, moe_rl/data/formats.py): rows with a prompt (`data.prompt_key`) and a response
(`data.response_key`; TRL's `completion`), or a chat (`data.messages_key`) rendered with the tokenizer's chat
template, the loss on the assistant turns only. TRL's conversational prompt-completion pairs (`prompt` and
`completion` both chat messages) are rendered whole, the loss on the completion only. With `data.system_prompt`
every row is a chat with that system message first (a prompt/response pair as a user and an assistant turn).
From a built-in task (moe_rl/data/tasks.py): its prompts and worked solutions. A plain prompt is tokenized as the
rollout engine's prompts are (`tokenizer(prompt)`), the response after it on its own, ended by the end-of-text
token, so that what the model learns to write is what it writes when the engine samples after that prompt.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import torch

from moe_rl.common.batch import PaddedBatch
from moe_rl.data.config import ArithmeticConfig, DataFormat, Split
from moe_rl.data.files import DataError, read_rows
from moe_rl.data.formats import MISSING, Keys, check_messages, lookup, present, resolve_keys
from moe_rl.data.prompts import ChatSettings
from moe_rl.data.tasks import generate


@dataclass
class Example:
    ids: list[int]  # the whole sequence: prompt then response
    mask: list[int]  # 1 on the tokens the loss counts (the response; a chat's assistant turns)
    source: str  # file:line, or task:split:index


def task_examples(cfg: ArithmeticConfig, split: Split | str, n: int, seed: int, tokenizer) -> list[Example]:
    """`n` problems of a task's split with their worked solutions."""
    rows = [(f"arithmetic:{split}:{i}", p.prompt, p.response) for i, p in enumerate(generate(cfg, split, n, seed))]
    return [_plain(where, prompt, response, tokenizer) for where, prompt, response in rows]


def read_examples(path: str | list[str], prompt_key: str, response_key: str, messages_key: str, tokenizer, **how):
    """The examples of `read_sft` (`how`: format, split, chat)."""
    return read_sft(path, prompt_key, response_key, messages_key, tokenizer, **how)[0]


def read_sft(
    path: str | list[str],
    prompt_key: str,
    response_key: str,
    messages_key: str,
    tokenizer,
    *,
    format: DataFormat | str = DataFormat.auto,  # noqa: A002 - the setting's name (data.format)
    split: str = "train",
    chat: ChatSettings | None = None,
) -> tuple[list[Example], Keys]:
    """The examples of local dataset files (moe_rl/data/files.py) read in `format` (auto: detected from the first
    row), and the Keys they were read by; a DataError names the file and line and the key of a row that cannot be
    one."""
    rows = read_rows(path, split)
    if not rows:
        raise DataError(f"{path}: holds no examples (empty file)")
    keys = resolve_keys(format, rows[0][1], prompt=prompt_key, response=response_key, messages=messages_key)
    chat = chat or ChatSettings()
    return [_example(where, row, keys, tokenizer, chat) for where, row in rows], keys


def _example(where: str, row, keys: Keys, tokenizer, chat: ChatSettings) -> Example:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    messages = lookup(row, keys.messages)
    if messages is not MISSING:
        return _chat(where, messages, keys.messages, tokenizer, chat)
    prompt, response = lookup(row, keys.prompt), lookup(row, keys.response)
    if prompt is MISSING or response is MISSING:
        missing = [k for k, v in ((keys.prompt, prompt), (keys.response, response)) if v is MISSING]
        raise DataError(
            f"{where}: no {' or '.join(repr(k) for k in missing)} (an SFT row has data.prompt_key and "
            f"data.response_key, or data.messages_key with an assistant turn; keys: {sorted(present(row))})"
        )
    if keys.format != DataFormat.plain and (isinstance(prompt, list) or isinstance(response, list)):
        return _completion(where, (keys.prompt, prompt), (keys.response, response), tokenizer, chat)
    for key, value in ((keys.prompt, prompt), (keys.response, response)):
        if not isinstance(value, str) or not value.strip():
            raise DataError(f"{where}: {key!r} must be a non-empty string, got {value!r:.80}")
    if chat.system_prompt:  # a system message exists only in a chat: the pair becomes one
        turns = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
        return _chat(where, turns, keys.messages, tokenizer, chat)
    return _plain(where, prompt, response, tokenizer)


def _completion(where: str, prompt: tuple[str, list], completion: tuple[str, list], tokenizer, chat) -> Example:
    """TRL's conversational prompt-completion pair: the prompt rendered with the generation prompt, the loss on the
    completion's tokens only (everything the template writes after the prompt, as TRL's completion mask)."""
    for key, value in (prompt, completion):
        if not isinstance(value, list):
            raise DataError(
                f"{where}: {key!r} must be chat messages like {prompt[0]!r} and {completion[0]!r} (TRL's "
                f"conversational prompt-completion), got {value!r:.80}"
            )
        check_messages(where, value, key)
    conversation = chat.conversation([*prompt[1], *completion[1]])
    start = len(conversation) - len(completion[1])
    return _masked(where, conversation, [(start, len(conversation))], tokenizer, chat.template_kwargs)


def _plain(where: str, prompt: str, response: str, tokenizer) -> Example:
    prompt_ids = tokenizer(prompt)["input_ids"]
    response_ids = [*tokenizer(response, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
    return Example(prompt_ids + response_ids, [0] * len(prompt_ids) + [1] * len(response_ids), where)


def _chat(where: str, messages, messages_key: str, tokenizer, chat: ChatSettings | None = None) -> Example:
    """A conversation rendered with the chat template; the loss on each assistant turn's tokens (the template's
    text after the generation prompt up to the end of that turn)."""
    chat = chat or ChatSettings()
    check_messages(where, messages, messages_key)
    messages = chat.conversation(messages)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
        raise DataError(f"{where}: {messages_key!r} has no assistant turn to learn")
    empty = next((i for i in turns if not messages[i]["content"].strip()), None)
    if empty is not None:
        raise DataError(f"{where}: {messages_key!r}[{empty}] is an empty assistant turn")
    return _masked(where, messages, [(i, i + 1) for i in turns], tokenizer, chat.template_kwargs)


def _masked(where: str, messages: list[dict], spans: list[tuple[int, int]], tokenizer, kwargs: dict) -> Example:
    """`messages` rendered with the chat template, the loss on the messages of each span [i, j): the template's text
    after the generation prompt that follows message i - 1 up to the end of message j - 1."""

    def render(upto: int, prompt: bool) -> str:
        return tokenizer.apply_chat_template(messages[:upto], tokenize=False, add_generation_prompt=prompt, **kwargs)

    # Each span is the text after its generation prompt up to the end of its last message; the pieces between are
    # tokenized on their own, as the engine tokenizes a prompt ending with the generation prompt.
    text, cuts = render(len(messages), False), [0]
    for i, j in spans:
        start, end = render(i, True), render(j, False)
        if not (text.startswith(end) and end.startswith(start) and len(start) >= cuts[-1]):
            raise DataError(
                f"{where}: the chat template renders turn {i} differently inside the whole conversation, so its "
                "tokens cannot be told apart; an SFT chat needs a template whose rendering of a prefix of the "
                "conversation is a prefix of the whole"
            )
        cuts += [len(start), len(end)]
    cuts.append(len(text))
    ids, mask = [], []
    for k, (a, b) in enumerate(itertools.pairwise(cuts)):
        piece = tokenizer(text[a:b], add_special_tokens=False)["input_ids"] if b > a else []
        ids += piece
        mask += [k % 2] * len(piece)  # odd pieces are the learned spans
    return Example(ids, mask, where)


def check_lengths(examples: list[Example], limit: int, name: str) -> None:
    """A DataError naming the first example longer than `limit` tokens (`name`: the setting the limit comes from)."""
    long = next((e for e in examples if len(e.ids) > limit), None)
    if long is not None:
        raise DataError(f"{long.source}: {len(long.ids)} tokens, longer than {name}={limit}")


class Batches:
    """Endless batches of `batch_size` examples in epochs shuffled with `seed`, the same global batch whatever the
    data-parallel size: rank r of `dp_size` takes the batch's examples r, r + dp_size, ... `position` counts the
    batches handed out (a checkpoint keeps it; `skip` resumes there)."""

    def __init__(self, examples: list[Example], batch_size: int, seed: int, dp_rank: int = 0, dp_size: int = 1):
        if batch_size % dp_size:
            raise ValueError(f"batch_size={batch_size} does not split over {dp_size} data-parallel ranks")
        if len(examples) < batch_size:
            raise DataError(f"{len(examples)} examples cannot fill a batch of {batch_size}")
        self.examples, self.batch_size, self.seed = examples, batch_size, seed
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.position = 0
        self._epoch: tuple[int, list[int]] | None = None  # (epoch, its order): shuffled once per epoch

    def _order(self, epoch: int) -> list[int]:
        if self._epoch is None or self._epoch[0] != epoch:
            order = list(range(len(self.examples)))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._epoch = (epoch, order)
        return self._epoch[1]

    def next(self) -> list[Example]:
        per_epoch = len(self.examples) // self.batch_size  # the last partial batch of an epoch is left out
        epoch, index = divmod(self.position, per_epoch)
        rows = self._order(epoch)[index * self.batch_size : (index + 1) * self.batch_size]
        self.position += 1
        return [self.examples[i] for i in rows[self.dp_rank :: self.dp_size]]

    def skip(self, count: int) -> None:
        self.position += count


def pad(examples: list[Example], pad_id: int, pad_to_multiple: int = 1, min_length: int = 0) -> PaddedBatch:
    """Right-padded tensors of `examples`; loss_mask marks the tokens the loss counts."""
    t = max(max(len(e.ids) for e in examples), min_length)
    t += (-t) % pad_to_multiple
    ids = torch.full((len(examples), t), pad_id, dtype=torch.long)
    attn = torch.zeros(len(examples), t, dtype=torch.long)
    mask = torch.zeros(len(examples), t, dtype=torch.float32)
    for i, e in enumerate(examples):
        ids[i, : len(e.ids)] = torch.tensor(e.ids)
        attn[i, : len(e.ids)] = 1
        mask[i, : len(e.ids)] = torch.tensor(e.mask, dtype=torch.float32)
    return PaddedBatch(ids, attn, mask, torch.zeros(len(examples), t), None)


def reasoning_gym_examples(cfg, split: str, tokenizer) -> list[Example]:
    """data.task=reasoning_gym: each question as a chat (the tokenizer's template), its answer the assistant's turn."""
    # heavy: reasoning_gym, imported on first use
    from moe_rl.data.reasoning_gym import sft_row, task_rows

    rows = task_rows(cfg, split)
    return [
        _chat(f"reasoning_gym:{split}:{i}", sft_row(r)["messages"], "messages", tokenizer) for i, r in enumerate(rows)
    ]
