"""Build a tiny random Hugging Face MoE model folder, fully offline.

The folder holds `config.json`, safetensors weights written by `save_pretrained` and a
byte-level BPE tokenizer trained on a small in-memory corpus, so that transformers, vLLM and
the Megatron actor can all load it without a hub.

Sizes default to what vLLM's CPU backend accepts (hidden size a multiple of 32, head dim 32).

Used by the trainer (the default model), the tests and the benchmarks; the command line is
`python -m moe_rl.tools.tiny_model`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from moe_rl.models.config import ARCHS, Arch, Size

SIZES: dict[str, dict[str, int]] = {
    Size.tiny: {},
    Size.small: {"hidden": 256, "heads": 8, "kv_heads": 4, "layers": 6, "moe_intermediate": 256, "intermediate": 512},
    Size.deep: {"hidden": 192, "heads": 6, "kv_heads": 2, "layers": 12, "moe_intermediate": 192, "intermediate": 384},
}
"""What each size sets; TinySpec's own defaults are the tiny one."""
# Families with sigmoid grouped routing, an expert bias, shared experts and leading dense layers.
SIGMOID_ARCHS = ("glm4_moe", "deepseek_v3")
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

# Small corpus for the tokenizer: digits, arithmetic and plain English, so the toy tasks and
# the numeric-answer reward parse cleanly.
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Question: what is 12 + 30? Answer: 42",
    "Compute 7 * 6 and reply with the number only. 42",
    "Mixture of experts models route each token to a few experts.",
    "Reinforcement learning from verifiable rewards improves reasoning.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 100 1000",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z",
    "A B C D E F G H I J K L M N O P Q R S T U V W X Y Z",
    "Count from one to ten: one two three four five six seven eight nine ten.",
    "The answer is #### 17",
]


# A short ChatML-like chat template (data.apply_chat_template). The role markers are plain text for
# the byte-level BPE, so the vocabulary and special token ids stay as they are.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass
class TinySpec:
    """What to build; every field maps to one CLI option."""

    arch: str = "qwen3_moe"
    num_experts: int = 8
    topk: int = 2
    layers: int = 4
    dense_layers: list[int] | None = None  # None: the architecture's usual choice ([0] for SIGMOID_ARCHS)
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    moe_intermediate: int = 64
    intermediate: int = 128
    vocab_size: int = 512
    dtype: str = "float32"
    seed: int = 0
    norm_topk_prob: bool | None = None  # None: the architecture's usual choice
    tie_embeddings: bool = False  # LM head shares the input embedding (tie_word_embeddings)
    # SIGMOID_ARCHS only: group-limited routing, shared experts, gate scale, q/k norm (glm4_moe).
    n_group: int = 2
    topk_group: int = 1
    shared_experts: int = 1
    routed_scaling_factor: float = 2.5
    qk_norm: bool = True
    mtp_layers: int = 0  # multi-token-prediction layers after the decoder's (num_nextn_predict_layers)
    # deepseek_v3 multi-latent attention. vLLM's CPU MLA kernel needs kv_lora_rank 512 + rope dim 64
    # (a 576-wide latent cache); q_lora_rank 0 means no q LoRA (a plain q_proj).
    q_lora_rank: int = 64
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 32
    v_head_dim: int = 32
    # gpt_oss: sliding-window attention on every other layer (the first included), as released (128 keys of a
    # 131k context; here 8 keys, so that the tests' and the toy task's sequences are longer than the window)
    sliding_window: int = 8

    def __post_init__(self) -> None:
        if self.dense_layers is None:
            self.dense_layers = [0] if self.arch in SIGMOID_ARCHS else []

    def validate(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"--arch: unknown architecture {self.arch!r}; choose one of {ARCHS}")
        if self.hidden % 32:
            raise ValueError(f"--hidden={self.hidden}: vLLM's CPU backend needs a multiple of 32")
        if self.arch != "deepseek_v3" and self.head_dim not in VLLM_CPU_HEAD_DIMS:
            raise ValueError(f"head dim {self.head_dim} is not one vLLM-CPU supports: {VLLM_CPU_HEAD_DIMS}")
        if self.arch in ("mixtral", "olmoe") and self.heads * self.head_dim != self.hidden:
            raise ValueError(
                f"--arch {self.arch} needs hidden == heads * head_dim ({self.heads}*{self.head_dim});"
                f" got --hidden={self.hidden}"
            )
        if self.heads % self.kv_heads:
            raise ValueError(f"heads={self.heads} is not a multiple of kv_heads={self.kv_heads}")
        if not 1 <= self.topk <= self.num_experts:
            raise ValueError(f"--topk={self.topk} must be in [1, --num-experts={self.num_experts}]")
        bad = [i for i in self.dense_layers if not 0 <= i < self.layers]
        if bad:
            raise ValueError(f"--dense-layers {bad} out of range for --layers={self.layers}")
        if (
            self.dense_layers
            and self.arch in SIGMOID_ARCHS
            and sorted(self.dense_layers) != list(range(len(self.dense_layers)))
        ):
            raise ValueError(
                f"--arch {self.arch}: dense layers are a leading block (first_k_dense_replace); "
                f"--dense-layers {self.dense_layers} is not 0..k-1"
            )
        if self.dense_layers and self.arch not in ("qwen3_moe", *SIGMOID_ARCHS):
            raise ValueError(f"--dense-layers is not supported by --arch {self.arch}")
        if self.arch in SIGMOID_ARCHS:
            if self.n_group < 1 or self.num_experts % self.n_group:
                raise ValueError(f"--n-group={self.n_group} must divide --num-experts={self.num_experts}")
            if not 1 <= self.topk_group <= self.n_group:
                raise ValueError(f"--topk-group={self.topk_group} must be in [1, --n-group={self.n_group}]")
            if self.topk > self.topk_group * (self.num_experts // self.n_group):
                raise ValueError(
                    f"--topk={self.topk} is more than the {self.topk_group} kept groups of "
                    f"{self.num_experts // self.n_group} experts hold"
                )
        if self.arch == "gpt_oss" and self.sliding_window < 1:
            raise ValueError(f"--sliding-window={self.sliding_window} must be at least 1")
        if self.mtp_layers and self.arch not in SIGMOID_ARCHS:
            raise ValueError(f"--mtp-layers: {self.arch} checkpoints have no multi-token-prediction layers")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"--dtype={self.dtype!r}: choose float32 or bfloat16")


def _sigmoid_router(spec: TinySpec) -> dict:
    """The config keys GLM-4.5 and DeepSeek-V3 share: sigmoid grouped router, shared experts, dense first
    layers, multi-token-prediction layers."""
    return dict(
        n_routed_experts=spec.num_experts,
        n_shared_experts=spec.shared_experts,
        moe_intermediate_size=spec.moe_intermediate,
        intermediate_size=spec.intermediate,
        n_group=spec.n_group,
        topk_group=spec.topk_group,
        routed_scaling_factor=spec.routed_scaling_factor,
        first_k_dense_replace=len(spec.dense_layers),
        norm_topk_prob=True if spec.norm_topk_prob is None else spec.norm_topk_prob,
        num_nextn_predict_layers=spec.mtp_layers,
    )


def hf_config(spec: TinySpec, vocab_size: int, special: dict[str, int]):
    """The transformers config object for `spec`: the keys every family shares, then the family's own."""
    cfg = _FAMILY_CONFIGS[spec.arch](spec, _common_config(spec, vocab_size, special))
    cfg.dtype = spec.dtype
    return cfg


def _common_config(spec: TinySpec, vocab_size: int, special: dict[str, int]) -> dict:
    """The config keys every family takes (a family's builder may change some); `special`: the tokenizer's
    eos/bos/pad token ids."""
    return dict(
        vocab_size=vocab_size,
        hidden_size=spec.hidden,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        num_experts_per_tok=spec.topk,
        max_position_embeddings=2048,
        # vLLM's OLMoE hard-codes eps=1e-5 (as the released OLMoE checkpoints use)
        rms_norm_eps=1e-5 if spec.arch == "olmoe" else 1e-6,
        tie_word_embeddings=spec.tie_embeddings,
        initializer_range=0.2,  # large so that routing and logits are far from uniform
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        **special,
    )


def _qwen3_moe_config(spec: TinySpec, common: dict):
    """Qwen3-MoE: softmax top-k router, optional dense layers anywhere (mlp_only_layers)."""
    # heavy: transformers, imported on first use
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        head_dim=spec.head_dim,
        num_experts=spec.num_experts,
        moe_intermediate_size=spec.moe_intermediate,
        intermediate_size=spec.intermediate,
        norm_topk_prob=True if spec.norm_topk_prob is None else spec.norm_topk_prob,
        mlp_only_layers=sorted(spec.dense_layers),
        decoder_sparse_step=1,
        **common,
    )


def _glm4_moe_config(spec: TinySpec, common: dict):
    """GLM-4.5: the sigmoid grouped router, attention biases, half-rotary RoPE, optional q/k norm."""
    # heavy: transformers, imported on first use
    from transformers import Glm4MoeConfig

    common["rope_parameters"] = {**common["rope_parameters"], "partial_rotary_factor": 0.5}
    return Glm4MoeConfig(
        head_dim=spec.head_dim, attention_bias=True, use_qk_norm=spec.qk_norm, **_sigmoid_router(spec), **common
    )


def _deepseek_v3_config(spec: TinySpec, common: dict):
    """DeepSeek-V3: the sigmoid grouped router and multi-latent attention (one KV head per query head)."""
    # heavy: transformers, imported on first use
    from transformers import DeepseekV3Config

    common["num_key_value_heads"] = spec.heads
    cfg = DeepseekV3Config(
        **_sigmoid_router(spec),
        q_lora_rank=spec.q_lora_rank or None,
        kv_lora_rank=spec.kv_lora_rank,
        qk_rope_head_dim=spec.qk_rope_head_dim,
        qk_nope_head_dim=spec.qk_nope_head_dim,
        v_head_dim=spec.v_head_dim,
        rope_interleave=True,
        **common,
    )
    # read by vLLM's DeepSeek model (transformers' class implies them): sigmoid scores, bias-corrected top-k
    cfg.scoring_func, cfg.topk_method = "sigmoid", "noaux_tc"
    return cfg


def _gpt_oss_config(spec: TinySpec, common: dict):
    """gpt-oss: YaRN RoPE, sliding-window attention on every other layer, softmax over the top-k logits."""
    # heavy: transformers, imported on first use
    from transformers import GptOssConfig

    if spec.norm_topk_prob is False:
        raise ValueError("gpt_oss always takes the softmax over its top-k router logits")
    # Released: YaRN x32 over 4096 original positions (131k), rope_theta 150000. Scaled down alike: x32 over 64.
    common["rope_parameters"] = {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": common["max_position_embeddings"] // 32,
    }
    common["rms_norm_eps"] = 1e-5
    return GptOssConfig(
        head_dim=spec.head_dim,
        num_local_experts=spec.num_experts,
        intermediate_size=spec.moe_intermediate,
        sliding_window=spec.sliding_window,
        **common,
    )


def _mixtral_config(spec: TinySpec, common: dict):
    """Mixtral: every layer MoE, top-k probabilities always renormalised, no sliding window."""
    # heavy: transformers, imported on first use
    from transformers import MixtralConfig

    if spec.norm_topk_prob is False:
        raise ValueError("mixtral always renormalises its top-k probabilities")
    return MixtralConfig(
        head_dim=spec.head_dim,
        num_local_experts=spec.num_experts,
        intermediate_size=spec.moe_intermediate,
        sliding_window=None,
        **common,
    )


def _olmoe_config(spec: TinySpec, common: dict):
    """OLMoE: every layer MoE, top-k probabilities not renormalised unless asked, full-width q/k norm."""
    # heavy: transformers, imported on first use
    from transformers import OlmoeConfig

    return OlmoeConfig(
        num_experts=spec.num_experts,
        intermediate_size=spec.moe_intermediate,
        norm_topk_prob=False if spec.norm_topk_prob is None else spec.norm_topk_prob,
        clip_qkv=None,
        **common,
    )


_FAMILY_CONFIGS = {
    Arch.qwen3_moe: _qwen3_moe_config,
    Arch.glm4_moe: _glm4_moe_config,
    Arch.deepseek_v3: _deepseek_v3_config,
    Arch.gpt_oss: _gpt_oss_config,
    Arch.mixtral: _mixtral_config,
    Arch.olmoe: _olmoe_config,
}
"""Each architecture's config builder: (spec, the common keys) -> its transformers config."""


def build_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer trained on the in-memory corpus (no download), with CHAT_TEMPLATE."""
    # heavy: tokenizers and transformers, imported on first use
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 20, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        pad_token="<|pad|>",
        chat_template=CHAT_TEMPLATE,
    )


def build_tiny_model(spec: TinySpec, out: str | Path, check=None) -> Path:
    """Write a random HF model folder for `spec` to `out` and return its path. `check(hf_config)`, if given, may
    refuse the model (raise ValueError) before anything is written."""
    # heavy: transformers, imported on first use
    from transformers import AutoModelForCausalLM

    spec.validate()
    out = Path(out)
    tokenizer = build_tokenizer(spec.vocab_size)
    special = dict(
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    # Pad the embedding table to the requested size (vLLM and Megatron pad vocabularies too).
    vocab_size = max(spec.vocab_size, len(tokenizer))
    cfg = hf_config(spec, vocab_size, special)
    if check is not None:
        check(cfg)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        _redraw_zero_rows(model, cfg.initializer_range)
        _redraw_untrained_parameters(model, spec.arch)
        _redraw_expert_bias(model)
    model = model.to(getattr(torch, spec.dtype))
    _save_weights(model, out)
    if spec.mtp_layers:
        _append_mtp_layers(spec, vocab_size, out / "model.safetensors")
    tokenizer.save_pretrained(out)
    (out / "moe_rl_tiny_spec.json").write_text(json.dumps(spec.__dict__, indent=2))
    return out


def _redraw_zero_rows(model, std: float) -> None:
    """Draw every all-zero row of the input embedding and the LM head from N(0, std) (in place, under no_grad).

    transformers zero-initialises the embedding row of padding_idx (<|pad|>). A random model samples that token,
    and RMSNorm's slope at a zero input is 1/sqrt(eps): the one row's gradient dwarfs every other and step 1's grad
    norm is ~1e4. Real checkpoints have trained pad rows."""
    for table in (model.get_input_embeddings().weight, model.get_output_embeddings().weight):
        zero = (table == 0).all(dim=1)
        table[zero] = torch.randn(int(zero.sum()), table.shape[1]) * std


def _redraw_untrained_parameters(model, arch: str) -> None:
    """Give the parameters HF initialises to constants (norm gains, biases, attention sinks) random values, so
    that a wrong mapping of any of them shows; halve gpt_oss's q/k projections (in place, under no_grad)."""
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or "layernorm" in name or "_norm" in name:
            # Norm gains near 1 but not exactly, so a wrong norm mapping is visible.
            p.copy_(1.0 + 0.1 * torch.randn_like(p))
        elif name.endswith((".bias", "_bias")):
            p.copy_(0.2 * torch.randn_like(p))  # attention and expert biases start at zero
        elif name.endswith(".sinks"):
            p.copy_(torch.randn_like(p))  # large enough that a sink mapped to the wrong head shows
        if arch == "gpt_oss" and (".q_proj." in name or ".k_proj." in name):
            # No q/k norm (Qwen3-MoE's and OLMoE's bound their scores): drawn like the rest, q.k/sqrt(d) reaches
            # ~40 with YaRN's attention factor (1.35 on q and on k), attention is one-hot and bf16 rounding of the
            # scores outweighs every other error (k3 of bf16 vs fp32 transformers 0.22, Qwen3-MoE's tiny 0.07).
            # Half the scale keeps the largest scores near 10 (k3 0.06), as the other tiny families have them.
            p.mul_(0.5)


def _redraw_expert_bias(model) -> None:
    """Draw the sigmoid routers' expert bias buffers (e_score_correction_bias) from N(0, 0.1) (in place).

    Zero-initialised in HF; a trained bias moves selection away from the plain scores, so a mapping that drops it,
    or gates computed from the biased scores, must show."""
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.1 * torch.randn_like(b))


def _save_weights(model, out: Path) -> None:
    """model.save_pretrained(out) as safetensors, without transformers' progress bar (a bar for one small shard is
    noise on the first screen of a run)."""
    # heavy: transformers, imported on first use
    from transformers.utils import logging as hf_logging

    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(out, safe_serialization=True)
    finally:
        if bar:
            hf_logging.enable_progress_bar()


def _append_mtp_layers(spec: TinySpec, vocab: int, path: Path) -> None:
    """Add DeepSeek-style multi-token-prediction layers `model.layers.{L+i}` to the saved weights, named as
    released checkpoints name them: a full MoE decoder layer (drawn like the last decoder layer, whose
    checkpoint names it takes) plus enorm, hnorm, eh_proj, shared_head and embed_tokens. transformers
    builds no MTP modules and skips these tensors on load, as vLLM does without speculative decoding."""
    # heavy: safetensors, imported on first use
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    last = f"model.layers.{spec.layers - 1}."
    hidden, dtype = spec.hidden, getattr(torch, spec.dtype)
    for i in range(spec.mtp_layers):
        prefix = f"model.layers.{spec.layers + i}."
        extra = {
            k[len(last) :]: v.float() + 0.02 * torch.randn(v.shape) for k, v in tensors.items() if k.startswith(last)
        }
        extra.update(
            {
                "enorm.weight": torch.ones(hidden),
                "hnorm.weight": torch.ones(hidden),
                "eh_proj.weight": torch.randn(hidden, 2 * hidden) * 0.02,
                "shared_head.norm.weight": torch.ones(hidden),
                "shared_head.head.weight": torch.randn(vocab, hidden) * 0.02,
                "embed_tokens.weight": torch.randn(vocab, hidden) * 0.02,
            }
        )
        tensors.update({prefix + k: v.to(dtype).contiguous() for k, v in extra.items()})
    save_file(tensors, str(path), metadata={"format": "pt"})


def built_in_model(run_dir: str | Path, arch: str, size: str, seed: int) -> str:
    """The trainers' default model (model.path empty): built once into `<run_dir>/tiny_model` by rank 0 unless it is
    there (a resumed run keeps its own). Collective when distributed."""
    path = Path(run_dir) / "tiny_model"
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank == 0 and not (path / "config.json").is_file():
        build_tiny_model(TinySpec(arch=arch, seed=seed, **SIZES[size]), path)
    elif rank != 0:
        # heavy: transformers, imported here while rank 0 builds (1-3 s), not after: this rank reads the model's
        # config and tokenizer with it next
        from transformers import AutoConfig, AutoTokenizer  # noqa: F401
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return str(path)
