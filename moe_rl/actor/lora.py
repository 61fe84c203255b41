"""LoRA adapters on the megatron actor's linears (actor.lora): y = W x + (alpha / r) B A x with the base W frozen in
the model's dtype and A (r x in), B (out x r) trained in fp32, initialised as PEFT does (A kaiming-uniform, B zero).

Each adapter sits on its base linear (`<linear>.lora.a`, `<linear>.lora.b`) and adds its output through a forward
hook, so the base's names, loading, export and checkpoint layout do not change; recompute re-runs the hook.
Adapters are sharded the way their base is, and every layout gets the same numbers (the initialisation draws the
whole A of a global layer/expert and keeps this rank's slice):

  column-parallel base (W: out/tp x in; linear_qkv, linear_fc1): A whole, B sharded on its rows. The input is
      gathered over the sequence like the base's (sequence parallel), B A x is this rank's output slice;
  row-parallel base (W: out x in/tp; linear_proj, linear_fc2): A sharded on its columns, B whole. A x is summed
      over TP (a small [tokens, r] all-reduce), then scattered over the sequence like the base's reduce-scatter.
  expert linears (`.mlp.experts.`): the same over the expert-tensor-parallel group, whose communication the token
      dispatcher does for the base: partial outputs stay partial.
  the router (`.mlp.router`, target `router`): replicated like its weight; its adapter adds to the gate's logits
      (through the router's `gating`) and, under sequence parallel, its gradients are summed over TP as the
      weight's are.

Where a whole factor's gradient is a sum of the ranks' partial ones, the autograd functions here reduce it (A of
a column base: dL/d(Ax) is partial per rank; B of an expert row base under ETP > 1).

The merged weight W + (alpha / r) B A of a rank's shard needs no communication (`merged_weight`): the weight sync
and the HF export merge shard by shard, then gather and convert as for full training.
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_rl.actor.config import LoraConfig, lora_kinds
from moe_rl.actor.weights import gather_shards, global_name, take_shard
from moe_rl.common.errors import ConfigError
from moe_rl.compat.megatron_model import add_to_router_logits

# targets -> which linears of a decoder layer they name
ATTENTION = ("linear_qkv", "linear_proj", "linear_q_proj", "linear_q_up_proj", "linear_kv_up_proj")
MLP = ("linear_fc1", "linear_fc2")


@dataclass
class Site:
    """One adapted linear: its module, the local name of its weight, which target it belongs to, and how it is
    split (`column` | `row` | `replicated`: the router) over which group (`tp` | `etp`)."""

    name: str
    module: torch.nn.Module
    target: str
    kind: str
    group: str


def find_sites(chunk: torch.nn.Module, targets: list[str]) -> list[Site]:
    """The linears of `chunk` that actor.lora.targets name (`all`: every kind this chunk has but the router)."""
    wanted = lora_kinds(targets)
    sites = []
    for name, module in chunk.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith(".mlp.router"):
            if "router" in wanted:
                sites.append(Site(name, module, "router", "replicated", "tp"))
            continue
        if ".self_attention." in f".{name}" and leaf in ATTENTION:
            target = "attention"
        elif leaf in MLP and ".mlp.experts." in name:
            target = "experts"
        elif leaf in MLP and ".mlp.shared_experts." in name:
            target = "shared_experts"
        elif leaf in MLP and name.endswith(f".mlp.{leaf}"):
            target = "mlp"
        else:
            continue
        if target not in wanted:
            continue
        kind = "row" if getattr(module, "input_is_parallel", None) is not None else "column"
        sites.append(Site(name, module, target, kind, "etp" if target == "experts" else "tp"))
    return sites


def check_model(conv, cfg: LoraConfig) -> None:
    """actor.lora against the model's sizes, before anything is built (a moe_rl.actor.converters Converter): a target
    named explicitly that the model does not have, a rank larger than the smallest linear it would adapt."""
    if not cfg.enabled:
        return
    kw = conv.transformer_config_kwargs()
    pattern = conv.moe_layer_pattern()
    attn_out = (conv.num_heads + 2 * conv.num_kv) * conv.head_dim
    smallest = {  # target -> the smaller side of its smallest linear
        "attention": min(conv.hidden, attn_out, conv.num_heads * conv.head_dim),
        "mlp": min(conv.hidden, kw["ffn_hidden_size"]) if 0 in pattern else 0,
        "experts": min(conv.hidden, conv.moe_ffn_hidden_size) if 1 in pattern else 0,
        "shared_experts": min(conv.hidden, kw.get("moe_shared_expert_intermediate_size") or 0),
        "router": min(conv.hidden, conv.num_experts) if 1 in pattern else 0,
    }
    check_targets({t: int(n > 0) for t, n in smallest.items()}, list(cfg.targets))
    wanted = [t for t, n in smallest.items() if n and t in lora_kinds(list(cfg.targets))]
    for t in wanted:
        if cfg.rank > smallest[t]:
            raise ConfigError(
                f"actor.lora.rank={cfg.rank} is larger than the {t} linears allow (their smaller side: "
                f"{smallest[t]}); choose at most {min(smallest[x] for x in wanted)}"
            )


def check_targets(found: dict[str, int], targets: list[str]) -> None:
    """ConfigError naming actor.lora.targets when a target it names explicitly matches no linear of the model
    (`found`: linears per target over the whole model), or when nothing matches at all."""
    missing = [t for t in targets if t != "all" and not found.get(t)]
    if missing:
        have = ", ".join(t for t, n in sorted(found.items()) if n) or "none"
        raise ConfigError(f"actor.lora.targets: {missing} match no linear of this model (it has: {have})")
    if not sum(found.values()):
        raise ConfigError("actor.lora.targets: no linear of this model matches")


class _InputFactor(torch.autograd.Function):
    """h = x A^T whose gradient for A sums dL/dh over `group` (each rank holds a partial one: its slice of B's
    rows); dL/dx stays partial, as the base's input gradient is before its reduction."""

    @staticmethod
    def forward(ctx, x, a, group):
        ctx.save_for_backward(x, a)
        ctx.group = group
        return x @ a.t()

    @staticmethod
    def backward(ctx, dh):
        x, a = ctx.saved_tensors
        dx = dh @ a
        if ctx.group is not None:
            dh = dh.clone()
            dist.all_reduce(dh, group=ctx.group)
        da = dh.reshape(-1, dh.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        return dx, da, None


class _OutputFactor(torch.autograd.Function):
    """y = h B^T for a partial h (an expert row base under ETP > 1: its output is summed by the dispatcher): B's
    gradient sums the ranks' dL/dy^T h over `group`."""

    @staticmethod
    def forward(ctx, h, b, group):
        ctx.save_for_backward(h, b)
        ctx.group = group
        return h @ b.t()

    @staticmethod
    def backward(ctx, dy):
        h, b = ctx.saved_tensors
        db = dy.reshape(-1, dy.shape[-1]).t() @ h.reshape(-1, h.shape[-1])
        if ctx.group is not None:
            dist.all_reduce(db, group=ctx.group)
        return dy @ b, db, None


class LoraAdapter(torch.nn.Module):
    """The trained factors of one linear (a: [r, in or in/tp], b: [out or out/tp, r], fp32) and its forward."""

    def __init__(self, site: Site, rank: int, alpha: float, dropout: float):
        super().__init__()
        out_f, in_f = site.module.weight.shape  # this rank's shard
        self.kind, self.scale, self.enabled = site.kind, alpha / rank, True
        self.a = torch.nn.Parameter(torch.zeros(rank, in_f, dtype=torch.float32))
        self.b = torch.nn.Parameter(torch.zeros(out_f, rank, dtype=torch.float32))
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else None
        base = site.module
        self.group = getattr(base, "tp_group", None)  # the router's too: its checkpoint replicas are per TP rank
        self.size = self.group.size() if self.group is not None else 1
        self.sequence_parallel = bool(getattr(base, "sequence_parallel", False))
        self.explicit = bool(getattr(base, "explicit_expert_comm", False))
        # megatron's linear_fc1 of a gated MLP holds [gate; up]: each half is split over TP
        self.gated = site.name.endswith("linear_fc1") and bool(base.config.gated_linear_unit)
        if self.kind == "replicated":  # the router: each rank its own tokens under sequence parallel, as the weight
            for p in (self.a, self.b):
                p.sequence_parallel = bool(getattr(base.weight, "sequence_parallel", False))
            return
        sharded = self.b if self.kind == "column" else self.a
        if self.size > 1:  # read by megatron's grad norm and by `shard`: a slice, not a duplicate
            sharded.tensor_model_parallel, sharded.partition_dim, sharded.partition_stride = (
                True,
                int(self.kind == "row"),
                1,
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # heavy: megatron-core, imported on first use
        from megatron.core.tensor_parallel import mappings

        dtype = x.dtype
        if self.dropout is not None and torch.is_grad_enabled():  # the update only: old log-probs see no noise
            x = self.dropout(x)
        x = x.to(torch.float32)
        tp = self.group if self.size > 1 else None
        if self.kind == "replicated":
            return (self.scale * (x @ self.a.t()) @ self.b.t()).to(dtype)
        if self.kind == "column":
            if tp is not None and not self.explicit:
                if self.sequence_parallel:  # the base gathers the sequence: so does its adapter
                    x = mappings.gather_from_sequence_parallel_region(x, True, group=tp)
                else:  # the base's input gradient is all-reduced over TP: the adapter's partial one joins it
                    x = mappings.copy_to_tensor_model_parallel_region(x, group=tp)
            h = _InputFactor.apply(x, self.a, tp)
            y = h @ self.b.t()
        else:
            h = x @ self.a.t()
            if tp is not None and self.explicit:  # partial output, reduced by the dispatcher like the base's
                y = _OutputFactor.apply(h, self.b, tp)
            else:
                if tp is not None:
                    h = mappings.reduce_from_tensor_model_parallel_region(h, group=tp)
                y = h @ self.b.t()
                if tp is not None and self.sequence_parallel:
                    y = mappings.scatter_to_sequence_parallel_region(y, group=tp)
        return (self.scale * y).to(dtype)

    def delta(self) -> torch.Tensor:
        """(alpha / r) B A for this rank's shard of the base weight, fp32."""
        return self.scale * (self.b.detach() @ self.a.detach())


def _hook(module, args, output):
    adapter = module.lora
    if not adapter.enabled:
        return output
    out, bias = output
    return out + adapter(args[0]), bias


def _router_term(adapter: LoraAdapter, x: torch.Tensor) -> torch.Tensor | None:
    return adapter(x) if adapter.enabled else None


def attach(chunks: list[torch.nn.Module], cfg: LoraConfig) -> list[Site]:
    """Add an adapter to every linear actor.lora.targets names, freeze everything else, initialise the adapters
    (A kaiming-uniform as PEFT's default, from a generator seeded by actor.lora.seed and the linear's global name,
    so that every layout draws the same numbers; B zero). Returns the adapted sites. Call after the base weights
    are loaded (their TP attributes tell shards from duplicates)."""
    sites = [s for c in chunks for s in find_sites(c, list(cfg.targets))]
    for c in chunks:
        c.requires_grad_(False)
    for s in sites:
        check_rank(s, cfg.rank)
        s.module.lora = LoraAdapter(s, cfg.rank, cfg.alpha, cfg.dropout)
        s.module.weight.lora = s.module.lora  # read by the weight export (weights.merged_weight)
        for p in s.module._parameters.values():  # the linear's own (weight, bias): what a weight sync sends
            if p is not None:
                p.lora_linear = True
        if s.kind == "replicated":  # the router returns probabilities and a map: its logits come from `gating`
            add_to_router_logits(s.module, functools.partial(_router_term, s.module.lora))
        else:
            s.module.register_forward_hook(_hook)
    for c in chunks:
        if getattr(c, "embedding", None) is not None:  # the first pipeline stage
            c.embedding.register_forward_hook(_input_requires_grad)
    init_adapters(chunks, cfg.seed)
    return sites


def describe(chunks: list[torch.nn.Module], sites: list[Site]) -> str:
    """The run header's LoRA line: what is adapted and how many parameters train on this rank."""
    trainable = sum(p.numel() for _, _, a in adapters(chunks) for p in (a.a, a.b))
    total = sum(p.numel() for c in chunks for p in c.parameters()) - trainable
    kinds = ", ".join(sorted({s.target for s in sites}))
    a = sites[0].module.lora
    return (
        f"LoRA: rank {a.a.shape[0]}, scale alpha/rank {a.scale:g}, {len(sites)} linears ({kinds}); "
        f"{trainable / 1e6:.2f}M trainable fp32 parameters on rank 0 beside its {total / 1e6:.1f}M frozen base ones"
    )


def _input_requires_grad(module, args, output):
    """The frozen embedding's output as a tensor that requires grad (PEFT's enable_input_require_grads): megatron's
    activation recompute (model.recompute) runs a checkpointed layer's backward only when its input requires grad,
    and without it the adapters inside would get none."""
    if torch.is_grad_enabled() and not output.requires_grad:
        return output.requires_grad_()
    return output


def check_rank(site: Site, rank: int) -> None:
    """ConfigError when actor.lora.rank is larger than the linear it adapts (the smaller side of its whole weight:
    a larger rank adds nothing a smaller one cannot)."""
    out_f, in_f = site.module.weight.shape
    group = getattr(site.module, "tp_group", None)
    size = group.size() if group is not None else 1
    if site.kind != "replicated":
        out_f, in_f = (out_f * size, in_f) if site.kind == "column" else (out_f, in_f * size)
    if rank > min(out_f, in_f):
        raise ConfigError(
            f"actor.lora.rank={rank} is larger than {site.name} ({out_f} x {in_f}): at most {min(out_f, in_f)}"
        )


def adapters(chunks: list[torch.nn.Module]) -> Iterator[tuple[str, torch.nn.Module, LoraAdapter]]:
    """(local name of the base linear, its chunk, its adapter) for every adapter of `chunks`."""
    for chunk in chunks:
        for name, module in chunk.named_modules():
            if isinstance(module, LoraAdapter):
                yield name.removesuffix(".lora"), chunk, module


def has_lora(chunks: list[torch.nn.Module]) -> bool:
    return any(True for _ in adapters(chunks))


def _group_rank(adapter: LoraAdapter) -> int:
    return dist.get_rank(adapter.group) if adapter.size > 1 else 0


def whole_shape(adapter: LoraAdapter, which: str) -> tuple[int, int]:
    """The shape of factor `which` ('a' | 'b') over every rank of its group."""
    p = getattr(adapter, which)
    shape = list(p.shape)
    if getattr(p, "tensor_model_parallel", False):
        shape[p.partition_dim] *= adapter.size
    return shape[0], shape[1]


def _split(adapter: LoraAdapter, which: str) -> tuple[int, bool]:
    """(partition dim, gated) of factor `which`: a column base's B follows its weight's rows ([gate; up] halves split
    separately for linear_fc1), a row base's A its weight's columns."""
    p = getattr(adapter, which)
    return p.partition_dim, adapter.gated and which == "b"


def shard(adapter: LoraAdapter, which: str, whole: torch.Tensor) -> torch.Tensor:
    """This rank's slice of a whole factor, as the base weight is sliced (weights.take_shard)."""
    if not getattr(getattr(adapter, which), "tensor_model_parallel", False):
        return whole
    dim, gated = _split(adapter, which)
    return take_shard(whole, dim, _group_rank(adapter), adapter.size, gated)


def gather(adapter: LoraAdapter, which: str, grad: bool = False) -> torch.Tensor:
    """The whole factor (or with `grad` its gradient) from every rank's slice (weights.gather_shards; collective over
    the adapter's group when it is sliced)."""
    p = getattr(adapter, which).grad if grad else getattr(adapter, which).detach()
    if not getattr(getattr(adapter, which), "tensor_model_parallel", False):
        return p
    dim, gated = _split(adapter, which)
    return gather_shards(p, adapter.group, adapter.size, dim, gated)


def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


@torch.no_grad()
def init_adapters(chunks: list[torch.nn.Module], seed: int, b_std: float = 0.0) -> None:
    """A ~ U(-1/sqrt(in), 1/sqrt(in)) (kaiming_uniform with a=sqrt(5), PEFT's and nn.Linear's default), B = 0, or
    B ~ N(0, b_std) (tests: an adapter whose output is not zero). Drawn whole per global linear, then sliced: every
    layout gets the same adapters."""
    for local, chunk, adapter in adapters(chunks):
        gname = global_name(f"{local}.weight", chunk).removesuffix(".weight")
        gen = _generator(seed, gname)
        r, fan_in = whole_shape(adapter, "a")
        a = (torch.rand(r, fan_in, generator=gen, dtype=torch.float64) * 2 - 1) / math.sqrt(fan_in)
        adapter.a.copy_(shard(adapter, "a", a).to(torch.float32))
        if b_std:
            b = torch.randn(whole_shape(adapter, "b"), generator=gen, dtype=torch.float64) * b_std
            adapter.b.copy_(shard(adapter, "b", b).to(torch.float32))
        else:
            adapter.b.zero_()


class adapters_off:
    """Within it, the adapters of `chunks` add nothing (the base model: the KL reference policy)."""

    def __init__(self, chunks: list[torch.nn.Module]):
        self.found = [a for _, _, a in adapters(chunks)]

    def __enter__(self):
        for a in self.found:
            a.enabled = False

    def __exit__(self, *exc):
        for a in self.found:
            a.enabled = True


# ---- PEFT's format ------------------------------------------------------------------------------------------------

PEFT_REFUSED = (
    "PEFT 0.21 cannot hold this adapter: for transformers 5's MoE models (qwen3_moe, glm4_moe, deepseek_v3, olmoe, "
    "mixtral) it maps every gate_proj / up_proj / down_proj target onto the fused routed experts, so a dense layer's "
    "or a shared expert's MLP adapter is dropped on load, and routed experts are 3D parameters, not modules; the "
    "merged export holds every adapter; a router (HF: mlp.gate) is not a Linear module PEFT can wrap"
)


def hf_adapter_tensors(chunks: list[torch.nn.Module], conv) -> dict[str, torch.Tensor]:
    """Every adapter of this rank's chunks in PEFT's naming, {`<hf module>.lora_A.weight`: A, `.lora_B.weight`: B}
    with HF module names (`model.layers.0.self_attn.q_proj`), whole factors, on every rank of the factor's group
    (collective over TP/ETP). A fused megatron linear becomes one PEFT adapter per HF projection with A shared:
    linear_qkv's B splits into q/k/v rows. Only attention adapters are expressible in PEFT 0.21: ValueError naming
    the first other (PEFT_REFUSED says why)."""
    out: dict[str, torch.Tensor] = {}
    for local, chunk, adapter in adapters(chunks):
        gname = global_name(f"{local}.weight", chunk)
        if ".self_attention." not in gname:
            raise ValueError(f"{gname.removesuffix('.weight')}: {PEFT_REFUSED}")
        a, b = gather(adapter, "a"), gather(adapter, "b")
        if adapter.kind == "column":  # B's rows are the base's output rows: split like the weight, A shared
            for name, b_part in conv.to_hf(gname, b).items():
                module = name.removesuffix(".weight")
                out[f"{module}.lora_A.weight"], out[f"{module}.lora_B.weight"] = a.clone(), b_part.contiguous()
        else:  # A's columns are the base's input columns: the base's HF name, B whole
            for name, a_part in conv.to_hf(gname, a).items():
                module = name.removesuffix(".weight")
                out[f"{module}.lora_A.weight"], out[f"{module}.lora_B.weight"] = a_part.contiguous(), b.clone()
    return out


# ---- checkpoints: the adapters only -------------------------------------------------------------------------------


def sharded_state_dict(chunks: list[torch.nn.Module]) -> dict:
    """megatron dist-checkpointing entries for the adapters alone (the base weights are the run's HF folder), keyed by
    global layer and expert, each a ShardedTensor over its TP/ETP slices and replicated over data parallel: a
    checkpoint loads under any layout. The Parameters themselves are the entries' data (the optimizer's sharded state
    dict maps its states through them)."""
    # heavy: megatron-core, imported on first use
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    out = {}
    for local, chunk, adapter in adapters(chunks):
        gname = global_name(f"{local}.weight", chunk).removesuffix(".weight")
        expert = ".mlp.experts." in gname
        dp = ps.get_expert_data_parallel_rank() if expert else ps.get_data_parallel_rank(with_context_parallel=True)
        for which in ("a", "b"):
            p = getattr(adapter, which)
            key = f"{gname}.lora.{which}"
            if getattr(p, "tensor_model_parallel", False):
                out[key] = ShardedTensor.from_rank_offsets(
                    key, p, (p.partition_dim, _group_rank(adapter), adapter.size), replica_id=(0, 0, dp)
                )
            else:
                out[key] = ShardedTensor.from_rank_offsets(key, p, replica_id=(0, _group_rank(adapter), dp))
    return out


@torch.no_grad()
def load_state_dict(chunks: list[torch.nn.Module], loaded: dict) -> None:
    """Copy loaded adapter factors (`sharded_state_dict`'s keys) into this rank's adapters; KeyError naming a
    factor the checkpoint lacks."""
    for local, chunk, adapter in adapters(chunks):
        gname = global_name(f"{local}.weight", chunk).removesuffix(".weight")
        for which in ("a", "b"):
            key = f"{gname}.lora.{which}"
            if key not in loaded:
                raise KeyError(f"the checkpoint holds no adapter {key} (was it trained with these actor.lora.targets?)")
            getattr(adapter, which).copy_(loaded[key])
