"""Load HF safetensors into a sharded megatron-core model, and gather it back to HF tensors.

Sharding is decided here from parameter names (megatron's `partition_dim` attributes are only
set when megatron initialises weights itself, which the actor skips):

  TP, dim 0: embedding, output layer, linear_qkv, MLA q and kv up projections, dense linear_fc1
             (gate and up split apart), attention sinks; MLA's latent down projections are replicated
  TP, dim 1: linear_proj, dense linear_fc2
  expert TP: experts' linear_fc1 weight and bias (dim 0, gated) and linear_fc2 (dim 1)
  replicated: every other bias (linear_proj's and linear_fc2's are added once, after the reduction)
  EP:        whole experts (local expert j on EP rank r is global expert r * E_local + j)
  PP/VPP:    whole decoder layers (`layer_number` of each layer module is its global index + 1)
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from moe_rl.actor.converters import Converter
from moe_rl.common.distributed import all_gather_objects, tensor_nbytes
from moe_rl.common.hf_names import split_expert_slice, stack_expert_slices

_LOCAL_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_LOCAL_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.")


class HFCheckpoint:
    """Lazy reader of an HF safetensors checkpoint (single file or sharded with an index)."""

    def __init__(self, hf_dir: str | Path):
        # heavy: safetensors, imported on first use
        from safetensors import safe_open

        self.dir = Path(hf_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (self.dir / "model.safetensors").is_file():
            weight_map = None
        else:
            raise FileNotFoundError(
                f"{self.dir}: no model.safetensors or model.safetensors.index.json (only safetensors is supported)"
            )
        files = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
        self._handles = {}
        for f in files:
            path = self.dir / f
            if not path.is_file():
                raise FileNotFoundError(f"{self.dir}: shard {f} named in the index is missing")
            self._handles[f] = safe_open(str(path), framework="pt")
        if weight_map is None:
            weight_map = {k: "model.safetensors" for k in self._handles["model.safetensors"].keys()}
        self.weight_map: dict[str, str] = weight_map

    def get(self, name: str) -> torch.Tensor:
        """One tensor; for an `expert_slice` name, that expert's slice of the stacked tensor (read alone)."""
        s = split_expert_slice(name)
        stacked = s[0] if s else name
        if stacked not in self.weight_map:
            raise KeyError(f"{self.dir}: tensor {stacked!r} is missing from the checkpoint")
        handle = self._handles[self.weight_map[stacked]]
        if s is None:
            return handle.get_tensor(name)
        view = handle.get_slice(stacked)
        if view.get_shape()[0] != s[2]:
            raise ValueError(f"{self.dir}: {stacked} stacks {view.get_shape()[0]} experts, config.json says {s[2]}")
        return view[s[1]]


# Column-parallel weights split by output rows (MLA: the up projections; the latent down projections are
# replicated over TP, see model.layer_spec).
_COLUMN_PARALLEL = (
    "linear_qkv.weight",
    "linear_qkv.bias",
    "word_embeddings.weight",
    "linear_q_proj.weight",
    "linear_q_up_proj.weight",
    "linear_kv_up_proj.weight",
    "core_attention.softmax_offset",  # GPT-OSS's sinks: one per head
)


def _shard_rule(name: str, conv: Converter) -> tuple[str, int | None, bool]:
    """(group kind 'tp'|'etp'|'', partition dim or None, gated) for a local megatron name."""
    expert = ".mlp.experts." in name
    group = "etp" if expert else "tp"
    if name.endswith(("linear_fc1.weight", "linear_fc1.bias")):
        return group, 0, True
    if name.endswith(("linear_fc2.weight", "linear_proj.weight")):
        return group, 1, False
    if name.endswith(_COLUMN_PARALLEL) or name == "output_layer.weight":
        return "tp", 0, False
    if conv.qk_norm == "full_width" and name.endswith(("q_layernorm.weight", "k_layernorm.weight")):
        return "tp", 0, False
    return "", None, False


def _group(kind: str):
    # heavy: megatron-core, imported on first use
    from megatron.core import parallel_state as ps

    if kind == "tp":
        return (
            ps.get_tensor_model_parallel_group(),
            ps.get_tensor_model_parallel_rank(),
            ps.get_tensor_model_parallel_world_size(),
        )
    return (
        ps.get_expert_tensor_parallel_group(),
        ps.get_expert_tensor_parallel_rank(),
        ps.get_expert_tensor_parallel_world_size(),
    )


def global_name(local_name: str, chunk: torch.nn.Module) -> str:
    """Map a chunk-local parameter name to its global megatron name (global layer and expert)."""
    # heavy: megatron-core, imported on first use
    from megatron.core import parallel_state as ps

    m = _LOCAL_LAYER.match(local_name)
    if not m:
        return local_name
    layer = chunk.decoder.layers[int(m.group(1))]
    name = f"decoder.layers.{layer.layer_number - 1}." + local_name[m.end() :]
    e = _LOCAL_EXPERT.search(name)
    if e:
        experts = layer.mlp.experts
        n_local = len(experts.local_experts)
        g = ps.get_expert_model_parallel_rank() * n_local + int(e.group(1))
        name = name[: e.start(1)] + str(g) + name[e.end(1) :]
    return name


def is_adapter_param(name: str) -> bool:
    """A LoRA factor's local parameter name (moe_rl/actor/lora.py: `<linear>.lora.a` / `.lora.b`)."""
    return name.endswith((".lora.a", ".lora.b"))


def merged_weight(p: torch.Tensor) -> torch.Tensor:
    """A parameter as the engines and an HF export see it: a LoRA base weight (its `lora` attribute: the adapter,
    moe_rl/actor/lora.py) with its adapter merged, W + (alpha / r) B A in W's dtype; any other as it is."""
    adapter = getattr(p, "lora", None)
    if adapter is None or not adapter.enabled:
        return p.detach()
    return (p.detach().to(torch.float32) + adapter.delta()).to(p.dtype)


def _local_params(chunks: Iterable[torch.nn.Module]) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(local name, global name, tensor) for every parameter this rank owns, and the routers' expert
    bias: a buffer, but part of the checkpoint and of every weight sync (the engine selects with it)."""
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if not is_adapter_param(name):  # LoRA factors: merged into their base weight (merged_weight)
                yield name, global_name(name, chunk), p
        for name, b in chunk.named_buffers():
            if name.endswith("router.expert_bias"):
                yield name, global_name(name, chunk), b


def load_hf_weights(chunks: list[torch.nn.Module], conv: Converter, hf_dir: str | Path) -> None:
    """Copy HF weights into this rank's shards; every parameter must be loaded, shapes must match."""
    ckpt = HFCheckpoint(hf_dir)
    padded_vocab = chunks[0].vocab_size
    for local, gname, p in _local_params(chunks):
        try:
            full = conv.to_mcore(gname, ckpt.get, padded_vocab)
        except KeyError as e:
            raise KeyError(f"loading {gname}: {e.args[0]}") from None
        kind, dim, gated = _shard_rule(local, conv)
        if kind:
            _, rank, size = _group(kind)
            shard = take_shard(full, dim, rank, size, gated)
            # read by megatron's grad-norm and checkpoint code to tell shards from duplicates
            p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, 1
        else:
            shard = full
        if tuple(shard.shape) != tuple(p.shape):
            raise ValueError(
                f"{hf_dir}: shape mismatch for {gname} (HF {conv.hf_names(gname)}):"
                f" checkpoint gives {tuple(shard.shape)}, model expects {tuple(p.shape)}"
                " -- does config.json match the weights?"
            )
        with torch.no_grad():
            p.copy_(shard.to(p.dtype))


def take_shard(full: torch.Tensor, dim: int, rank: int, size: int, gated: bool) -> torch.Tensor:
    if size == 1:
        return full
    if gated:  # [gate; up] -> [gate_r; up_r]
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, 0)[rank], up.chunk(size, 0)[rank]], dim=0)
    return full.chunk(size, dim=dim)[rank]


def _gather_full(p: torch.Tensor, local: str, conv: Converter) -> torch.Tensor:
    """The whole parameter (a LoRA base weight with its adapter merged) from its TP/ETP shards. Collective over the
    group that shards it."""
    kind, dim, gated = _shard_rule(local, conv)
    p = merged_weight(p)
    if not kind:
        return p
    group, _, size = _group(kind)
    return gather_shards(p, group, size, dim, gated)


def gather_shards(p: torch.Tensor, group, size: int, dim: int, gated: bool) -> torch.Tensor:
    """The whole tensor from the `size` ranks' slices along `dim` (inverse of `take_shard`; gated: [gate; up]
    halves split separately). Collective over `group`."""
    if size == 1:
        return p
    parts = [torch.empty_like(p) for _ in range(size)]
    dist.all_gather(parts, p.contiguous(), group=group)
    if gated:
        gates, ups = zip(*(t.chunk(2, dim=0) for t in parts), strict=True)
        return torch.cat([*gates, *ups], dim=0)
    return torch.cat(parts, dim=dim)


def _owns_unique_copy(local: str) -> bool:
    """One rank per distinct tensor contributes it to an export (no duplicates across DP/TP)."""
    # heavy: megatron-core, imported on first use
    from megatron.core import parallel_state as ps

    if ".mlp.experts." in local:
        return ps.get_expert_tensor_parallel_rank() == 0 and ps.get_expert_data_parallel_rank() == 0
    return (
        ps.get_tensor_model_parallel_rank() == 0
        and ps.get_data_parallel_rank() == 0
        and ps.get_context_parallel_rank() == 0
    )


def iter_hf_tensors(chunks: list[torch.nn.Module], conv: Converter) -> Iterator[tuple[str, torch.Tensor]]:
    """HF (name, full tensor) pairs for the parameters this rank owns a unique copy of.

    Collective over TP/ETP groups: every rank must iterate to the end.
    """
    for local, gname, p in _local_params(chunks):
        full = _gather_full(p, local, conv)
        if gname == "output_layer.weight" and conv.tie:
            continue
        if _owns_unique_copy(local):
            yield from conv.to_hf(gname, full).items()


def export_hf_state_dict(chunks: list[torch.nn.Module], conv: Converter) -> dict[str, torch.Tensor]:
    """The full HF state dict, on every rank (gathers TP/EP/PP shards). Collective."""
    mine = dict(iter_hf_tensors(chunks, conv))
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return stack_expert_slices(mine.items())
    parts: list[dict[str, torch.Tensor] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return stack_expert_slices(item for part in parts for item in (part or {}).items())


def full_hf_state_dict(chunks: list[torch.nn.Module], conv: Converter) -> dict[str, torch.Tensor]:
    """The full HF state dict on every rank: converted locally when no parameter is sharded (pure data
    parallelism), else gathered (export_hf_state_dict). Collective."""
    # heavy: megatron-core, imported on first use
    from megatron.core import parallel_state as ps

    sharded = (
        ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_context_parallel_world_size(),
        ps.get_expert_model_parallel_world_size(),
        ps.get_expert_tensor_parallel_world_size(),
    )
    if max(sharded) > 1:
        return export_hf_state_dict(chunks, conv)
    return stack_expert_slices(
        item
        for _, gname, p in _local_params(chunks)
        if not (gname == "output_layer.weight" and conv.tie)
        for item in conv.to_hf(gname, merged_weight(p)).items()
    )


# ---- streaming export: one tensor at a time, from its owner --------------------------------


@dataclass
class ExportEntry:
    """One actor parameter in a streaming export: the rank that contributes it, its index among that
    rank's parameters (the same on the peers that gather its shards), which group gathers them
    ('tp' | 'etp' | '' for none) and the HF tensors it becomes: (name, shape, dtype name)."""

    owner: int
    index: int
    kind: str
    tensors: list[tuple[str, tuple[int, ...], str]]

    @property
    def nbytes(self) -> int:
        return sum(tensor_nbytes(shape, dtype) for _, shape, dtype in self.tensors)


def export_plan(chunks: list[torch.nn.Module], conv: Converter, changed_only: bool = False) -> list[ExportEntry]:
    """Every distinct HF tensor of the model with the rank that contributes it, in one order all ranks
    share (by owner rank, then parameter order). Shapes come from converting meta tensors: no weight
    moves. Collective: one all_gather_object of this metadata. `changed_only` (a LoRA actor): the parameters of
    the adapted linears (`lora_linear`: merged weight and bias, every tensor of the engine layer they become) and
    the routers' expert bias, the only ones a LoRA update changes."""
    me = dist.get_rank() if dist.is_initialized() else 0
    mine = []
    for i, (local, gname, p) in enumerate(_local_params(chunks)):
        if not _owns_unique_copy(local) or (gname == "output_layer.weight" and conv.tie):
            continue
        if changed_only and not (getattr(p, "lora_linear", False) or local.endswith("router.expert_bias")):
            continue
        kind, dim, _ = _shard_rule(local, conv)
        shape = list(p.shape)
        if kind:
            shape[dim] *= _group(kind)[2]
        hf = conv.to_hf(gname, torch.empty(shape, dtype=p.dtype, device="meta"))
        specs = [(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in hf.items()]
        mine.append(ExportEntry(me, i, kind, specs))
    return [e for part in all_gather_objects(mine) for e in part]


class ExportProducer:
    """This rank's part in producing plan entries: gathers a parameter's shards with the peers that hold
    them (only the owner's TP/ETP group takes part) and converts it on the owner."""

    def __init__(self, chunks: list[torch.nn.Module], conv: Converter):
        self.params = list(_local_params(chunks))
        self.conv = conv
        self.me = dist.get_rank() if dist.is_initialized() else 0
        self._groups = {kind: set(_group_ranks(kind)) for kind in ("tp", "etp")}

    def __call__(self, e: ExportEntry) -> dict[str, torch.Tensor] | None:
        """HF tensors of `e` on its owner; None elsewhere (after taking part in the gather if needed)."""
        if self.me != e.owner and (not e.kind or e.owner not in self._groups[e.kind]):
            return None
        local, gname, p = self.params[e.index]
        full = _gather_full(p, local, self.conv)
        return self.conv.to_hf(gname, full) if self.me == e.owner else None


def _group_ranks(kind: str) -> list[int]:
    group, _, size = _group(kind)
    if not dist.is_initialized() or size == 1:
        return [dist.get_rank() if dist.is_initialized() else 0]
    return dist.get_process_group_ranks(group)
