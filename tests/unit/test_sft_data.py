"""SFT examples (moe_rl/data/sft.py): what the loss counts (the response and its end-of-text token; a chat's
assistant turns only), prompts tokenized as the rollout engine's are, and batches that are the same global batch
whatever the data-parallel size."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from moe_rl.data.prompts import DataError
from moe_rl.data.sft import Batches, Example, _chat, _plain, check_lengths, pad


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    return AutoTokenizer.from_pretrained(tiny_models["qwen3_moe"])


def test_a_plain_example_learns_the_response_and_its_end(tokenizer):
    e = _plain("x:1", "12+30=", "42", tokenizer)
    prompt = tokenizer("12+30=")["input_ids"]  # as PromptSource tokenizes the engine's prompts
    assert e.ids[: len(prompt)] == prompt and e.mask[: len(prompt)] == [0] * len(prompt)
    learned = [t for t, m in zip(e.ids, e.mask, strict=True) if m]
    assert learned[-1] == tokenizer.eos_token_id and tokenizer.decode(learned[:-1]) == "42"


def test_a_chat_learns_its_assistant_turns_only(tokenizer):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "what is 2+2"},
        {"role": "assistant", "content": "four"},
        {"role": "user", "content": "and 3+3"},
        {"role": "assistant", "content": "six"},
    ]
    e = _chat("x:1", messages, "messages", tokenizer)
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert tokenizer.decode(e.ids) == text
    spans, current = [], []
    for t, m in zip(e.ids, e.mask, strict=True):
        if m:
            current.append(t)
        elif current:
            spans.append(tokenizer.decode(current))
            current = []
    spans += [tokenizer.decode(current)] if current else []
    assert [s.strip() for s in spans] == ["four", "six"], spans  # the turn's text to its end (the template's "\n")
    with pytest.raises(DataError, match="x:1: 'messages' has no assistant turn"):
        _chat("x:1", messages[:2], "messages", tokenizer)
    with pytest.raises(DataError, match=r"x:1: 'messages'\[2\] is an empty assistant turn"):
        _chat("x:1", [*messages[:2], {"role": "assistant", "content": ""}], "messages", tokenizer)


def test_batches_are_the_same_global_batch_for_any_data_parallel_size():
    seed = random.randrange(2**31)
    examples = [Example([i, i + 1], [0, 1], f"x:{i}") for i in range(50)]
    one = Batches(examples, 8, seed)
    two = [Batches(examples, 8, seed, r, 2) for r in range(2)]
    for _ in range(15):  # across epochs (6 batches each; the last partial one is left out)
        whole = [e.source for e in one.next()]
        parts = [[e.source for e in b.next()] for b in two]
        assert sorted(whole) == sorted(parts[0] + parts[1]) and len(parts[0]) == len(parts[1]) == 4
    resumed = Batches(examples, 8, seed)
    resumed.skip(15)
    assert [e.source for e in resumed.next()] == [e.source for e in one.next()]
    with pytest.raises(ValueError, match="batch_size=8 does not split over 3 data-parallel ranks"):
        Batches(examples, 8, seed, 0, 3)


def test_padding_and_lengths():
    examples = [Example([5, 6, 7], [0, 1, 1], "x:1"), Example([5, 6], [0, 1], "x:2")]
    b = pad(examples, 0, pad_to_multiple=4)
    assert b.input_ids.tolist() == [[5, 6, 7, 0], [5, 6, 0, 0]]
    assert b.loss_mask.tolist() == [[0, 1, 1, 0], [0, 1, 0, 0]] and b.attention_mask.sum().item() == 5
    with pytest.raises(DataError, match="x:1: 3 tokens, longer than data.max_length=2"):
        check_lengths(examples, 2, "data.max_length")
