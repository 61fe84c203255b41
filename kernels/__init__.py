"""Fused Triton kernels and their pure-torch references (installed as `moe_rl.kernels`).

Each kernel module exposes a torch reference (runs everywhere) and a Triton implementation
(CUDA, or the Triton interpreter with TRITON_INTERPRET=1 in tests); the public function picks
Triton on CUDA tensors and the reference otherwise.
"""
