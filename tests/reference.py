"""Reference computations from Hugging Face transformers (code nobody here wrote)."""

from __future__ import annotations

import torch


def hf_forward(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, margins: dict | None = None):
    """HF logits [B, T, V] and each MoE layer's router top-k ids {layer: [B, T, K]}; with `margins` (a dict)
    also each token's distance from a routing tie there ({layer: [B, T]}, `router_margin`)."""
    topk: dict[int, torch.Tensor] = {}
    hooks = []
    b, t = input_ids.shape
    for name, module in model.named_modules():
        if _is_router(module):
            layer = int(name.split("layers.")[1].split(".")[0])

            def hook(m, _inp, out, layer=layer):
                topk[layer] = out[2].reshape(b, t, -1)  # HF flattens [B, T] as b * T + t
                if margins is not None:
                    margins[layer] = router_margin(m, out[0]).reshape(b, t)

            hooks.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    finally:
        for h in hooks:
            h.remove()
    return logits, topk


def router_margin(router, logits: torch.Tensor) -> torch.Tensor:
    """[N] how far each token's top-k choice by an HF top-k router is from a tie: the gap between its k-th and
    (k+1)-th selection scores (softmax probabilities; sigmoid scores + bias within the chosen groups), and for
    group-limited routers also between the last chosen and the first unchosen group. Implementations that
    round differently (vLLM, megatron: ~1e-6) may choose otherwise only where it is about that small."""

    def gap(x: torch.Tensor, k: int) -> torch.Tensor:
        top = x.topk(k + 1, dim=-1).values
        return top[:, k - 1] - top[:, k]

    logits = logits.float()
    if not hasattr(router, "e_score_correction_bias"):
        return gap(logits.softmax(-1), router.top_k)
    scores = logits.sigmoid() + router.e_score_correction_bias.float()
    n, groups = scores.shape[0], router.num_group
    group_scores = scores.view(n, groups, -1).topk(2, dim=-1).values.sum(-1)
    margin = torch.full((n,), float("inf"))
    if router.topk_group < groups:
        margin = gap(group_scores, router.topk_group)
    chosen = torch.zeros_like(group_scores, dtype=torch.bool)
    chosen.scatter_(1, group_scores.topk(router.topk_group, dim=-1).indices, True)
    allowed = chosen[:, :, None].expand(n, groups, scores.shape[1] // groups).reshape(n, -1)
    return torch.minimum(margin, gap(scores.masked_fill(~allowed, float("-inf")), router.top_k))


def untied_batch(
    model,
    vocab_size: int,
    batch: int,
    length: int,
    seed: int,
    min_margin: float = 2e-4,
    tries: int = 30,
    min_len: int = 3,
):
    """`random_batch` redrawn (seed, seed + 1, ...) until no real token of any MoE layer is within `min_margin`
    of a routing tie under `model` (HF), so that an exact top-k comparison with another implementation tests
    the mapping, not float rounding (many draws hold a near-tie, about half of them on the tiny Mixtral; a
    top-k flip at one failed about 1 run in 400 of the six-family comparison).
    Returns ids, mask, HF logits, HF top-k and the seed used."""
    for s in range(seed, seed + tries):
        ids, mask = random_batch(vocab_size, batch=batch, length=length, seed=s, min_len=min_len)
        margins: dict[int, torch.Tensor] = {}
        logits, topk = hf_forward(model, ids, mask, margins)
        if all(m[mask.bool()].min() >= min_margin for m in margins.values()):
            return ids, mask, logits, topk, s
    raise AssertionError(f"no batch without a routing near-tie (margin < {min_margin}) in seeds {seed}..{s}")


def load_hf(path: str, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def random_batch(vocab_size: int, batch: int, length: int, seed: int, min_len: int = 3):
    """Random ids with right padding: row lengths drawn in [min_len, length]."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch, length), generator=g)
    lens = torch.randint(min_len, length + 1, (batch,), generator=g)
    lens[0] = length
    mask = (torch.arange(length)[None, :] < lens[:, None]).long()
    return ids * mask, mask


def hf_forward_forced(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, forced: dict[int, torch.Tensor]
) -> torch.Tensor:
    """HF logits with each MoE layer's top-k ids forced to `forced[layer]` ([B, T, K]).

    The router still computes its own softmax (sigmoid for DeepSeek-V3-style routers); the forced
    experts' probabilities are gathered from it (renormalised when the config says `norm_topk_prob`,
    as HF does for its own top-k, and scaled by `routed_scaling_factor` where the router has one).
    """
    import torch.nn.functional as F

    b, t = input_ids.shape
    originals = []
    for name, module in model.named_modules():
        if _is_router(module):
            layer = int(name.split("layers.")[1].split(".")[0])
            norm = getattr(module, "norm_topk_prob", True)  # Mixtral always renormalises
            sigmoid = hasattr(module, "e_score_correction_bias")

            def forward(hidden, module=module, layer=layer, norm=norm, sigmoid=sigmoid):
                hidden = hidden.reshape(-1, module.weight.shape[1])
                if sigmoid:  # fp32 logits, sigmoid scores; the bias would only have selected
                    logits = F.linear(hidden.float(), module.weight.float())
                    probs = logits.sigmoid()
                else:
                    logits = F.linear(hidden, module.weight)
                    probs = torch.softmax(logits.float(), dim=-1)
                idx = forced[layer].reshape(b * t, -1).to(torch.long)
                vals = probs.gather(1, idx)
                if norm:
                    vals = vals / (vals.sum(-1, keepdim=True) + (1e-20 if sigmoid else 0.0))
                if sigmoid:
                    vals = vals * module.routed_scaling_factor
                return logits, vals.to(logits.dtype), idx

            originals.append((module, module.forward))
            module.forward = forward
    try:
        with torch.no_grad():
            return model(input_ids=input_ids, attention_mask=attention_mask).logits
    finally:
        for module, fwd in originals:
            module.forward = fwd


def random_routes(batch: int, length: int, layers: int, topk: int, experts: int, seed: int) -> torch.Tensor:
    """[B, T, L, K] uint8/int16 routes with K distinct random experts per row."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(batch, length, layers, experts, generator=g).argsort(-1)[..., :topk]
    return ids.to(torch.uint8 if experts <= 256 else torch.int16)


def _is_router(module) -> bool:
    """HF top-k router modules (Qwen3MoeTopKRouter, ..., Glm4MoeTopkRouter)."""
    return type(module).__name__.lower().endswith("topkrouter")
