"""bench/stability.py (the stability lab): every cell of its matrix is a setting the trainer accepts (composed from
conf/arithmetic_rl.yaml and validated as launch/train_moe.py would, so no cell fails minutes into the lab), and its
grad-norm spike count and collapse flag say what its docstring says."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from moe_rl.common.platform import cpu_engine_has_amx
from moe_rl.config import ConfigError
from moe_rl.config.store import register_configs
from moe_rl.config.validate import validate

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("stability", REPO / "bench" / "stability.py")
lab = importlib.util.module_from_spec(_spec)
sys.modules["stability"] = lab  # dataclasses look their module up while the class is made
_spec.loader.exec_module(lab)


@pytest.mark.parametrize("cell", lab.MATRIX, ids=lambda c: c.name)
def test_every_cell_is_a_valid_training_config(cell):
    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = OmegaConf.to_object(compose(config_name="arithmetic_rl", overrides=cell.overrides()))
    if cell.true_on_policy and cell.engine_dtype != "float32" and cpu_engine_has_amx():
        # refused on a CPU with AMX (16-bit engines take AMX kernels there); the bench leaves the cell out, saying why
        with pytest.raises(ConfigError, match="on this CPU, which has AMX"):
            validate(cfg, world_size=2)
        assert "AMX" in lab.refusal(cell)
        return
    validate(cfg, world_size=2)
    assert lab.refusal(cell) is None
    assert cfg.actor.router_replay == cell.replay and cfg.rollout.dtype == cell.engine_dtype
    assert cfg.model.dtype == cell.actor_dtype and cfg.trainer.true_on_policy == cell.true_on_policy
    assert cfg.rollout.head_dtype == cell.head_dtype
    assert (cfg.actor.mini_batches, cfg.trainer.max_staleness) == ((4, 1) if cell.off_policy else (2, 0))


def test_quick_cells_are_in_the_matrix_and_names_are_unique():
    assert set(lab.QUICK) <= set(lab.MATRIX)
    assert len({c.name for c in lab.MATRIX}) == len(lab.MATRIX) == 12


def test_spikes_count_steps_far_above_the_running_median():
    norms = [1.0, 1.2, 0.9, 1.1, 1.0, 30.0, 1.0, 9.0, 12.0]
    assert lab.spikes(norms) == 2  # 30 and 12 are above 10x the median before them (1.0 ... 1.05); 9 is not


def test_collapse_flag():
    steady = [0.5] * 20
    assert not lab.collapsed({0: 0.4, 10: 0.5, 20: 0.45}, steady)
    assert lab.collapsed({0: 0.4, 10: 0.55, 20: 0.44}, steady)  # ends 0.11 below its best
    assert not lab.collapsed({0: 0.4, 10: 0.55, 20: 0.3, 30: 0.5}, steady)  # came back within 0.10
    assert lab.collapsed({0: 0.4}, [0.6] * 10 + [0.2] * 10)  # the reward's 5-step mean fell below half its best


def test_k3_stats_separate_the_typical_step_from_the_rare_one():
    stats = lab.k3_stats([1e-4, 1.2e-4, 0.9e-4, 2.5e-3, 1.1e-4])  # one step where a sample's log-probs part far
    assert stats["k3_kl_median"] == 1.1e-4 and stats["k3_kl_max"] == 2.5e-3
    assert stats["k3_kl_mean"] > 5 * stats["k3_kl_median"]
    assert lab.k3_stats([]) == {"k3_kl_mean": None, "k3_kl_median": None, "k3_kl_max": None}


def test_routing_split_keeps_the_reports_numbers_and_tabulates_them():
    """The lab's routing_split is moe-rl-diagnose's report, cut down: what it keeps and the table it writes."""
    group = {"k3_kl_without_replay": 1.6e-4, "k3_kl_with_replay": 1.3e-4, "k3_share_with_replay": 0.56}
    report = {
        "source": {"samples": 400, "response_tokens": 3687},
        "router": {"disagreement": 0.0067, "token_any_disagreement": 0.0385},
        "mismatch": {"without_replay": {"k3_kl": 8.9e-5, "kl": 1e-4}, "with_replay": {"k3_kl": 8.0e-5}},
        "mismatch_by_routing": {
            "routed_differently": {"tokens": 1246, **group, "k3_share_without_replay": 0.61},
            "routed_alike": {"tokens": 0, **dict.fromkeys(group), "k3_share_without_replay": None},
        },
    }
    split = lab.split_summary(report)
    assert split["k3_kl_without_replay"] == 8.9e-5 and split["k3_kl_with_replay"] == 8.0e-5
    assert split["routed_differently"]["tokens"] == 1246 and split["token_any_disagreement"] == 0.0385
    lines = lab.split_lines(split)
    assert "0.67 % of token-layers and 3.9 % of tokens" in lines
    assert "| a routing difference in their context | 1.00 | 0.00016 | 0.00013 | 0.61 | 0.56 |" in lines
    assert "| none | 0.00 | – | – | – | – |" in lines  # a group without tokens has no mean


def test_an_out_folder_holding_another_sizes_model_is_refused_before_any_work(tmp_path, capsys):
    """--size deep on an --out whose model/ an earlier --size small lab built: refused by name, nothing runs."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"num_hidden_layers": 6}')
    with pytest.raises(SystemExit):
        lab.main(["--quick", "--size", "deep", "--out", str(tmp_path)])
    assert "holds a 6-layer model, not --size deep's" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
