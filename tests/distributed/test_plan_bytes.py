"""moe-rl-plan's exact rows against a real actor: after one update, the parameter, gradient and optimizer bytes each
rank holds (the tensors summed: autograd's grads, AdamW's moments) equal the planner's rows for that rank's PP stage,
at world 1, TP=2, EP=2, PP=2 (uneven: 3 + 1 layers) and TP=2 x EP=2, in fp32 and bf16 (the CPU optimizer path; bf16:
fp32 master weights, main grads and Adam moments)."""

from __future__ import annotations

import json

import pytest

from moe_rl.plan.layout import layout_of
from moe_rl.plan.planner import make_plan
from moe_rl.plan.spec import load_spec
from tests.conftest import grouped_launches

pytestmark = pytest.mark.distributed

LAYOUTS = {"w1": 1, "tp2": 2, "ep2": 2, "pp2_first3": 2, "tp2ep2": 2}
DTYPES = ("float32", "bfloat16")


@pytest.fixture(scope="module")
def actor_bytes(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("plan_bytes")
    model = str(tiny_models["qwen3_moe"])
    jobs = {
        f"{layout}_{dtype}": (
            world,
            ["--model", model, "--layout", layout, "--dtype", dtype, "--out", str(root / f"{layout}_{dtype}")],
        )
        for layout, world in LAYOUTS.items()
        for dtype in DTYPES
    }
    return grouped_launches("tests.distributed.plan_bytes_worker", root, jobs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_planner_rows_equal_the_bytes_a_real_actor_holds(actor_bytes, tiny_models, layout, dtype):
    from omegaconf import OmegaConf

    from moe_rl.common.machine import resolve
    from moe_rl.common.platform import this_machine
    from tests.distributed.plan_bytes_worker import LAYOUTS as PARALLEL
    from tests.unit.test_config import _compose

    world = LAYOUTS[layout]
    overrides = [f"parallel.{k}={v}" for k, v in PARALLEL[layout].items()] + [f"model.dtype={dtype}"]
    cfg = OmegaConf.to_object(_compose(overrides))
    resolve(cfg, this_machine())  # the `auto` settings as the trainer resolves them for the actor measured here
    spec = load_spec(str(tiny_models["qwen3_moe"]))
    plan = make_plan(spec, cfg, world, 1 << 40, layout_of(cfg, world))
    folder = actor_bytes(f"{layout}_{dtype}")
    for rank in range(world):
        held = json.loads((folder / f"rank{rank}.json").read_text())
        table = plan.tables[held["stage"]]
        rows = {r.name: r.bytes for r in table.rows}
        planned = {
            "parameters": table.parameters_per_rank,
            "parameters_bytes": rows["parameters"],
            "gradients_bytes": rows["gradients"],
            "optimizer_bytes": rows["optimizer state"],
        }
        assert planned == {k: held[k] for k in planned}, f"rank {rank}: planned {planned}, held {held}"
