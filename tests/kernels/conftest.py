"""Kernel tests run Triton kernels on CPU tensors through the Triton interpreter."""

import os

# Must be set before triton.jit decorates the kernels (at import of moe_rl.kernels.*).
os.environ.setdefault("TRITON_INTERPRET", "1")
