"""Reference computations from Hugging Face transformers (code nobody here wrote)."""

from __future__ import annotations

import torch


def hf_forward(model, input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """HF logits [B, T, V] and each MoE layer's router top-k ids {layer: [B, T, K]}."""
    topk: dict[int, torch.Tensor] = {}
    hooks = []
    b, t = input_ids.shape
    for name, module in model.named_modules():
        if _is_router(module):
            layer = int(name.split("layers.")[1].split(".")[0])

            def hook(_m, _inp, out, layer=layer):
                topk[layer] = out[2].reshape(b, t, -1)  # HF flattens [B, T] as b * T + t

            hooks.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    finally:
        for h in hooks:
            h.remove()
    return logits, topk


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
