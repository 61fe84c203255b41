"""trainer.true_on_policy's GPU wiring, checked on CPU (the GPU run itself is not done here): the engine gets the
variable vLLM reads for its batch-invariant mode, the actor's megatron config the flag and the attention backend
megatron requires for its own, and the config checks ask for Transformer Engine on GPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from moe_rl.actor import batch_invariant
from moe_rl.config.validate import validate
from tests.unit.test_engine_ops import _cfg


def _vllm_reads(env: dict[str, str]) -> str:
    code = "import vllm.envs as e; print(e.VLLM_BATCH_INVARIANT)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def test_the_engine_environment_turns_on_vllms_batch_invariant_mode():
    env = {k: v for k, v in os.environ.items() if k != "VLLM_BATCH_INVARIANT"}
    assert _vllm_reads(env) == "False"
    assert _vllm_reads(env | batch_invariant.engine_environment()) == "True"


def test_the_actor_config_asks_megatron_for_batch_invariant_mode(tiny_models):
    from megatron.core.transformer.enums import AttnBackend

    from moe_rl.actor.config import ParallelConfig
    from moe_rl.actor.converters import get_converter
    from moe_rl.actor.model import ModelOptions, load_hf_config, transformer_config

    conv = get_converter(load_hf_config(tiny_models["qwen3_moe"]))
    on = transformer_config(conv, ParallelConfig(), ModelOptions(batch_invariant=True))
    off = transformer_config(conv, ParallelConfig(), ModelOptions())
    assert on.batch_invariant_mode and on.attention_backend == AttnBackend.flash
    assert not off.batch_invariant_mode and off.attention_backend != AttnBackend.flash


def test_on_gpu_the_mode_needs_transformer_engine():
    from moe_rl.common.platform import as_on_cuda

    with as_on_cuda():
        with pytest.raises(ValueError, match="model.transformer_engine=false on GPU") as e:
            validate(_cfg(["trainer.true_on_policy=true", "actor.packing=false", "model.transformer_engine=false"]), 2)
        assert "config trainer.true_on_policy: cannot be exact" in str(e.value)
        validate(_cfg(["trainer.true_on_policy=true", "model.transformer_engine=true"]), 2)  # nothing else refused
