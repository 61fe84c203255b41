"""A Megatron-core MoE critic: the actor's architecture (and, by default, its initial weights) with the
output layer replaced by a scalar value head, its own optimizer and routing replay.

Values are aligned like log-probs: entry t of `values` is V(tokens < t), the value of the state in which
token t is sampled. The head is a plain fp32 Linear(hidden, 1) replicated over tensor-parallel ranks (they
see the same hidden states, gathered over sequence parallel, so they compute the same values and gradients;
data-parallel ranks sum its gradient like any dense weight). A fresh head starts at zero (V = 0).
"""

from __future__ import annotations

import torch

from moe_rl.actor.context_parallel import gather_sequence
from moe_rl.actor.forward import compute_logprobs
from moe_rl.actor.model import ModelOptions, load_model
from moe_rl.actor.optimizer import build_optimizer
from moe_rl.actor.replay import RouteReplay, rank_moe_layers, router_agreement
from moe_rl.actor.train_step import train_minibatch
from moe_rl.common.batch import PaddedBatch
from moe_rl.common.distributed import global_mean, loss_counts
from moe_rl.common.platform import resolved_model
from moe_rl.objectives.aggregation import masked_mean
from moe_rl.objectives.policy_loss import LossInputs
from moe_rl.objectives.value import masked_whiten, value_loss, value_stats


class ValueOutput(torch.nn.Module):
    """Stands in for GPTModel.output_layer on the last stage: [s, b, H] hidden states -> [s, b, 1] values."""

    def __init__(self, hidden_size: int, sequence_parallel: bool, tp_group):
        super().__init__()
        # `weight` / `bias` under the output layer's own names: megatron's checkpoint code expects them
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size))
        self.bias = torch.nn.Parameter(torch.zeros(1))
        self.sequence_parallel, self.tp_group = sequence_parallel, tp_group

    def forward(self, input_, weight=None, runtime_gather_output=None):  # GPTModel's output-layer call
        # heavy: megatron-core, imported on first use
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        if self.sequence_parallel:  # every TP rank computes the full values; the backward only splits
            input_ = gather_from_sequence_parallel_region(input_, False, group=self.tp_group)
        return torch.nn.functional.linear(input_.float(), self.weight, self.bias), None


class ValueHead:
    """The critic's per-token scores for moe_rl.actor.forward's passes (in place of LogprobHead): the value
    of each position that predicts a next token ([b, s-1])."""

    def __enter__(self) -> ValueHead:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def __call__(self, output: torch.Tensor, ids: torch.Tensor, with_entropy: bool = False, temperature: float = 1.0):
        return gather_sequence(output[..., 0])[:, :-1], None  # context parallel: this rank's positions, gathered


class Critic:
    def __init__(self, critic, model, parallel, actor, model_path: str):
        """Its sections of the config: `critic` (moe_rl.config.CriticConfig: learning rate, replay, value clip,
        mini-batches, epochs), `model` (ModelConfig: dtype, recompute, Transformer Engine), `parallel`
        (ParallelConfig) and `actor` (ActorConfig: weight decay, gradient clip, micro-batch size, as the
        actor's); `model_path`: an HF folder of the actor's architecture (its LM head is dropped). Call after
        `init_distributed`."""
        # heavy: megatron-core, imported on first use
        from megatron.core import parallel_state as ps

        router_replay = critic.router_replay
        if router_replay not in ("r2", "off"):
            raise ValueError(f"critic.router_replay={router_replay!r}: choose r2 (its own values pass) or off")
        self.cfg, self.critic_cfg, self.router_replay = actor, critic, router_replay
        model = resolved_model(model)  # its `auto` settings, as the actor's
        opts = ModelOptions(dtype=model.dtype, use_te=model.transformer_engine, recompute=model.recompute)
        m = load_model(model_path, parallel, opts)
        self.chunks, self.layout = m.chunks, m.layout
        for c in self.chunks:
            if getattr(c, "post_process", False):
                if c.share_embeddings_and_output_weights:
                    raise ValueError(f"{model_path}: a critic of a model with tied embeddings is not supported yet")
                old = c.output_layer
                c.output_layer = ValueOutput(
                    c.config.hidden_size, old.sequence_parallel, ps.get_tensor_model_parallel_group()
                )
        self.replay = (
            RouteReplay(self.chunks, rank_moe_layers(self.chunks, self.layout.moe_layers), verify="count")
            if router_replay == "r2"
            else None
        )
        self.optimizer = build_optimizer(self.chunks, critic.lr, actor.weight_decay, actor.grad_clip)

    def values(self, padded: PaddedBatch) -> dict[str, torch.Tensor]:
        """{"values": [B, T] V before token t (0 at column 0 and padding)} and, under R2, the "routes" this
        pass took (the update replays them). Available on every pipeline stage."""
        out = compute_logprobs(
            self.chunks,
            padded.input_ids,
            padded.attention_mask,
            self.cfg.micro_batch_size,
            with_entropy=False,
            replay=self.replay,
            record=self.replay is not None,
            head=ValueHead(),
        )
        return {"values": out.pop("logprobs"), **out}

    def train(
        self,
        padded: PaddedBatch,
        old: dict[str, torch.Tensor],
        returns: torch.Tensor,
        clip: float | None,
        mini_batches: int,
        agg: str = "token-mean",
    ) -> dict[str, float]:
        """`mini_batches` optimizer steps of the clipped value loss against `returns` ([B, T], 0 off the
        response), starting from the values pass `old` (its routes replayed under R2). Returns critic/*
        metrics (means over the mini-batches)."""
        b = padded.input_ids.shape[0]
        if b % mini_batches:
            raise ValueError(f"critic mini_batches={mini_batches} does not divide this rank's {b} samples")
        per, out, norms = b // mini_batches, {}, []
        all_counts = loss_counts([padded.loss_mask[i * per : (i + 1) * per] for i in range(mini_batches)])
        whole = LossInputs(
            input_ids=padded.input_ids,
            attention_mask=padded.attention_mask,
            mask=padded.loss_mask,
            old_values=old["values"],
            returns=returns,
            routes=old["routes"] if self.replay is not None else None,
        )

        def loss_fn(values, x: LossInputs):
            counts = {"num_tokens": x.num_tokens, "num_seqs": x.num_seqs}
            return value_loss(values, x.old_values, x.returns, x.mask, clip, agg, **counts)

        for i in range(mini_batches):
            batch = whole.rows(slice(i * per, (i + 1) * per), **all_counts[i])
            m = train_minibatch(
                self.chunks,
                self.optimizer,
                batch,
                loss_fn,
                self.cfg.micro_batch_size,
                self.replay,
                head=ValueHead(),
            )
            m.pop("skipped")
            norms.append(m.pop("actor/grad_norm"))
            for k, v in m.items():
                out[f"critic/{k}"] = out.get(f"critic/{k}", 0.0) + v / mini_batches
        out["critic/grad_norm"] = sum(norms) / len(norms)
        return out

    def update(self, padded: PaddedBatch, values: dict[str, torch.Tensor], returns: torch.Tensor) -> dict[str, float]:
        """The critic's epochs on this batch (critic.epochs x critic.mini_batches optimizer steps), and its
        metrics: the values before the update against the returns (critic/explained_variance, values_mean,
        returns_mean; over the global batch), the update's loss, clip fraction and gradient norm (means over the
        epochs), and its routing (the replay check against its own values pass, and agreement with the engine's
        routes)."""
        c = self.critic_cfg
        stats = value_stats(values["values"], returns, padded.loss_mask, reduce=global_mean)
        out = {f"critic/{k}": v for k, v in stats.items()}
        if self.replay is not None:
            self.replay.dispatch_check(reset=True)
        epochs = [self.train(padded, values, returns, c.value_clip, c.mini_batches) for _ in range(c.epochs)]
        for k in epochs[0]:
            if k not in out:
                out[k] = sum(e[k] for e in epochs) / len(epochs)
        if self.replay is not None:
            checked, mismatched = self.replay.dispatch_check()
            out["critic/replay_mismatches"] = float(mismatched)
            out["critic/router_agreement"] = 1 - mismatched / checked if checked else 1.0
            if padded.routes is not None:
                out["critic/engine_router_agreement"] = router_agreement(self.replay, padded, values["routes"])
        return out


def gae_targets(
    objective, rewards: torch.Tensor, mask: torch.Tensor, values: torch.Tensor, whiten: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), [B, T], of the objective's value-based estimator (algorithm.advantage=gae: GAE over
    each response with algorithm.gamma and lam), the advantages whitened over the global batch when `whiten`
    (algorithm.whiten_advantages). Collective when whitening."""
    advantages, returns = objective.token_advantages(rewards, mask, values)
    if whiten:
        n = {"x": float(mask.sum())}
        mean = global_mean({"x": float(masked_mean(advantages, mask))}, n)["x"]
        var = global_mean({"x": float(masked_mean((advantages - mean) ** 2, mask))}, n)["x"]
        advantages = masked_whiten(advantages, mask, mean, var)
    return advantages, returns
