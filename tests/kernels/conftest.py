"""Kernel tests run Triton kernels on CPU tensors through the Triton interpreter."""

import os
import sys

import pytest

# Must be set before triton is first imported (its interpreter state is fixed then), i.e. before any test
# module collected ahead of this folder imports triton, directly or through transformers or vLLM.
_IMPORTED_EARLY = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _triton_interpreter_ready():
    if _IMPORTED_EARLY:
        pytest.fail(
            "triton was imported before tests/kernels set TRITON_INTERPRET=1 (a test module collected earlier imports "
            "triton, transformers or vLLM at module level; import them inside the test or a fixture)"
        )
