"""The offline tiny-model builder: valid folders, vLLM-CPU size rules, clear errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from moe_rl.models.tiny import CHAT_TEMPLATE, TinySpec
from moe_rl.tools.tiny_model import main


def test_builds_loadable_folder_with_tokenizer(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    main(
        [
            "--arch",
            "qwen3_moe",
            "--num-experts",
            "300",
            "--topk",
            "3",
            "--layers",
            "3",
            "--dense-layers",
            "0,2",
            "--dtype",
            "bfloat16",
            "--out",
            str(tmp_path),
        ]
    )
    cfg = AutoConfig.from_pretrained(tmp_path)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.mlp_only_layers) == (300, 3, [0, 2])
    assert cfg.dtype in (torch.bfloat16, "bfloat16")
    tok = AutoTokenizer.from_pretrained(tmp_path)
    text = "Question: what is 12 + 30? Answer: 42"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text and max(ids) < cfg.vocab_size
    assert tok.chat_template == CHAT_TEMPLATE  # saved with the folder (chat_template.jinja) and loaded back
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("model.layers.1.mlp.gate.weight").shape == (300, 128)
        assert f.get_tensor("model.layers.1.mlp.gate.weight").dtype == torch.bfloat16
    assert "model.layers.0.mlp.gate_proj.weight" in names  # dense layer
    assert "model.layers.1.mlp.experts.299.down_proj.weight" in names


def test_seed_makes_weights_reproducible(tmp_path):
    from safetensors.torch import load_file

    for d in ("a", "b"):
        main(["--arch", "mixtral", "--layers", "1", "--seed", "3", "--out", str(tmp_path / d)])
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "spec,msg",
    [
        (TinySpec(hidden=100), "multiple of 32"),
        (TinySpec(head_dim=48), "head dim 48"),
        (TinySpec(arch="mixtral", hidden=96), "hidden == heads \\* head_dim"),
        (TinySpec(topk=9), "--topk=9"),
        (TinySpec(dense_layers=[4]), "--dense-layers \\[4\\] out of range"),
        (TinySpec(arch="olmoe", dense_layers=[0]), "not supported by --arch olmoe"),
        (TinySpec(arch="glm4_moe", dense_layers=[1]), "leading block .*first_k_dense_replace"),
        (TinySpec(arch="glm4_moe", n_group=3), "--n-group=3 must divide --num-experts=8"),
        (TinySpec(arch="glm4_moe", topk_group=3), "--topk-group=3 must be in \\[1, --n-group=2\\]"),
        (TinySpec(arch="glm4_moe", num_experts=8, n_group=4, topk=4), "--topk=4 is more than"),
        (TinySpec(arch="gpt2"), "unknown architecture 'gpt2'"),
        (TinySpec(arch="mixtral", mtp_layers=1), "--mtp-layers: mixtral checkpoints have no multi-token"),
    ],
)
def test_invalid_specs(spec, msg):
    with pytest.raises(ValueError, match=msg):
        spec.validate()


def test_cli_help_has_examples_and_errors_exit_2(tmp_path):
    out = subprocess.run([sys.executable, "-m", "moe_rl.tools.tiny_model", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "Examples:" in out.stdout and "--num-experts" in out.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "moe_rl.tools.tiny_model", "--hidden", "100", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "multiple of 32" in bad.stderr
    spec = json.loads(json.dumps(TinySpec().__dict__))
    assert spec["hidden"] % 32 == 0


def test_the_tool_refuses_a_model_the_trainer_would_refuse(tmp_path):
    """GLM grouped routing with top-4 of 2 groups keeping 1: megatron-core scores a group by its top 4 experts,
    transformers and vLLM by their top 2. The trainer refuses that model; the tool refuses to build it."""
    from moe_rl.tools.tiny_model import main

    with pytest.raises(SystemExit) as e:
        main(["--arch", "glm4_moe", "--topk", "4", "--out", str(tmp_path / "glm")])
    assert e.value.code == 2 and not (tmp_path / "glm").exists()
    main(["--arch", "glm4_moe", "--topk", "4", "--topk-group", "2", "--out", str(tmp_path / "ok")])  # 4 // 2 = 2
    assert (tmp_path / "ok" / "config.json").is_file()


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "olmoe", "glm4_moe", "deepseek_v3"])
def test_no_all_zero_row_in_embedding_or_output(arch, tmp_path):
    """transformers zeroes the pad row; an all-zero row makes step 1's gradient norm explode."""
    from transformers import AutoModelForCausalLM

    main(["--arch", arch, "--out", str(tmp_path)])
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert model.config.pad_token_id is not None
    for name, table in (
        ("embedding", model.get_input_embeddings().weight),
        ("output", model.get_output_embeddings().weight),
    ):
        zero_rows = (table == 0).all(dim=1).nonzero().flatten().tolist()
        assert zero_rows == [], f"{arch} {name}: all-zero rows {zero_rows}"
        pad_std = table[model.config.pad_token_id].std().item()
        assert 0.5 * model.config.initializer_range < pad_std < 2 * model.config.initializer_range


def test_the_small_size_and_an_explicit_flag_over_it(tmp_path):
    """--size small is the 10.9M model the arithmetic recipe trains; a flag given beside it wins."""
    import json

    from moe_rl.tools.tiny_model import main

    main(["--size", "small", "--layers", "2", "--out", str(tmp_path / "small")])
    cfg = json.loads((tmp_path / "small" / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (256, 8, 4)
    assert (cfg["moe_intermediate_size"], cfg["num_hidden_layers"]) == (256, 2)


def test_the_deep_size_is_the_stability_labs_12_layer_model(tmp_path):
    """--size deep: 12 narrower layers at about small's parameter count (docs/stability.md)."""
    import json

    from moe_rl.tools.tiny_model import main
    from moe_rl.trainer.logger import model_parameters

    main(["--size", "deep", "--out", str(tmp_path / "deep")])
    cfg = json.loads((tmp_path / "deep" / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]) == (192, 12, 6)
    assert (cfg["moe_intermediate_size"], cfg["num_local_experts"], cfg["num_experts_per_tok"]) == (192, 8, 2)
    assert model_parameters(str(tmp_path / "deep")) == 12_017_088
