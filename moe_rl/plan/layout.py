"""The training config the plan is for: the trainer's own TrainConfig with the command line's overrides, refused
by the trainer's own checks (moe_rl.config.check_overrides and validate) and by the model-dependent ones
(moe_rl.actor.model.check_sizes_divide, on the ModelSpec's sizes)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe_rl.common.errors import ConfigError
from moe_rl.common.machine import CUDA_WITH_TE, resolve
from moe_rl.common.platform import as_on_cuda
from moe_rl.config import TrainConfig
from moe_rl.config.describe import check_overrides
from moe_rl.config.store import GROUPS, register_configs
from moe_rl.config.validate import validate
from moe_rl.plan.spec import ModelSpec

GPUS_PER_NODE = 8  # an engine's workers share one node: its leader's


@dataclass(frozen=True)
class Layout:
    """Where the ranks go: the actor's layout on `gpus` GPUs and the rollout engines'."""

    gpus: int
    tp: int
    pp: int
    vpp: int | None
    cp: int
    ep: int
    etp: int
    dp: int
    engines: int
    engine_tp: int
    first_stage_layers: int | None = None  # parallel.first_stage_layers / last_stage_layers (None: equal stages)
    last_stage_layers: int | None = None
    assumed: frozenset[str] = frozenset()  # moe_rl.plan.assume: what-if features the plan rests on

    @property
    def expert_dp(self) -> int:
        """Expert-data-parallel size: the ranks an expert's parameters are replicated over (megatron: world /
        (pp x ep x etp)); the distributed optimizer shards expert states over them."""
        return self.gpus // (self.pp * self.ep * self.etp)

    def describe(self) -> str:
        vpp = f" vpp={self.vpp}" if self.vpp else ""
        for key in ("first_stage_layers", "last_stage_layers"):  # uneven stages, as the trainer's keys
            vpp += f" {key}={getattr(self, key)}" if getattr(self, key) else ""
        return (
            f"{self.gpus} GPUs: tp={self.tp} pp={self.pp}{vpp} cp={self.cp} ep={self.ep} etp={self.etp} dp={self.dp}; "
            f"{self.engines} engine(s) x tp={self.engine_tp}"
        )

    def as_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "assumed"}
        return out | {"expert_dp": self.expert_dp, "assumed": sorted(self.assumed)}


def build_config(overrides: list[str], config: str | None = None) -> Any:
    """The trainer's TrainConfig (its defaults, the Python default algorithm GSPO + IcePop) with Hydra-style
    `key=value` overrides merged onto its OmegaConf structured schema (unknown keys and wrong types refused as
    the trainer refuses them). `algorithm/loss=<name>` and `algorithm/correction=<name>` pick registered options.
    `config`: a yaml of conf/ (a recipe), composed as `launch/train_moe.py --config-name` composes it, the overrides
    on top. The `auto` settings are resolved as on a CUDA machine with Transformer Engine (what a plan is for)."""
    cfg = compose_file(config, overrides) if config else _build_config(overrides)
    resolve(cfg, CUDA_WITH_TE)
    return cfg


def compose_file(config: str, overrides: list[str]) -> Any:
    """The TrainConfig that `launch/train_moe.py --config-name <config> <overrides>` runs with: Hydra's composition
    of the yaml (its defaults list, `train_moe` and the algorithm group included) from the conf/ folder it is in."""
    # heavy: hydra's compose API and omegaconf, imported on first use
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    path = Path(config).resolve()
    root = next((d for d in path.parents if (d / "train_moe.yaml").is_file()), None)
    if not path.is_file() or root is None:
        raise ConfigError(f"--config {config}: not a yaml file under a conf/ folder (one holding train_moe.yaml)")
    check_overrides(overrides)
    register_configs()
    name = path.relative_to(root).with_suffix("").as_posix()
    try:
        with initialize_config_dir(config_dir=str(root), version_base="1.3"):
            return OmegaConf.to_object(compose(config_name=name, overrides=overrides))
    except (OmegaConfBaseException, HydraException) as e:
        raise ConfigError(f"{config}: {e}".splitlines()[0]) from e


def _build_config(overrides: list[str]) -> Any:
    # heavy: hydra's override grammar and omegaconf, imported on first use
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    check_overrides(overrides)
    groups = [o for o in overrides if "/" in o.split("=", 1)[0]]
    cfg = TrainConfig()
    for item in groups:
        group, name = item.split("=", 1)
        if group not in GROUPS:
            raise ConfigError(f"config: {group} is not a config group here; choose from {sorted(GROUPS)}")
        options = GROUPS[group].configs()
        if name not in options:
            raise ConfigError(f"config {group}={name!r}: choose one of {sorted(options)}")
        setattr(cfg.algorithm, group.split("/")[1], options[name]())
    schema = OmegaConf.structured(cfg)
    try:  # values as Hydra reads them on the trainer's command line (off is a string there, not YAML's false)
        for o in OverridesParser.create().parse_overrides([o for o in overrides if o not in groups]):
            OmegaConf.update(schema, o.key_or_group, o.value(), merge=True)
        return OmegaConf.to_object(schema)
    except (OmegaConfBaseException, HydraException) as e:
        raise ConfigError(f"config: {e}".splitlines()[0]) from e


def check_model_layout(spec: ModelSpec, parallel: Any, engine_tp: int) -> None:
    """What the trainer's moe_rl.actor.model.check_divisibility refuses, plus the engine's vLLM rule."""
    # heavy: the actor's model module (torch, megatron-core), imported on first use
    from moe_rl.actor.model import check_sizes_divide

    s = spec
    check_sizes_divide(parallel, s.num_heads, s.num_kv_heads, s.num_experts, s.moe_ffn, s.num_layers, s.moe_layers)
    if spec.num_heads % engine_tp:  # vLLM: "Total number of attention heads must be divisible by tensor parallel size"
        raise ConfigError(
            f"config rollout.tensor_parallel_size: {engine_tp} does not divide num_attention_heads={spec.num_heads}"
        )


def check(cfg: Any, spec: ModelSpec, gpus: int, assumed: frozenset[str] = frozenset()) -> Layout:
    """The trainer's validation of `cfg` on `gpus` ranks (as on GPUs) and the model's divisibility, less what the
    what-if features `assumed` (moe_rl.plan.assume) lift; the Layout."""
    if gpus < 1:
        raise ConfigError(f"--gpus {gpus}: must be >= 1")
    with as_on_cuda():
        validate(cfg, gpus)
    check_model_layout(spec, cfg.parallel, cfg.rollout.tensor_parallel_size)
    if cfg.rollout.tensor_parallel_size > GPUS_PER_NODE and "engine-across-nodes" not in assumed:
        raise ConfigError(
            f"config rollout.tensor_parallel_size: {cfg.rollout.tensor_parallel_size} GPUs: an engine's workers share "
            f"their leader's node ({GPUS_PER_NODE} GPUs); --assume engine-across-nodes plans as if they did not"
        )
    if cfg.algorithm.advantage == "gae" and spec.tie_embeddings:  # moe_rl.critic.Critic refuses it when built
        raise ConfigError(f"{spec.name}: a critic of a model with tied embeddings is not supported yet")
    return layout_of(cfg, gpus, assumed)


def layout_of(cfg: Any, gpus: int, assumed: frozenset[str] = frozenset()) -> Layout:
    """The Layout of an already validated `cfg` on `gpus` ranks."""
    p, r = cfg.parallel, cfg.rollout
    dp = p.data_parallel_size(gpus)
    engines = r.engines or dp
    spacing = gpus // (engines * p.pp)  # leaders: the first rank of each engine's data-parallel ranks, on PP stage 0
    if r.tensor_parallel_size > spacing:
        raise ConfigError(
            f"config rollout.tensor_parallel_size: {r.tensor_parallel_size} GPUs per engine overlap the next engine: "
            f"{engines} engine(s) lead every {spacing} GPU(s) of PP stage 0 (an engine's workers take its leader's GPU "
            "and the ones after it); use fewer rollout.engines or a smaller engine TP"
        )
    ends = (p.first_stage_layers, p.last_stage_layers)
    return Layout(gpus, p.tp, p.pp, p.vpp, p.cp, p.ep, p.etp, dp, engines, r.tensor_parallel_size, *ends, assumed)
