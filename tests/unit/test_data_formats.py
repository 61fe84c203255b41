"""Datasets in the formats users have (issue 79): verl's RL parquet and TRL's formats read as they are, dotted keys,
local files as datasets.load_dataset reads them (compared with it), chat template settings, named validation sets,
and every bad input named by file, row and key."""

from __future__ import annotations

import json

import pytest

from moe_rl.common.errors import ConfigError
from moe_rl.data.config import validation_sets
from moe_rl.data.files import read_rows
from moe_rl.data.prompts import DataError, PromptSource, read_prompts
from moe_rl.data.sft import read_sft
from moe_rl.models.tiny import build_tokenizer

QUESTION = "Natalia sold clips to 48 of her friends in April, and then she sold half as many in May. How many?"


def verl_row(i: int, truth: str = "72") -> dict:
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": f"{QUESTION} ({i})"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"split": "train", "index": i},
    }


def write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(512)


def test_a_verl_parquet_reads_as_it_is(tmp_path, tok):
    """No setting at all: detected as verl, rendered with the chat template, the answer from
    reward_model.ground_truth, every column kept with the row."""
    path = write_parquet(tmp_path / "train.parquet", [verl_row(0), verl_row(1, "5")])
    src = PromptSource("file", path, tokenizer=tok)
    assert src.keys.format == "verl" and "reward_model" in src.keys.reason
    line = src.describe(path)
    assert line.startswith(f"[moe-rl] data: {path}: format verl (detected") and "reward_model.ground_truth" in line
    first, second = src.items
    assert first.text == f"<|user|>\n{QUESTION} (0)\n<|assistant|>\n"
    assert first.ids == tok(first.text, add_special_tokens=False)["input_ids"]
    assert (first.answer, second.answer) == ("72", "5")
    assert first.data_source == "openai/gsm8k" and first.messages == verl_row(0)["prompt"]
    assert first.row == verl_row(0) and first.source == f"{path}:row 1"
    explicit = PromptSource("file", path, tokenizer=tok, format="verl")
    assert [p.answer for p in explicit.items] == ["72", "5"] and explicit.keys.reason == "data.format=verl"


def test_trl_conversational_and_standard_prompts(tmp_path, tok):
    conv = [{"role": "user", "content": "2+2?"}]
    path = write_jsonl(tmp_path / "trl.jsonl", [{"prompt": conv, "answer": "4"}, {"prompt": "3+3?", "answer": "6"}])
    src = PromptSource("file", path, tokenizer=tok)
    assert src.keys.format == "trl"
    chat, plain = src.items
    assert chat.text == "<|user|>\n2+2?\n<|assistant|>\n" and chat.messages == conv
    assert chat.ids == tok(chat.text, add_special_tokens=False)["input_ids"]
    # a standard (string) prompt of TRL is not templated, as TRL leaves it
    assert plain.text == "3+3?" and plain.ids == tok("3+3?")["input_ids"] and plain.answer == "6"


def test_plain_rows_are_read_as_before(tmp_path, tok):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "answer": 1, "extra": {"k": 1}}])
    src = PromptSource("file", path, tokenizer=tok)
    assert src.keys.format == "plain" and src.items[0].text == "a" and src.items[0].answer == "1"
    assert src.items[0].row == {"prompt": "a", "answer": 1, "extra": {"k": 1}} and src.items[0].data_source == ""


def test_dotted_keys_reach_nested_columns(tmp_path):
    rows = [{"q": {"text": "a"}, "meta": {"sol": 3}}, {"q": {"text": "b"}, "meta": {"sol": 4}}]
    items, keys = read_prompts(write_jsonl(tmp_path / "d.jsonl", rows), "q.text", "meta.sol", format="plain")
    assert [(p.text, p.answer) for p in items] == [("a", "3"), ("b", "4")] and keys.answer == "meta.sol"


def test_a_missing_ground_truth_path_names_file_row_and_key(tmp_path):
    bad = verl_row(1)
    del bad["reward_model"]["ground_truth"]
    path = write_jsonl(tmp_path / "v.jsonl", [verl_row(0), bad])
    with pytest.raises(DataError, match=r"v.jsonl:2: no data.answer_key='reward_model.ground_truth' in the row"):
        read_prompts(path)
    rows = [{"prompt": "a", "meta": {"sol": 3}}, {"prompt": "b", "meta": {}}]
    with pytest.raises(DataError, match=r"d.jsonl:2: no data.answer_key='meta.sol'"):
        read_prompts(write_jsonl(tmp_path / "d.jsonl", rows), "prompt", "meta.sol")


@pytest.mark.parametrize(
    "row,match",
    [
        ({"question": "x", "reward_model": {"ground_truth": "1"}}, r"v.jsonl:2: no key data.prompt_key='prompt'"),
        ({**verl_row(1), "prompt": [{"role": "user"}]}, r"v.jsonl:2: 'prompt'\[0\] must be an object with string"),
        ({**verl_row(1), "prompt": [{"role": "user", "content": 3}]}, r"v.jsonl:2: 'prompt'\[0\] must be an object"),
        ({**verl_row(1), "prompt": []}, r"v.jsonl:2: 'prompt' must be a non-empty list of messages"),
        ({**verl_row(1), "prompt": "plain"}, r"v.jsonl:3: no key data.prompt_key='prompt'"),
    ],
)
def test_bad_verl_rows_name_file_row_and_key(tmp_path, row, match):
    rows = [verl_row(0), row] + ([{"answer": "1"}] if row.get("prompt") == "plain" else [])
    with pytest.raises(DataError, match=match):
        read_prompts(write_jsonl(tmp_path / "v.jsonl", rows), format="verl")


def test_a_truncated_parquet_and_a_non_utf8_line_are_named(tmp_path):
    good = write_parquet(tmp_path / "good.parquet", [verl_row(0)])
    data = (tmp_path / "good.parquet").read_bytes()
    (tmp_path / "cut.parquet").write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=r"cut.parquet: not a readable parquet file, truncated or damaged"):
        read_rows([good, str(tmp_path / "cut.parquet")])
    write_jsonl(tmp_path / "a.jsonl", [{"prompt": "a"}])
    (tmp_path / "b.jsonl").write_bytes(b'{"prompt": "b"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"b.jsonl:2: not UTF-8"):
        read_rows(str(tmp_path / "*.jsonl"))


def test_an_empty_dataset_after_filtering_is_named(tmp_path, tok):
    path = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "word " * 50}, {"prompt": "more " * 50}])
    with pytest.raises(DataError, match=r"long.jsonl: no prompt is left: every one of the 2 prompts is longer"):
        PromptSource("file", path, tokenizer=tok, max_prompt_tokens=5, overlong="drop")


def _hf_rows(*args, **kwargs) -> list[dict]:
    import datasets

    return datasets.load_dataset(*args, **kwargs).to_list()


def test_folders_lists_and_globs_give_datasets_own_rows(tmp_path):
    """A DatasetDict folder, a folder of parquet shards, a list of jsonl files, a glob and a .json array: the rows
    datasets.load_dataset (or load_from_disk) gives for the same files, in its order."""
    import datasets

    rows = [verl_row(i, str(i)) for i in range(5)]
    shards = tmp_path / "shards"
    shards.mkdir()
    write_parquet(shards / "train-00000-of-00002.parquet", rows[:3])
    write_parquet(shards / "train-00001-of-00002.parquet", rows[3:])
    write_parquet(shards / "test-00000-of-00001.parquet", [verl_row(9, "9")])
    got = [r for _, r in read_rows(str(shards))]
    assert got == _hf_rows(str(shards), split="train") and len(got) == 5
    assert [r for _, r in read_rows(str(shards), split="test")] == _hf_rows(str(shards), split="test")
    labels = [w for w, _ in read_rows(str(shards))]
    assert labels[3] == f"{shards / 'train-00001-of-00002.parquet'}:row 1"

    files = [write_jsonl(tmp_path / "a.jsonl", rows[:2]), write_jsonl(tmp_path / "b.jsonl", rows[2:])]
    assert [r for _, r in read_rows(files)] == _hf_rows("json", data_files=files, split="train")
    assert [w for w, _ in read_rows(files)][2] == f"{files[1]}:1"
    assert read_rows(str(tmp_path / "*.jsonl")) == read_rows(files)

    datasets.DatasetDict(
        train=datasets.Dataset.from_list(rows), validation=datasets.Dataset.from_list(rows[:1])
    ).save_to_disk(str(tmp_path / "dd"))
    want = datasets.load_from_disk(str(tmp_path / "dd"))
    assert [r for _, r in read_rows(str(tmp_path / "dd"))] == want["train"].to_list()
    assert [r for _, r in read_rows(str(tmp_path / "dd"), "validation")] == want["validation"].to_list()

    (tmp_path / "arr.json").write_text(json.dumps(rows))
    assert [r for _, r in read_rows(str(tmp_path / "arr.json"))] == _hf_rows(
        "json", data_files=[str(tmp_path / "arr.json")], split="train"
    )
    items, keys = read_prompts(str(tmp_path / "arr.json"))
    assert keys.format == "verl" and [p.answer for p in items] == ["0", "1", "2", "3", "4"]


def test_hub_names_and_bad_paths_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"'openai/gsm8k' does not exist .*Hugging Face Hub dataset cannot be"):
        read_rows("openai/gsm8k")
    with pytest.raises(FileNotFoundError, match=r"matches no file"):
        read_rows(str(tmp_path / "*.parquet"))
    with pytest.raises(DataError, match=r"files of different kinds"):
        read_rows([write_jsonl(tmp_path / "a.jsonl", [{"prompt": "a"}]), write_parquet(tmp_path / "b.parquet", [])])


def test_system_prompt_and_chat_template_kwargs(tmp_path):
    from transformers import PreTrainedTokenizerFast

    from moe_rl.data.prompts import ChatSettings

    base = build_tokenizer(512)
    template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% if enable_thinking is defined and not enable_thinking %}"
        "<think></think>{% endif %}{% endif %}"
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer, eos_token="</s>", chat_template=template)
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}, {"messages": [{"role": "system", "content": "own"}]}])
    chat = ChatSettings("Be brief.", {"enable_thinking": False})
    src = PromptSource("file", path, tokenizer=tok, chat=chat)
    assert [p.text for p in src.items] == [
        "<system>Be brief.<user>hi<assistant><think></think>",
        "<system>own<assistant><think></think>",  # a chat with its own system message keeps it
    ]
    assert src.items[0].ids == tok(src.items[0].text, add_special_tokens=False)["input_ids"]


def test_validation_sets_are_named():
    assert validation_sets("") == {} and validation_sets("v.jsonl") == {"val": "v.jsonl"}
    assert validation_sets(["d/math.parquet", "gsm8k.test.jsonl"]) == {
        "math": "d/math.parquet",
        "gsm8k": "gsm8k.test.jsonl",
    }
    assert validation_sets({"a": "x.jsonl", "b": ["y.jsonl", "z.jsonl"]}) == {
        "a": "x.jsonl",
        "b": ["y.jsonl", "z.jsonl"],
    }
    with pytest.raises(ConfigError, match="same file stem"):
        validation_sets(["a/val.jsonl", "b/val.jsonl"])


def test_sft_reads_trl_prompt_completion_pairs_with_the_loss_on_the_completion(tmp_path, tok):
    """The mask against one computed here independently: the template's rendering of the prompt (with the
    generation prompt) against that of the whole conversation, the completion's tokens found by character
    offsets of the whole text."""
    prompt = [{"role": "system", "content": "Add."}, {"role": "user", "content": "12+30="}]
    completion = [{"role": "assistant", "content": "42"}]
    path = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": prompt, "completion": completion}])
    (conv,), keys = read_sft(path, "prompt", "response", "messages", tok)
    assert keys.format == "trl" and keys.response == "completion"
    head = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    whole = tok.apply_chat_template(prompt + completion, tokenize=False)
    assert whole.startswith(head)
    enc = tok(whole, add_special_tokens=False, return_offsets_mapping=True)
    want_mask = [int(start >= len(head)) for start, _ in enc["offset_mapping"]]
    assert conv.ids == enc["input_ids"] and conv.mask == want_mask and sum(want_mask) > 0
    learned = tok.decode([i for i, m in zip(conv.ids, conv.mask, strict=True) if m])
    assert learned == whole[len(head) :]
    # TRL's standard prompt-completion: the prompt as the engine tokenizes it, the completion then end-of-text
    path = write_jsonl(tmp_path / "std.jsonl", [{"prompt": "7+1=", "completion": "8"}])
    (standard,), keys = read_sft(path, "prompt", "response", "messages", tok)
    assert keys.format == "trl"
    p_ids = tok("7+1=")["input_ids"]
    assert standard.ids == p_ids + tok("8", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert standard.mask == [0] * len(p_ids) + [1] * (len(standard.ids) - len(p_ids))


def test_sft_bad_pairs_name_the_row(tmp_path, tok):
    rows = [{"prompt": [{"role": "user", "content": "a"}], "completion": "b"}]
    with pytest.raises(DataError, match=r"sft.jsonl:1: 'completion' must be chat messages"):
        read_sft(write_jsonl(tmp_path / "sft.jsonl", rows), "prompt", "response", "messages", tok)


def test_the_config_takes_lists_and_mappings_and_refuses_hub_names(tmp_path):
    from omegaconf import OmegaConf

    from moe_rl.config import DataConfig, SFTDataConfig
    from moe_rl.config.describe import check_overrides

    a, b = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "a"}]), write_jsonl(tmp_path / "b.jsonl", [{"prompt": "b"}])
    dotlist = ["task=file", f"path=[{a},{b}]", f"val_path={{x: {a}, y: [{a},{b}]}}", "chat_template_kwargs={t: false}"]
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DataConfig), OmegaConf.from_dotlist(dotlist)))
    cfg.check()
    assert cfg.path == [a, b] and validation_sets(cfg.val_path) == {"x": a, "y": [a, b]}
    assert cfg.chat_template_kwargs == {"t": False}
    with pytest.raises(ConfigError, match=r"config data.path: 'openai/gsm8k' does not exist .*Hugging Face Hub"):
        DataConfig(task="file", path="openai/gsm8k").check()
    with pytest.raises(ConfigError, match=r"config data.val_path.y: '/no/v.jsonl' does not exist"):
        DataConfig(val_path={"x": a, "y": "/no/v.jsonl"}).check()
    with pytest.raises(ConfigError, match=r"config data.path: .*matches no file"):
        SFTDataConfig(task="file", path=str(tmp_path / "*.parquet")).check()
    with pytest.raises(ConfigError, match=r"config data.format='bogus': choose one of auto, verl, trl, plain"):
        check_overrides(["data.format=bogus"])
