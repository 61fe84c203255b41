"""Build a tiny random Hugging Face MoE model folder, fully offline (moe_rl.models.tiny).

Examples:
  python -m moe_rl.tools.tiny_model --arch qwen3_moe --out /tmp/tiny-qwen3
  python -m moe_rl.tools.tiny_model --size small --out /tmp/small-qwen3      # 10.9M: learns arithmetic
  python -m moe_rl.tools.tiny_model --size deep --out /tmp/deep-qwen3        # 12.0M in 12 layers (bench/stability.py)
  python -m moe_rl.tools.tiny_model --arch mixtral --out /tmp/tiny-mixtral --dtype bfloat16
  python -m moe_rl.tools.tiny_model --arch qwen3_moe --dense-layers 0 --layers 3 --out /tmp/q
  python -m moe_rl.tools.tiny_model --arch olmoe --num-experts 320 --topk 4 --out /tmp/big-e
  python -m moe_rl.tools.tiny_model --arch glm4_moe --n-group 4 --topk-group 2 --topk 4 --out /tmp/glm
  python -m moe_rl.tools.tiny_model --arch deepseek_v3 --mtp-layers 1 --out /tmp/dsv3
  python -m moe_rl.tools.tiny_model --arch gpt_oss --sliding-window 16 --out /tmp/gpt-oss
"""

from __future__ import annotations

import argparse

from moe_rl.actor.converters import get_converter
from moe_rl.models.config import ARCHS, Size
from moe_rl.models.tiny import SIZES, TinySpec, build_tiny_model


def _parse_int_list(text: str) -> list[int]:
    return [int(x) for x in text.replace(",", " ").split()] if text else []


def _parser() -> argparse.ArgumentParser:
    """The command line: one option per TinySpec field, plus --out and --size."""
    p = argparse.ArgumentParser(
        prog="python -m moe_rl.tools.tiny_model",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d = TinySpec()
    p.add_argument("--arch", choices=ARCHS, default=d.arch, help="HF architecture family")
    p.add_argument("--out", required=True, help="output folder (created)")
    p.add_argument("--num-experts", type=int, default=d.num_experts, help="routed experts per MoE layer")
    p.add_argument("--topk", type=int, default=d.topk, help="experts per token")
    p.add_argument("--layers", type=int, help="(default: the --size's) decoder layers")
    p.add_argument(
        "--dense-layers",
        type=_parse_int_list,
        default=None,
        help="decoder layers with a dense MLP, e.g. '0' or '0,2' (qwen3_moe mlp_only_layers); for glm4_moe and "
        "deepseek_v3 a "
        "leading block, '0' or '0,1' (first_k_dense_replace; default '0'; '' for none)",
    )
    p.add_argument("--n-group", type=int, default=d.n_group, help="glm4_moe/deepseek_v3: expert groups")
    p.add_argument("--topk-group", type=int, default=d.topk_group, help="glm4_moe/deepseek_v3: groups a token uses")
    p.add_argument("--shared-experts", type=int, default=d.shared_experts, help="glm4_moe/deepseek_v3: shared experts")
    p.add_argument(
        "--routed-scaling-factor", type=float, default=d.routed_scaling_factor, help="glm4_moe/deepseek_v3: gate scale"
    )
    p.add_argument(
        "--mtp-layers",
        type=int,
        default=d.mtp_layers,
        help="glm4_moe/deepseek_v3: multi-token-prediction layers written after the decoder's, as in released "
        "checkpoints (num_nextn_predict_layers; the actor neither trains nor replays them)",
    )
    p.add_argument(
        "--sliding-window",
        type=int,
        default=d.sliding_window,
        help="gpt_oss: keys a query sees on the sliding-window layers (every other layer, the first included)",
    )
    p.add_argument("--hidden", type=int, help="(default: the --size's) hidden size (multiple of 32)")
    p.add_argument("--heads", type=int, help="(default: the --size's) attention heads")
    p.add_argument("--kv-heads", type=int, help="(default: the --size's) key/value heads (GQA)")
    p.add_argument("--head-dim", type=int, default=d.head_dim, help="attention head dim")
    p.add_argument("--moe-intermediate", type=int, help="(default: the --size's) expert FFN size")
    p.add_argument("--intermediate", type=int, help="(default: the --size's) dense FFN size")
    p.add_argument("--vocab-size", type=int, default=d.vocab_size, help="tokenizer/embedding size")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=d.dtype, help="saved weight dtype")
    p.add_argument("--seed", type=int, default=d.seed, help="weight init seed")
    p.add_argument(
        "--tie-embeddings", action="store_true", help="share the input embedding with the LM head (tie_word_embeddings)"
    )
    p.add_argument(
        "--size",
        choices=[s.value for s in Size],
        default=Size.tiny.value,
        help="preset of --hidden, --heads, --kv-heads, --layers, --moe-intermediate, --intermediate "
        "(tiny: 1.1M parameters; small: 10.9M, learns arithmetic; deep: 12.0M in 12 layers, the stability lab's); "
        "an explicit flag overrides it",
    )
    return p


def main(argv: list[str] | None = None) -> None:
    """Build the model the options ask for; a model the trainer's actor would refuse is a usage error."""
    p = _parser()
    a = p.parse_args(argv)
    spec = _spec(a)
    try:
        out = build_tiny_model(spec, a.out, check=_actor_accepts)
    except ValueError as e:
        p.error(str(e))
    print(f"wrote {spec.arch} model ({spec.num_experts} experts, top-{spec.topk}, {spec.layers} layers) to {out}")


def _spec(a: argparse.Namespace) -> TinySpec:
    """The TinySpec the parsed options ask for; a size option left out takes the --size's value (in `a` too)."""
    d = TinySpec()
    for key in ("layers", "hidden", "heads", "kv_heads", "moe_intermediate", "intermediate"):
        if getattr(a, key) is None:  # not given: the size's value
            setattr(a, key, SIZES[a.size].get(key, getattr(d, key)))
    return TinySpec(
        arch=a.arch,
        num_experts=a.num_experts,
        topk=a.topk,
        layers=a.layers,
        dense_layers=a.dense_layers,
        hidden=a.hidden,
        heads=a.heads,
        kv_heads=a.kv_heads,
        head_dim=a.head_dim,
        moe_intermediate=a.moe_intermediate,
        intermediate=a.intermediate,
        vocab_size=a.vocab_size,
        dtype=a.dtype,
        seed=a.seed,
        tie_embeddings=a.tie_embeddings,
        n_group=a.n_group,
        topk_group=a.topk_group,
        shared_experts=a.shared_experts,
        routed_scaling_factor=a.routed_scaling_factor,
        mtp_layers=a.mtp_layers,
        sliding_window=a.sliding_window,
    )


def _actor_accepts(hf_config) -> None:
    """Refuse a model the trainer's actor would refuse (e.g. GLM/DeepSeek grouped routing megatron-core cannot
    reproduce), as the trainer would: through its converter's megatron config."""
    try:
        get_converter(hf_config).transformer_config_kwargs()
    except ValueError as e:
        raise ValueError(f"the trainer's actor would refuse this model: {e}") from e


if __name__ == "__main__":
    main()
