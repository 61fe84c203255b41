"""Chat prompts (data.apply_chat_template), dataset folders and data.max_prompt_tokens: rendering
matches the template, ids are tokenized once without a second BOS, every bad row names its place."""

from __future__ import annotations

import json

import jinja2
import pytest

from moe_rl.data.prompts import DataError, PromptSource, read_prompt_file
from moe_rl.models.tiny import CHAT_TEMPLATE, build_tokenizer

CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12 + 30?"}]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(512)


def _jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_tiny_chat_template_renders_a_conversation(tok):
    want = "<|system|>\nBe brief.\n<|user|>\nWhat is 12 + 30?\n<|assistant|>\n"
    by_hand = jinja2.Template(CHAT_TEMPLATE).render(messages=CONVERSATION, add_generation_prompt=True)
    assert by_hand == want
    assert tok.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=False) == want


def test_chat_rows_and_prompt_rows_are_rendered_and_tokenized_once(tmp_path, tok):
    path = _jsonl(tmp_path / "p.jsonl", [{"messages": CONVERSATION, "answer": 42}, {"prompt": "Count to ten."}])
    src = PromptSource("file", path, tokenizer=tok, apply_chat_template=True)
    chat, plain = src.items
    assert chat.text == "<|system|>\nBe brief.\n<|user|>\nWhat is 12 + 30?\n<|assistant|>\n"
    assert chat.answer == "42" and chat.messages == CONVERSATION
    assert plain.text == "<|user|>\nCount to ten.\n<|assistant|>\n"
    for p in src.items:
        assert p.ids == tok(p.text, add_special_tokens=False)["input_ids"]
    plain_src = PromptSource("file", _jsonl(tmp_path / "q.jsonl", [{"prompt": "Count to ten."}]), tokenizer=tok)
    assert plain_src.items[0].text == "Count to ten." and plain_src.items[0].ids == tok("Count to ten.")["input_ids"]


def test_a_template_holding_bos_gives_one_bos(tmp_path):
    """A tokenizer that adds BOS and a template that writes it: the ids hold it once."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    tok = build_tokenizer(512)  # its own: the post-processor is changed in place
    bos = tok.bos_token_id
    backend = tok.backend_tokenizer
    backend.post_processor = processors.TemplateProcessing(
        single=f"{tok.bos_token} $A", special_tokens=[(tok.bos_token, bos)]
    )
    with_bos = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=tok.bos_token, chat_template="{{ bos_token }}" + CHAT_TEMPLATE
    )
    assert with_bos("hi")["input_ids"][0] == bos  # it does add a BOS on its own
    path = _jsonl(tmp_path / "p.jsonl", [{"messages": CONVERSATION}])
    ids = PromptSource("file", path, tokenizer=with_bos, apply_chat_template=True).items[0].ids
    assert ids[0] == bos and ids.count(bos) == 1


def test_toy_prompts_are_rendered_too(tok):
    src = PromptSource("toy", seed=3, tokenizer=tok, apply_chat_template=True)
    assert all(p.text.startswith("<|user|>\n") and p.text.endswith("\n<|assistant|>\n") for p in src.items)


def test_a_chat_row_without_the_flag_is_an_error(tmp_path, tok):
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}, {"messages": CONVERSATION}])
    with pytest.raises(DataError, match=r"p.jsonl:2: a chat 'messages' row needs data.apply_chat_template=true"):
        PromptSource("file", path, tokenizer=tok)


def test_a_tokenizer_without_a_chat_template_is_an_error(tmp_path, tok):
    from transformers import PreTrainedTokenizerFast

    bare = PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer, eos_token=tok.eos_token)
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}])
    with pytest.raises(ValueError, match="apply_chat_template=true, but the tokenizer .* has no chat template"):
        PromptSource("file", path, tokenizer=bare, apply_chat_template=True)


def test_a_conversation_the_template_rejects_names_its_line(tmp_path, tok):
    from transformers import PreTrainedTokenizerFast

    strict = PreTrainedTokenizerFast(
        tokenizer_object=tok.backend_tokenizer,
        chat_template="{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}x",
    )
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}, {"messages": CONVERSATION}])
    with pytest.raises(DataError, match="p.jsonl:2: the chat template rejects this conversation: user first"):
        PromptSource("file", path, tokenizer=strict, apply_chat_template=True)


@pytest.mark.parametrize(
    "line,match",
    [
        ('{"answer": 1}', r"p.jsonl:2: no key data.prompt_key='prompt' or data.messages_key='messages'"),
        ('{"messages": "hi"}', r"p.jsonl:2: 'messages' must be a non-empty list of messages, got 'hi'"),
        ('{"messages": []}', r"p.jsonl:2: 'messages' must be a non-empty list"),
        ('{"messages": [{"role": "user"}]}', r"p.jsonl:2: 'messages'\[0\] must be an object with string 'role'"),
        ('{"messages": [{"role": "user", "content": ["a"]}]}', r"p.jsonl:2: 'messages'\[0\] must be an object"),
        ('{"messages": ["hi"]}', r"p.jsonl:2: 'messages'\[0\] must be an object"),
        ('{"messages": [{"role": "user", "content": "a"}', r"p.jsonl:2: malformed JSON"),
        ('{"prompt": "a", "messages": [{"role": "user", "content": "a"}]}', r"p.jsonl:2: has both 'prompt' and"),
    ],
)
def test_bad_chat_rows_name_the_file_and_line(tmp_path, line, match):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(DataError, match=match):
        read_prompt_file(str(path), "prompt", "answer")


def test_unknown_roles_and_extra_fields_pass_to_the_template(tmp_path):
    messages = [{"role": "tool", "content": "3", "name": "calc"}]
    items = read_prompt_file(_jsonl(tmp_path / "p.jsonl", [{"messages": messages}]), "prompt", "answer")
    assert items[0].messages == messages


def test_parquet_chat_rows(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"messages": [CONVERSATION, None], "prompt": [None, "b"]}), tmp_path / "p.parquet")
    src = PromptSource("file", str(tmp_path / "p.parquet"), tokenizer=tok, apply_chat_template=True)
    assert [p.text.splitlines()[-2] for p in src.items] == ["What is 12 + 30?", "b"]


def test_a_saved_dataset_folder_round_trips_prompts_and_answers(tmp_path, tok):
    import datasets

    ds = datasets.Dataset.from_dict(
        {"messages": [CONVERSATION, None], "prompt": [None, "Count to ten."], "answer": ["42", None]}
    )
    ds.save_to_disk(str(tmp_path / "ds"))
    src = PromptSource("file", str(tmp_path / "ds"), tokenizer=tok, apply_chat_template=True)
    assert [(p.messages, p.answer) for p in src.items] == [(CONVERSATION, "42"), (None, None)]
    assert src.items[1].text == "<|user|>\nCount to ten.\n<|assistant|>\n"
    assert src.items[1].source == f"{tmp_path / 'ds'}:row 2"

    datasets.Dataset.from_dict({"prompt": ["a", None]}).save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(DataError, match=r"bad:row 2: no key data.prompt_key='prompt'"):
        read_prompt_file(str(tmp_path / "bad"), "prompt", "answer")


def test_a_dataset_dict_folder_reads_data_split(tmp_path):
    """A DatasetDict folder gives the rows of data.split (issue 79: it was refused before); a split it does not hold
    is an error naming its splits."""
    import datasets

    datasets.DatasetDict(
        train=datasets.Dataset.from_dict({"prompt": ["a", "b"]}), test=datasets.Dataset.from_dict({"prompt": ["t"]})
    ).save_to_disk(str(tmp_path / "dd"))
    assert [p.text for p in read_prompt_file(str(tmp_path / "dd"), "prompt", "answer")] == ["a", "b"]
    assert [p.text for p in read_prompt_file(str(tmp_path / "dd"), "prompt", "answer", split="test")] == ["t"]
    with pytest.raises(DataError, match=r"dd: a DatasetDict with splits \['train', 'test'\], none named data.split"):
        read_prompt_file(str(tmp_path / "dd"), "prompt", "answer", split="validation")
    (tmp_path / "plain").mkdir()
    with pytest.raises(DataError, match="plain: a folder, but neither a dataset saved with save_to_disk nor a folder"):
        read_prompt_file(str(tmp_path / "plain"), "prompt", "answer")
