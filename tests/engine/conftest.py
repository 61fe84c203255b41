"""vLLM engines shared per test module (each takes 10-20 s to start on CPU)."""

from __future__ import annotations

import pytest

from moe_rl.rollout.config import RolloutConfig
from moe_rl.rollout.engine import RolloutEngine

MAX_LIVE_ENGINES = 2
PROBES = "tests.engine.probes.ProbeExtension"  # moe-rl's worker extension and the tests' probes of the worker


def start_engine(path, dtype="float32", **kw) -> RolloutEngine:
    from transformers import AutoConfig

    from moe_rl.routing.model_layout import moe_layout

    lay = moe_layout(AutoConfig.from_pretrained(path))
    cfg = RolloutConfig(model=str(path), dtype=dtype, **kw)
    return RolloutEngine(cfg, lay.moe_layers, lay.num_experts, lay.topk, worker_extension=PROBES)


@pytest.fixture(scope="module")
def engines(tiny_models):
    """Lazily started fp32 engines by model name, shared by a test module. At most two are alive at once (the
    least recently used is shut down first) and the rest at the module's end: each holds ~2.5 GB, and seven kept
    alive by one module got engine processes killed for memory beside the torchrun jobs of the other lane."""
    started: dict[str, RolloutEngine] = {}

    def get(name: str, dtype: str = "float32", **kw) -> RolloutEngine:
        """`kw`: RolloutConfig fields of an engine of its own (a test that starts one itself beside the two kept
        here can find too little free memory for vLLM's start-up check while the other lane runs)."""
        key = f"{name}:{dtype}:{sorted(kw.items())}"
        if key in started:
            started[key] = started.pop(key)  # most recently used last
        else:
            while len(started) >= MAX_LIVE_ENGINES:
                started.pop(next(iter(started))).shutdown()
            started[key] = start_engine(tiny_models[name], dtype, **kw)
        return started[key]

    yield get
    for e in started.values():
        e.shutdown()
