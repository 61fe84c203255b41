"""The vLLM log filter drops only the rotary layers' reload warning, and its premise holds:
a rotary layer's only tensor is a non-persistent cache no checkpoint or weight sync carries."""

from __future__ import annotations

import logging

import torch

from moe_rl.compat.vllm import _RotaryReloadFilter, quiet_rotary_reload_warning

LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


def _record(layer: str) -> logging.LogRecord:
    return logging.LogRecord(LOGGER, logging.WARNING, __file__, 1, "%s: Failed to load weights", (layer,), None)


def test_filter_drops_rotary_only():
    f = _RotaryReloadFilter()
    assert not f.filter(_record("RotaryEmbedding"))
    assert not f.filter(_record("Llama3RotaryEmbedding"))
    assert f.filter(_record("QKVParallelLinear"))  # a real missing weight still shows
    other = logging.LogRecord(
        LOGGER, logging.WARNING, __file__, 1, "%s: Delayed processing", ("RotaryEmbedding",), None
    )
    assert f.filter(other)


def test_install_is_idempotent():
    log = logging.getLogger(LOGGER)
    before = list(log.filters)
    try:
        quiet_rotary_reload_warning()
        quiet_rotary_reload_warning()
        assert sum(isinstance(f, _RotaryReloadFilter) for f in log.filters) == 1
    finally:
        log.filters[:] = before


def test_rotary_layer_holds_only_a_non_persistent_cache():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    with set_current_vllm_config(VllmConfig()):
        rope = RotaryEmbedding(32, 32, 64, 10000.0, True, torch.float32)
    assert list(rope.parameters()) == [] and rope.state_dict() == {}
    assert [name for name, _ in rope.named_buffers()] == ["cos_sin_cache"]
