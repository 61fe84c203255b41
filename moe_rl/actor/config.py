"""`parallel.*` and the activation-recompute choice as data: the actor's layout (moe_rl/actor/parallel.py builds its
process groups from it) and what model.recompute takes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from moe_rl.common.errors import ConfigError, refuse


class Recompute(StrEnum):
    """Activation recompute (model.recompute; null: none)."""

    full = "full"  # every decoder layer's activations, recomputed in the backward
    selective = "selective"  # the core attention only (megatron's recompute_granularity=selective)


@dataclass
class ParallelConfig:
    """Model-parallel layout. Data parallel is whatever is left of the world size."""

    tp: int = 1
    """Tensor parallel size (attention heads, dense MLP, vocab). MoE with tp > 1 turns on sequence parallel."""
    pp: int = 1
    """Pipeline parallel size (decoder layers split into contiguous stages)."""
    vpp: int | None = None
    """Virtual pipeline stages per rank (interleaved schedule); None for none."""
    ep: int = 1
    """Expert parallel size (experts split across ranks)."""
    etp: int = 1
    """Expert tensor parallel size (each expert's FFN split across ranks); 1 is the usual MoE choice."""
    cp: int = 1
    """Context parallel size (sequences split in 2*cp zig-zag chunks; GPU: Transformer Engine attention,
    CPU: actor/context_parallel.py)."""
    first_stage_layers: int | None = None
    """Decoder layers on the first pipeline stage when it should hold fewer or more than the others (megatron's
    num_layers_in_first_pipeline_stage; the stage that also holds the embedding). None: an equal share. The
    stages neither this nor last_stage_layers sets split the remaining layers equally. E.g. DeepSeek-V3's 61 layers
    on pp=11: first_stage_layers=3 last_stage_layers=4 (9 stages of 6 between). Not with vpp."""
    last_stage_layers: int | None = None
    """Decoder layers on the last pipeline stage (megatron's num_layers_in_last_pipeline_stage; the stage that also
    holds the LM head and the loss); None: an equal share. See first_stage_layers."""

    @property
    def sequence_parallel(self) -> bool:
        return self.tp > 1

    @property
    def seq_multiple(self) -> int:
        """What padded sequence lengths are a multiple of: TP (sequence parallel) x 2*CP (zig-zag chunks)."""
        return self.tp * (2 * self.cp if self.cp > 1 else 1)

    def stage_layers(self, num_layers: int) -> list[int]:
        """Decoder layers per pipeline stage, as megatron builds them (first_stage_layers / last_stage_layers where
        set, the other stages an equal share); ConfigError naming the keys when they do not add up."""
        first, last, pp = self.first_stage_layers, self.last_stage_layers, self.pp
        if first is None and last is None:
            stages = pp * (self.vpp or 1)
            if num_layers % stages:
                raise ConfigError(f"parallel.pp*vpp={stages} does not divide num_hidden_layers={num_layers}")
            return [num_layers // pp] * pp
        keys = f"parallel.first_stage_layers={first} / last_stage_layers={last}"
        if pp == 1 or self.vpp:
            raise ConfigError(f"{keys}: need parallel.pp > 1 and no parallel.vpp")
        if min(n for n in (first, last) if n is not None) < 1:
            raise ConfigError(f"{keys}: a stage holds at least one layer")
        others = pp - (first is not None) - (last is not None)  # stages that share the rest equally
        rest = num_layers - (first or 0) - (last or 0)
        if not others and rest:
            raise ConfigError(f"{keys}: with parallel.pp=2 they add up to num_hidden_layers={num_layers}")
        if others and (rest % others or rest < others):
            raise ConfigError(
                f"{keys}: the other {others} of parallel.pp={pp} stages cannot share the remaining {rest} of "
                f"num_hidden_layers={num_layers} equally (at least one layer each)"
            )
        share = rest // others if others else 0
        return [share if first is None else first, *[share] * (pp - 2), share if last is None else last]

    def rank_layers(self, num_layers: int, moe_layers: Sequence[int] = ()) -> list[list[int]]:
        """The decoder layers each pipeline rank holds: a contiguous block of stage_layers, or with vpp the blocks
        v * pp + rank of num_layers / (pp * vpp) layers (megatron's interleaved order). With `moe_layers` (the MoE
        layers of an MoE model), ConfigError when a rank would hold none: its expert optimizer would hold no
        parameter and stay out of the expert gradient norm that the other stages reduce with it."""
        sizes = self.stage_layers(num_layers)
        if self.vpp:
            per = num_layers // (self.pp * self.vpp)
            ranks = [
                [i for v in range(self.vpp) for i in range((v * self.pp + r) * per, (v * self.pp + r + 1) * per)]
                for r in range(self.pp)
            ]
        else:
            starts = [sum(sizes[:r]) for r in range(self.pp)]
            ranks = [list(range(start, start + n)) for start, n in zip(starts, sizes, strict=True)]
        moe = set(moe_layers)
        for r, layers in enumerate(ranks):
            if moe and not moe & set(layers):
                held = f"layer {layers[0]}" if len(layers) == 1 else f"layers {layers[0]}..{layers[-1]}"
                raise ConfigError(
                    f"parallel: pipeline stage {r} would hold {held}, none of them MoE (MoE "
                    f"layers start at {min(moe)}); not supported: give it an MoE layer (parallel.first_stage_layers / "
                    "last_stage_layers)"
                )
        return ranks

    def data_parallel_size(self, world_size: int) -> int:
        model = self.tp * self.pp * self.cp
        if world_size % model:
            raise ValueError(
                f"parallel: world size {world_size} is not divisible by tp*pp*cp = {self.tp}*{self.pp}*{self.cp}"
            )
        dp = world_size // model
        if (dp * self.cp * self.tp) % (self.ep * self.etp):
            raise ValueError(
                f"parallel: ep*etp = {self.ep}*{self.etp} must divide dp*cp*tp = {dp}*{self.cp}*{self.tp}"
                f" (world {world_size}, pp {self.pp})"
            )
        return dp


@dataclass
class OptimizerOffloadConfig:
    """actor.optimizer_offload: megatron-core's CPU optimizer offload (its HybridDeviceOptimizer, built by
    get_megatron_optimizer with optimizer_cpu_offload): a share of the optimizer's fp32 master weights and Adam moments
    lives in host memory and is updated by the CPU, the fp32 gradients copied to the host for it and the updated
    parameters back. GPU only, with actor.distributed_optimizer=true."""

    fraction: float = 0.0
    """Share of this rank's optimizer states moved to host memory and updated on the CPU (megatron's
    optimizer_offload_fraction; slime's and NeMo-RL's offload): 0 = none (the optimizer on the GPU), 1 = all. The
    planner moves that share of the optimizer-state row to host memory (moe-rl-plan)."""
    overlap: bool = True
    """Overlap the CPU update with the gradients' copies to the host and the parameters' copies back, one CPU
    optimizer per parameter (megatron's overlap_cpu_optimizer_d2h_h2d; slime's --overlap-cpu-optimizer-d2h-h2d)."""

    def check(self) -> None:
        """This section's own rules (that it needs CUDA and the distributed optimizer is the config's)."""
        if not 0 <= self.fraction <= 1:
            refuse("actor.optimizer_offload.fraction", f"{self.fraction}: must be in [0, 1] (0 = off)")


LORA_TARGETS = ("all", "attention", "mlp", "experts", "shared_experts", "router")
LORA_ALL = ("attention", "mlp", "experts", "shared_experts")  # what `all` names: the router only when listed


def lora_kinds(targets: list[str]) -> set[str]:
    """The kinds of linear actor.lora.targets names (`all` expanded; the router only when listed itself)."""
    return (set(LORA_ALL) | set(targets)) - {"all"} if "all" in targets else set(targets)


class LoraWeightSync(StrEnum):
    """How a LoRA actor's weights reach the engines (actor.lora.weight_sync)."""

    merged = "merged"  # W + (alpha / r) B A of the adapted linears only; any engine
    adapter = "adapter"  # the adapters only, through vLLM's LoRA support: not built (see LoraConfig.weight_sync)


@dataclass
class LoraConfig:
    """actor.lora: low-rank adapters on the actor's linears, the base weights frozen (moe_rl/actor/lora.py).
    "LoRA Without Regret" (Thinking Machines, 2025): for RL, adapters on every layer including the MoE experts, at
    about 10x the full fine-tuning learning rate, match full RL even at small rank."""

    rank: int = 0
    """Adapter rank r; 0 = off (full training). Published MoE RL runs use 8-64 (32 for Qwen3-30B-A3B)."""
    alpha: float = 32.0
    """Scale numerator: an adapter adds (alpha / rank) B A x (PEFT's lora_alpha)."""
    dropout: float = 0.0
    """Dropout on an adapter's input in the update's passes (PEFT's lora_dropout); 0 for RL, where pi_theta of the
    first mini-batch should equal pi_old."""
    targets: list[str] = field(default_factory=lambda: ["all"])
    """Which linears get adapters: all | attention (linear_qkv / linear_proj; MLA's q and kv up-projections) | mlp
    (the dense layers' MLP) | experts (every routed expert's fc1/fc2) | shared_experts | router (each MoE layer's
    gate: logits + (alpha / r) B A x; with R3/R2 replay it moves the replayed experts' weights, not their choice).
    `all`: every kind but the router, which stays frozen unless listed ([all, router]); a kind named explicitly must
    exist in the model."""
    seed: int = 0
    """Seed of the adapters' A initialisation (drawn per global linear: the same in every parallel layout)."""
    weight_sync: LoraWeightSync = LoraWeightSync.merged
    """merged: the engines receive W + (alpha / r) B A of the adapted linears only (the others never change);
    adapter: the adapters alone through vLLM's LoRA layers — not built: vLLM 0.32's MoE LoRA (FusedMoEWithLoRA)
    runs Triton kernels only, so the CPU engine cannot serve expert adapters."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def check(self) -> None:
        """This section's own rules (what it cannot compose with is the config's)."""
        if self.rank < 0:
            refuse("actor.lora.rank", f"{self.rank}: must be >= 1 (or 0 for no LoRA)")
        if not self.enabled:
            return
        if not self.alpha > 0:
            refuse("actor.lora.alpha", f"{self.alpha}: must be > 0")
        if not 0 <= self.dropout < 1:
            refuse("actor.lora.dropout", f"{self.dropout}: must be in [0, 1)")
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        if unknown or not self.targets:
            refuse("actor.lora.targets", f"{list(self.targets)}: choose from {list(LORA_TARGETS)}")
        if self.weight_sync == "adapter":
            refuse(
                "actor.lora.weight_sync",
                "adapter: not built (vLLM 0.32 serves MoE expert adapters through Triton kernels only); use merged",
            )


COLLECTIVE_TIMEOUT_S = 600  # a collective that waits longer fails (torch's message names no rank)
