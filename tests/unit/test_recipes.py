"""conf/recipes/*.yaml, the real-model recipes: each composes as `launch/train_moe.py --config-name recipes/<name>`
composes it, passes the trainer's validation on the GPUs its header names (as on CUDA), fits them by the planner
(`moe-rl-plan --json`'s `fits`) at the peak its header states, and passes the trainer's preflight. No GPU needed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from moe_rl.common.errors import ConfigError
from moe_rl.common.platform import as_on_cuda
from moe_rl.config.validate import validate
from moe_rl.plan.cli import main
from moe_rl.plan.layout import build_config
from moe_rl.plan.memory import GIB
from moe_rl.plan.preflight import preflight

RECIPES = sorted((Path(__file__).resolve().parents[2] / "conf" / "recipes").glob("*.yaml"))
PLAN = re.compile(r"moe-rl-plan --model (\S+) --gpus (\d+) --gpu-memory-gib ([\d.]+)")
SBATCH = re.compile(
    r"sbatch (?:--nodes=(\d+) )?--gpus-per-node=8 launch/slurm/(\w+)\.sbatch --config-name=recipes/(\w+)"
)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("recipes") / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "What is 1 + 1?", "answer": "2"}) + "\n")
    return str(path)


def _header(recipe: Path) -> tuple[str, int, float, float]:
    """(model preset, GPUs, GPU GiB, fullest GPU GiB) as the recipe's header comment states them; its Slurm command
    asks for those GPUs and names the recipe."""
    text = recipe.read_text()
    model, gpus, memory = PLAN.search(text).groups()
    nodes, template, name = SBATCH.search(text).groups()
    assert name == recipe.stem and int(nodes or 1) * 8 == int(gpus)
    assert template == ("multi_node" if nodes else "single_node")
    peak = float(re.search(r"fullest GPU ([\d.]+) GiB", text).group(1))
    return model, int(gpus), float(memory), peak


def test_there_are_recipes_for_three_models():
    assert {_header(r)[0] for r in RECIPES} >= {"qwen3-30b-a3b", "qwen3-235b-a22b", "glm-4.5-air"}


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_a_recipe_validates_and_fits_the_gpus_it_names(recipe, prompts, capsys):
    model, gpus, memory, peak = _header(recipe)
    args = ["--model", model, "--gpus", str(gpus), "--gpu-memory-gib", str(memory), "--config", str(recipe)]
    with pytest.raises(SystemExit) as done:
        main([*args, f"data.path={prompts}", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert done.value.code == 0 and out["fits"] is True
    assert abs(out["peak_gib"] - peak) < 0.06, f"{recipe.name}'s header says {peak} GiB, the planner {out['peak_gib']}"
    cfg = build_config([f"data.path={prompts}"], config=str(recipe))
    with as_on_cuda():
        validate(cfg, gpus)  # the trainer's validation, as on CUDA
    assert preflight(cfg, model, gpus, int(memory * GIB)).startswith("preflight: fits")


def test_a_gpu_recipe_is_refused_on_a_cpu_machine_naming_the_key(prompts):
    cfg = build_config([f"data.path={prompts}"], config=str(RECIPES[0]))
    cfg.model.transformer_engine, cfg.model.dtype, cfg.rollout.dtype = "auto", "auto", "auto"  # as composed here
    with pytest.raises(ConfigError, match="config actor.distributed_optimizer: true needs CUDA"):
        validate(cfg, 32)


def test_the_single_node_30b_recipe_offloads_the_optimizer_and_needs_it(prompts, capsys):
    """The planner's answer for Qwen3-30B-A3B full RL on 8 x 80 GiB (docs/guides/planning.md): it fits with the
    optimizer in host memory, and does not without."""
    recipe = next(r for r in RECIPES if r.stem == "qwen3_30b_a3b_gspo_8gpu")
    args = ["--model", "qwen3-30b-a3b", "--gpus", "8", "--gpu-memory-gib", "79.6", "--config", str(recipe), "--json"]
    for fraction, fits in (("1.0", True), ("0", False)):
        with pytest.raises(SystemExit):
            main([*args, f"data.path={prompts}", f"actor.optimizer_offload.fraction={fraction}"])
        assert json.loads(capsys.readouterr().out)["fits"] is fits


def test_the_launcher_takes_a_recipe_by_config_name(prompts, tmp_path):
    """`launch/train_moe.py --config-name recipes/<name>` composes the recipe and reaches the trainer's validation:
    on this CPU machine the GPU recipe is refused there, naming the key (about 4 s: no model is built)."""
    import subprocess
    import sys

    repo = RECIPES[0].parents[2]
    cmd = [sys.executable, str(repo / "launch" / "train_moe.py"), "--config-name", "recipes/qwen3_30b_a3b_gspo"]
    cmd += [f"data.path={prompts}", f"hydra.run.dir={tmp_path}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False, cwd=repo)
    assert done.returncode != 0
    assert "config actor.distributed_optimizer: true needs CUDA" in done.stdout + done.stderr
