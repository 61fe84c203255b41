"""Diagnostics taken inside a training step, before the update changes the actor: rollout dumps
(for moe-rl-diagnose and trainer.mode=from_dump), the router agreement metric and, from the same two passes, the
mismatch with and without the engine's routes."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from moe_rl.actor.forward import routing_views
from moe_rl.actor.replay import router_agreement
from moe_rl.common.batch import ProxPolicy
from moe_rl.common.distributed import all_gather_objects, global_sums
from moe_rl.objectives.metrics import mismatch_sums
from moe_rl.rollout import dump
from moe_rl.routing.layout import layer_columns


class StepDiagnostics:
    def __init__(self, actor, dump_dir: Path, dump_every: int, agreement_every: int, dump_meta: dict):
        """`actor`: moe_rl.actor.actor.Actor; `dump_every`: write a dump of every this many steps (0: none;
        trainer.dump_every, 1 under trainer.mode=rollout_only); `agreement_every`: log router/agreement on step 1
        and every this many steps (logging.router_agreement_every; 0: never); `dump_meta`: what each dump records
        of the run (actor_dtype, rollout_dtype, n)."""
        self.actor, self.dump_dir, self.dump_meta = actor, dump_dir, dump_meta
        self.dump_every = dump_every
        self.agreement_every = agreement_every if actor.replay is not None else 0

    @property
    def dumping(self) -> bool:
        return self.dump_every > 0

    def begin_step(self) -> None:
        if self.actor.replay is not None:
            self.actor.replay.dispatch_check(reset=True)

    def __call__(self, step: int, rollout, old: ProxPolicy, rewards: torch.Tensor) -> dict[str, float]:
        """Dump and/or measure this step (0-based index) when due; returns the metrics taken."""
        padded = rollout.padded
        dump_now = self.dumping and step % self.dump_every == 0
        agree_now = bool(self.agreement_every) and padded.routes is not None and step % self.agreement_every == 0
        if not (dump_now or agree_now):
            return {}
        views = self.routing_views(padded, old)
        metrics = {}
        if agree_now:
            metrics["router/agreement"] = self.router_agreement(padded, views["routes_live"])
            metrics |= routing_k3(views, padded)
        if dump_now:
            self.write_dump(step, padded, rewards, views, rollout)
        return metrics

    def routing_views(self, padded, old: ProxPolicy) -> dict[str, torch.Tensor | None]:
        a = self.actor
        return routing_views(
            a.chunks,
            padded.input_ids,
            padded.attention_mask,
            a.cfg.micro_batch_size,
            a.replay,
            padded.routes,
            # the old-log-prob pass is one of the two views: it replayed the engine's routes (r3; no such pass
            # under prox_logp=loglinear), or it ran on the actor's own routing and recorded them (r2)
            replayed=old.logprobs if a.replayed_routes(padded) is not None else None,
            live={"logprobs": old.logprobs, "routes": old.routes} if a.records_routes else None,
            fused=a.fused_logprob,
            pack=a.pack_plan(padded),
        )

    def router_agreement(self, padded, live_routes: torch.Tensor) -> float:
        """Fraction of (token, MoE layer) pairs where the actor's own routing picks the same expert
        set as the rollout engine (this rank's layers; real tokens except the last)."""
        return router_agreement(self.actor.replay, padded, live_routes)

    def write_dump(self, step: int, padded, rewards, views, rollout=None) -> None:
        """This rank's dump of the step (`rollout`: the samples' versions and turns, when there are any)."""
        a = self.actor
        # every rank's dump holds its samples' routes in full: the route holder of each tensor/context-parallel
        # group sends them to the others (collective over that group), and every MoE layer's: each pipeline
        # stage has its own layers' (collective over PP)
        layers, moe_layers, share = a.route_layers, a.layout.moe_layers, a.replay.share
        routes = share.from_holder(lambda: padded.routes)
        padded = replace(padded, routes=all_layers(routes, layers, moe_layers))
        if views.get("routes_live") is not None:
            live = share.from_holder(lambda: views["routes_live"])
            views = {**views, "routes_live": all_layers(live, layers, moe_layers)}
        dump.write_rank(
            self.dump_dir,
            step,
            padded,
            views,
            a.replay.dispatch_check(),
            model_path=a.model_path,
            model=dump.model_fingerprint(a.hf_config, a.layout),
            actor_dtype=self.dump_meta["actor_dtype"],
            rollout_dtype=self.dump_meta["rollout_dtype"],
            router_replay=a.cfg.router_replay,
            n=self.dump_meta["n"],
            rewards=rewards,
            policy_version=None if rollout is None else rollout.policy_version,
            turn_index=None if rollout is None else rollout.turn_index,
            versions=None if rollout is None else rollout.versions,
        )


def routing_k3(views: dict[str, torch.Tensor | None], padded) -> dict[str, float]:
    """k3 KL of the response tokens against mu two ways, over the data-parallel ranks' tokens as mismatch/k3_kl is:
    with the actor's own routing (router/k3_kl_own_routing) and with the engine's routes replayed
    (router/k3_kl_engine_routes), whatever actor.router_replay trains with. Their difference is what replay removes
    in this run. Collective over the data- and context-parallel ranks."""
    views_by_name = {"own_routing": views["logprobs_live"], "engine_routes": views["logprobs_replay"]}
    passes = {name: lp for name, lp in views_by_name.items() if lp is not None}
    local = []
    for lp in passes.values():
        sums, _ = mismatch_sums(lp, padded.rollout_logprobs, padded.loss_mask)
        local += [float(sums["k3_kl"]), float(sums["tokens"])]
    total = global_sums(local)
    return {f"router/k3_kl_{name}": total[2 * i] / max(total[2 * i + 1], 1.0) for i, name in enumerate(passes)}


def all_layers(routes: torch.Tensor | None, layers: list[int], moe_layers: list[int]) -> torch.Tensor | None:
    """`[B, T, len(layers), K]` routes of this pipeline stage's MoE `layers` -> every MoE layer's, gathered from
    the other stages (which hold the same samples). Collective over the pipeline group unless it has one stage."""
    # heavy: megatron-core, imported on first use
    from megatron.core import parallel_state as ps

    if routes is None or list(layers) == list(moe_layers):
        return routes
    out = torch.empty((*routes.shape[:2], len(moe_layers), routes.shape[3]), dtype=routes.dtype)
    for stage_layers, part in all_gather_objects((list(layers), routes), ps.get_pipeline_model_parallel_group()):
        out[:, :, layer_columns(stage_layers, moe_layers)] = part
    return out
