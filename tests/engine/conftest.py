"""vLLM engines shared per session (each takes 10-20 s to start on CPU)."""

from __future__ import annotations

import pytest

from moe_rl.rollout.engine import RolloutConfig, RolloutEngine


def start_engine(path, dtype="float32", **kw) -> RolloutEngine:
    from transformers import AutoConfig

    from moe_rl.routing.model_layout import moe_layout

    lay = moe_layout(AutoConfig.from_pretrained(path))
    return RolloutEngine(RolloutConfig(model=str(path), dtype=dtype, **kw), lay.moe_layers, lay.num_experts, lay.topk)


@pytest.fixture(scope="session")
def engines(tiny_models):
    """Lazily started fp32 engines by model name; all shut down at session end."""
    started: dict[str, RolloutEngine] = {}

    def get(name: str, dtype: str = "float32") -> RolloutEngine:
        key = f"{name}:{dtype}"
        if key not in started:
            started[key] = start_engine(tiny_models[name], dtype)
        return started[key]

    yield get
    for e in started.values():
        e.shutdown()
