"""moe-rl-plan: whether a model and a layout fit on GPUs, from the config.json alone (no weights, no GPU).

spec (model dimensions from config.json or a preset) -> params (counts, per-rank shares) and kv (KV bytes per
token) -> memory (rows per trainer stage and engine GPU) -> planner (one plan, its text) -> search (layouts that
fit) -> cli. Nothing here imports torch, megatron-core or vLLM at import time; the training config (which imports
torch) is loaded inside the functions that apply the command line's overrides.
"""
