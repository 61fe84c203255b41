"""Kernel tests run Triton kernels on CPU tensors through the Triton interpreter, or compiled on a GPU with
MOE_RL_KERNEL_DEVICE=cuda (the device check in docs/performance.md; tests that need gloo ranks are skipped there)."""

import os
import sys

import pytest
import torch

DEVICE = os.environ.get("MOE_RL_KERNEL_DEVICE", "cpu")
if DEVICE not in ("cpu", "cuda"):
    raise ValueError(f"MOE_RL_KERNEL_DEVICE={DEVICE!r}: choose cpu (Triton interpreter) or cuda (compiled kernels)")
# Must be set before triton is first imported (its interpreter state is fixed then), i.e. before any test
# module collected ahead of this folder imports triton, directly or through transformers or vLLM.
_IMPORTED_EARLY = DEVICE == "cpu" and "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _triton_ready(request):
    if _IMPORTED_EARLY:
        pytest.fail(
            "triton was imported before tests/kernels set TRITON_INTERPRET=1 (a test module collected earlier imports "
            "triton, transformers or vLLM at module level; import them inside the test or a fixture)"
        )
    if DEVICE == "cuda":
        if not torch.cuda.is_available():
            pytest.fail("MOE_RL_KERNEL_DEVICE=cuda but torch sees no CUDA device")
        if request.node.get_closest_marker("distributed"):
            pytest.skip("gloo ranks on CPU tensors: runs with MOE_RL_KERNEL_DEVICE=cpu")


@pytest.fixture
def device() -> torch.device:
    """Where a kernel test puts its tensors: cpu (interpreter) or cuda (MOE_RL_KERNEL_DEVICE)."""
    return torch.device(DEVICE)
