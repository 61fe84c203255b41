"""The Megatron actor as one part of the RL loop: its model chunks, HF converter, optimizer and
replay hooks, built from the config; old log-probs, the policy update, checkpoint state and
the HF-named weights the rollout engine receives."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from moe_rl.actor import batch_invariant as bik
from moe_rl.actor import lora, packing
from moe_rl.actor.context_parallel import cp_size, seq_multiple
from moe_rl.actor.engine_ops import EngineOpForward, check_machine
from moe_rl.actor.forward import broadcast_from_last_stage, compute_logprobs
from moe_rl.actor.model import ModelOptions, load_model
from moe_rl.actor.optimizer import build_actor_optimizer
from moe_rl.actor.packing import check_packing_supported
from moe_rl.actor.replay import RouteReplay, rank_moe_layers
from moe_rl.actor.train_step import all_finite, train_minibatch
from moe_rl.actor.weights import full_hf_state_dict
from moe_rl.common.batch import PaddedBatch, ProxPolicy
from moe_rl.common.distributed import global_mean, global_sums, loss_counts
from moe_rl.common.platform import resolved_model
from moe_rl.objectives.policy_loss import LossInputs
from moe_rl.objectives.sft import nll_loss
from moe_rl.routing.records import route_dtype


class Actor:
    def __init__(
        self,
        actor,
        model,
        parallel,
        model_path: str,
        *,
        record_routes: bool,
        reference: bool = False,
        true_on_policy: bool = False,
    ):
        """Its sections of the config: `actor` (moe_rl.config.ActorConfig), `model` (ModelConfig: dtype, recompute,
        Transformer Engine), `parallel` (ParallelConfig). `record_routes`: bind replay hooks even with
        actor.router_replay=off (the dumps' live routes need them); `reference`: keep the initial weights frozen
        as the reference policy (algorithm.kl_coef > 0); `true_on_policy`: trainer.true_on_policy. Call after
        `init_distributed`."""
        a, model = actor, resolved_model(model)
        self.cfg, self.model_path = a, model_path
        self.version = 0  # optimizer updates so far (the engine-op pass reloads its weights when this moves)
        # trainer.true_on_policy: on CPU the engine's own ops (engine_ops), on GPU batch-invariant kernels
        batch_invariant = true_on_policy and torch.cuda.is_available()
        opts = ModelOptions(
            dtype=model.dtype,
            use_te=model.transformer_engine,
            recompute=model.recompute,
            expert_bias_update_rate=a.expert_bias_update_rate,
            batch_invariant=batch_invariant,
        )
        # log-prob values as the engine computes them (full-vocabulary log_softmax) under the GPU mode
        self.fused_logprob = False if batch_invariant else a.fused_logprob
        m = load_model(model_path, parallel, opts)
        self.chunks, self.conv, self.hf_config, self.layout = m.chunks, m.conv, m.hf_config, m.layout
        # actor.lora: adapters on the targeted linears, everything else frozen (the optimizer holds the adapters only)
        self.lora = lora.attach(self.chunks, a.lora) if a.lora.enabled else []
        wants_replay = a.router_replay != "off" or record_routes
        self.route_layers = rank_moe_layers(self.chunks, self.layout.moe_layers)  # this PP stage's route columns
        self.replay = RouteReplay(self.chunks, self.route_layers, verify="count") if wants_replay else None
        # GPU, actor.distributed_optimizer: megatron's DDP wrappers of the chunks (else None)
        self.ddp, self.optimizer = build_actor_optimizer(self.chunks, a)
        self.max_tokens = a.max_tokens_per_micro_batch if a.packing else None  # token budget of a packed forward
        self.thd = opts.use_te  # packed rows as THD sequences through Transformer Engine (GPU)
        self._plan: tuple[torch.Tensor, object] | None = None  # (the attention mask it was made for, the plan)
        # algorithm.prox_logp=loglinear: {"logprobs", "entropy"} [B, T] of the last update's own forward (train)
        self.update_policy: ProxPolicy | None = None
        if a.packing:
            check_packing_supported(self.chunks[0].config)
        # The reference policy for the KL term: the initial (HF) weights, frozen, in the same layout.
        self.reference = reference_policy(self, model_path, model, parallel, opts) if reference else None
        self.exact = None  # trainer.true_on_policy on CPU: the forward through the engine's own ops
        if batch_invariant:
            bik.enable()
        elif true_on_policy:
            check_machine(getattr(torch, model.dtype))
            self.exact = EngineOpForward(self.hf_config, getattr(torch, model.dtype))
        if a.packing and parallel.pp > 1 and not (parallel.vpp or 1) > 1:
            variable_lengths(self.chunks + (self.reference[0] if self.reference else []))

    @property
    def exact_logprobs(self) -> bool:
        """Whether log pi_old comes from the engine's own ops, bit for bit mu (trainer.true_on_policy on CPU)."""
        return self.exact is not None

    def replay_metrics(self) -> dict[str, float]:
        """router/replay_checked and router/replay_mismatches over every rank: the replay check of every position
        the passes since the step began replayed ({} without replay hooks). Collective."""
        if self.replay is None:
            return {}
        counts = torch.tensor(self.replay.dispatch_check(), dtype=torch.long)
        dist.all_reduce(counts)
        checked, mismatched = map(float, counts.tolist())
        return {"router/replay_checked": checked, "router/replay_mismatches": mismatched}

    # ---- passes ----------------------------------------------------------------------------
    def old_logprobs(self, padded: PaddedBatch) -> ProxPolicy:
        """log pi_old and entropy per token (and, under R2, the routes this pass took)."""
        if self.exact is not None:
            return ProxPolicy(**self._engine_op_logprobs(padded))
        routes, record = self.replayed_routes(padded), self.records_routes
        return ProxPolicy(
            **self._logprobs(self.chunks, self.replay, padded, with_entropy=True, routes=routes, record=record)
        )

    def _engine_op_logprobs(self, padded: PaddedBatch) -> dict[str, torch.Tensor]:
        """trainer.true_on_policy: log pi_old and entropy through the engine's ops on the current weights (the
        engine's routes replayed under R3; under R2 and off the engine's own routing, which these ops reproduce,
        recorded for R2's update). Collective when the weights changed (they are gathered)."""
        if self.exact.version != self.version:
            self.exact.load(full_hf_state_dict(self.chunks, self.conv), self.version)
        out = self.exact.logprobs(padded.input_ids, padded.attention_mask, self.replayed_routes(padded))
        routes = out.pop("routes")
        if self.records_routes:  # in the route record's dtype, as a recording pass returns them
            out["routes"] = torch.from_numpy(routes.numpy().astype(route_dtype(self.layout.num_experts)))
        return out

    def ref_logprobs(self, padded: PaddedBatch, old: ProxPolicy) -> torch.Tensor:
        """log pi_ref per token, routed like pi_old and pi_theta: the engine's routes (R3) or the old pass's
        (R2) replayed, so the KL measures how the weights moved on the same expert paths, not routing noise."""
        chunks, replay = self.reference
        routes = self.replayed_routes(padded, old)
        with lora.adapters_off(chunks if self.lora else []):
            return self._logprobs(chunks, replay, padded, with_entropy=False, routes=routes)["logprobs"]

    def replayed_routes(self, padded: PaddedBatch, old: ProxPolicy | None = None) -> torch.Tensor | None:
        """The routes a pass replays (actor.router_replay), the one place that says so: the engine's (r3); under r2
        the ones the old-log-prob pass recorded (`old`; that pass itself replays none and records them,
        `records_routes`); none (off)."""
        if self.cfg.router_replay == "r3":
            return padded.routes
        return old.routes if self.records_routes and old is not None else None

    @property
    def records_routes(self) -> bool:
        """Whether the old-log-prob pass records the routes the later passes replay (r2)."""
        return self.cfg.router_replay == "r2"

    def _logprobs(self, chunks, replay, padded: PaddedBatch, **kw) -> dict[str, torch.Tensor]:
        args = (padded.input_ids, padded.attention_mask, self.cfg.micro_batch_size)
        kw |= {"fused": self.fused_logprob, "replay": replay, "pack": self.pack_plan(padded)}
        return compute_logprobs(chunks, *args, **kw)

    def pack_plan(self, padded: PaddedBatch):
        """The bins of this batch under actor.packing (None when off): within each mini-batch, so every
        pass of the step (old, reference, diagnostics, update) runs each sample in the same bin at the
        same row length. Planned once per batch (its attention mask, which every pass of a step shares, is the
        key; every rank passes the same batches in the same order): planning is collective (two all-reduces)."""
        # heavy: megatron-core, imported on first use
        from megatron.core import parallel_state as ps

        if self.max_tokens is None:
            return None
        if self._plan is not None and self._plan[0] is padded.attention_mask:
            return self._plan[1]
        lengths = padded.attention_mask.sum(-1).tolist()
        interleaved = (ps.get_virtual_pipeline_model_parallel_world_size() or 1) > 1
        plan = packing.plan_packing(
            lengths,
            self.max_tokens,
            self.cfg.mini_batches,
            seq_multiple(),
            one_length=interleaved,  # see __init__: variable lengths only under the plain pipeline schedule
            # ranks that exchange tokens with each other inside a forward: expert (and expert-tensor) parallel
            agree=ps.get_expert_tensor_and_model_parallel_group(),
            count_agree=dist.group.WORLD,  # every rank runs as many forwards
            # the interleaved schedule runs micro-batches in groups of the pipeline size
            count_multiple=ps.get_pipeline_model_parallel_world_size() if interleaved else 1,
            thd=self.thd,
        )
        self._plan = padded.attention_mask, plan
        return plan

    def train(
        self,
        padded: PaddedBatch,
        old: ProxPolicy,
        advantages: torch.Tensor,
        objective,
        on_skip: Callable[[bool, int], bool],
        ref_logprobs: torch.Tensor | None = None,
    ) -> dict[str, float]:
        """`actor.mini_batches` optimizer steps on the batch with the objective's correction and
        loss; routes replayed per actor.router_replay. `on_skip(skipped, mini_batch)` -> whether
        the mini-batch counts as skipped (it may raise to stop the run). `ref_logprobs`: log pi_ref
        for the objective's KL (metric actor/kl_ref).

        `old`: pi_prox, the old-log-prob pass's, or under algorithm.prox_logp=loglinear only its `alpha`
        (objectives/proximal.py): pi_prox and the correction are then formed inside the loss, and the update's
        own forward's log-probs and entropy (pi_theta as each sample's mini-batch met it: pi_prox exactly for the
        first) are kept in `self.update_policy` for the step's mismatch and entropy metrics. Nothing the caller
        passed is changed."""
        a = self.cfg
        b = padded.input_ids.shape[0]
        if b % a.mini_batches:
            raise ValueError(f"actor.mini_batches={a.mini_batches} does not divide this rank's {b} samples")
        per = b // a.mini_batches
        plan = self.pack_plan(padded)  # the bins of the old-log-prob pass
        batch, metrics, weights = objective.loss_inputs(padded, old, advantages, ref_logprobs)
        batch.routes = self.replayed_routes(padded, old)
        # correction metrics: token means, or sequence shares (`*_seq_*`), over the data-parallel ranks
        out = global_mean(metrics, weights) | {"actor/skipped_steps": 0.0}
        keep = {k: torch.zeros(padded.loss_mask.shape) for k in ("logprobs", "entropy")} if old.interpolated else None
        results, norms = [], []
        # every mini-batch's loss normalisers, in one all-reduce
        for i, counts in enumerate(loss_counts([batch.mask[i * per : (i + 1) * per] for i in range(a.mini_batches)])):
            rows = slice(i * per, (i + 1) * per)
            x = batch.rows(rows, **counts)
            if self.exact is not None and i == 0:  # pi_theta == pi_old here: the engine-op values, bit for bit
                x.exact_logp = old.logprobs[rows]
            m = train_minibatch(
                self.chunks,
                self.optimizer,
                x,
                objective.loss,
                a.micro_batch_size,
                self.replay if x.routes is not None else None,
                self.fused_logprob,
                with_entropy=old.interpolated or objective.entropy_coef > 0,
                pack=None if plan is None else plan.group(i, i * per),
                ddp=self.ddp,
                keep=None if keep is None else {k: v[rows] for k, v in keep.items()},
            )
            if on_skip(bool(m.pop("skipped")), i):
                out["actor/skipped_steps"] += 1
            norms.append(m.pop("actor/grad_norm"))
            results.append(m)
        self.version += 1
        self.update_policy = None
        if keep is not None:
            keep = {k: broadcast_from_last_stage(t) for k, t in keep.items()}
            self.update_policy = ProxPolicy(alpha=old.alpha, **keep)
        return out | update_metrics(results, norms) | self._pass_shape(padded, plan)

    def supervised_step(self, padded: PaddedBatch) -> dict[str, float]:
        """Supervised fine-tuning: one optimizer step of next-token cross-entropy on `padded.loss_mask`'s tokens,
        the token mean over every data-parallel rank's batch (objectives/sft.py); the actor routes live. Returns
        sft/loss (that mean, before the step), actor/grad_norm, actor/skipped_steps and the pass's shape."""
        plan = self.pack_plan(padded)
        (counts,) = loss_counts([padded.loss_mask])
        batch = LossInputs(input_ids=padded.input_ids, attention_mask=padded.attention_mask, mask=padded.loss_mask)
        m = train_minibatch(
            self.chunks,
            self.optimizer,
            batch.rows(slice(None), **counts),
            nll_loss,
            self.cfg.micro_batch_size,
            fused_logprob=self.fused_logprob,
            pack=plan,
            ddp=self.ddp,
        )
        self.version += 1
        out = {"sft/loss": m.get("nll", 0.0), "actor/grad_norm": m["actor/grad_norm"]}
        out["actor/skipped_steps"] = m["skipped"]
        return out | self._pass_shape(padded, plan)

    @torch.no_grad()
    def nll(self, padded: PaddedBatch) -> float:
        """Token-mean next-token cross-entropy on `padded.loss_mask`'s tokens over every data-parallel rank's batch
        (validation loss). Collective."""
        logp = self._logprobs(self.chunks, None, padded, with_entropy=False)["logprobs"]
        mask = padded.loss_mask.to(logp.dtype)
        total, tokens = global_sums([float(-(logp * mask).sum()), float(mask.sum())])
        return total / max(tokens, 1.0)

    def _pass_shape(self, padded: PaddedBatch, plan) -> dict[str, float]:
        """What the update computed: perf/micro_batches (forwards on a rank), perf/padding_fraction
        (share of computed positions that are padding, over every data-parallel rank) and perf/tokens
        (real tokens over the data-parallel ranks; the trainer turns it into perf/tokens_per_s)."""
        b, t = padded.input_ids.shape
        if plan is None:
            per = b // self.cfg.mini_batches
            mbs = self.cfg.mini_batches * -(-per // self.cfg.micro_batch_size)
            positions = b * (t + (-t) % seq_multiple())
        else:
            mbs, positions = len(plan.bins), sum(plan.seq_lens)
        tokens, positions = global_sums([float(padded.attention_mask.sum()), float(positions)])
        return {
            "perf/micro_batches": float(mbs),
            "perf/padding_fraction": 1.0 - tokens / positions,
            "perf/tokens": tokens / cp_size(),  # context-parallel ranks share their samples
        }

    # ---- state -----------------------------------------------------------------------------
    def weights_finite(self) -> bool:
        return all_finite([p for c in self.chunks for p in c.parameters()])


def update_metrics(results: list[dict[str, float]], norms: list[float]) -> dict[str, float]:
    """The update's actor/* metrics from each mini-batch's loss metrics and gradient norm: means over the
    mini-batches; the first's (pi_theta == pi_old, and on the first step pi_ref) and the last's (the stalest: pi_theta
    has moved mini_batches - 1 optimizer steps) ppo_kl; the mean of the finite gradient norms (the steps taken)."""
    out = {"actor/first_minibatch_ppo_kl": results[0].get("ppo_kl", 0.0)}
    if "kl_ref" in results[0]:
        out["actor/first_minibatch_kl_ref"] = results[0]["kl_ref"]
    if len(results) > 1:
        out["actor/last_minibatch_ppo_kl"] = results[-1].get("ppo_kl", 0.0)
    for m in results:
        for k, v in m.items():
            key = k if "/" in k else f"actor/{k}"
            out[key] = out.get(key, 0.0) + v / len(results)
    applied = [x for x in norms if math.isfinite(x)]
    out["actor/grad_norm"] = sum(applied) / len(applied) if applied else float("nan")
    return out


def reference_policy(actor: Actor, model_path: str, model, parallel, opts: ModelOptions) -> tuple:
    """(chunks, RouteReplay or None) of the actor's reference policy: a frozen copy of the initial weights
    (`reference_model`), or under actor.lora the actor itself, whose base weights are the initial policy
    (`Actor.ref_logprobs` turns its adapters off)."""
    replay = actor.cfg.router_replay != "off"
    if actor.lora:
        return actor.chunks, actor.replay if replay else None
    return reference_model(model_path, actor.route_layers, replay, model, parallel, opts)


def reference_model(model_path: str, route_layers: list[int], replay: bool, model, parallel, opts: ModelOptions):
    """The frozen initial weights at `model_path` in this layout, with their replay hooks when `replay`
    (actor.router_replay is not off): (chunks, RouteReplay or None)."""
    ref_opts = ModelOptions(dtype=model.dtype, use_te=opts.use_te, batch_invariant=opts.batch_invariant)
    ref = load_model(model_path, parallel, ref_opts).chunks
    for c in ref:
        c.requires_grad_(False)
    hooks = RouteReplay(ref, route_layers, verify="count") if replay else None
    return ref, hooks


def variable_lengths(chunks: list) -> None:
    """Packed rows have their own lengths: pipeline stages send shapes first. (Megatron refuses this flag with the
    allgather dispatcher at construction; plan_packing gives the ranks that dispatch together equal row lengths, which
    is what that dispatcher needs.) Under the interleaved schedule the shape exchange hung here (gloo, PP=2: the
    previous and next stage are one rank), so there every bin gets one length instead (pack_plan)."""
    for c in chunks:
        c.config.variable_seq_lengths = True
