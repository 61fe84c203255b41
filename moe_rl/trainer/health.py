"""Step-level health: warnings from the logged metrics, and the guard against repeated
non-finite updates."""

from __future__ import annotations

import math
import statistics

from moe_rl.common.distributed import all_gather_objects

# Thresholds practitioners watch (verl / slime rollout-correction guides).
HEALTH = (
    ("mismatch/kl", lambda v: abs(v) > 0.1, "|KL(mu || pi_old)| > 0.1"),
    ("mismatch/chi2_token", lambda v: v > 1.0, "token chi^2 > 1"),
    ("mismatch/ess", lambda v: v < 0.3, "effective sample size < 0.3"),
    ("mismatch/log_ppl_abs_diff", lambda v: v > 0.1, "|log-ppl diff| > 0.1"),
)


def health_warnings(metrics: dict[str, float], first_minibatch_tolerance: float | None) -> list[str]:
    """`first_minibatch_tolerance` None: pi_old is not a recompute of the weights being trained (A-3PO's
    interpolated pi_prox), so pi_theta / pi_old on the first mini-batch checks nothing and is not warned about."""
    out = []
    kl0 = metrics.get("actor/first_minibatch_ppo_kl")
    if kl0 is not None and first_minibatch_tolerance is not None and abs(kl0) > first_minibatch_tolerance:
        out.append(
            f"pi_theta != pi_old on the first mini-batch (ppo_kl {kl0:.2e} > {first_minibatch_tolerance:g}): "
            "broken weight sync or routing replay?"
        )
    flagged = [(key, text) for key, bad, text in HEALTH if key in metrics and bad(metrics[key])]
    stale = metrics.get("staleness/max", 0.0)
    if flagged and stale > 0:  # mu is an older policy: the gap includes the policy's own change, in one line
        values = ", ".join(f"{key} = {metrics[key]:.3g}" for key, _ in flagged)
        out.append(
            f"off-policy gap beyond the mismatch thresholds ({values}): mu is up to {stale:g} version(s) behind "
            "pi_old, so this includes the policy's change between versions, not only training-inference mismatch"
        )
    else:
        out += [f"training-inference mismatch: {text} ({key} = {metrics[key]:.3g})" for key, text in flagged]
    return out


class NonFiniteUpdateError(RuntimeError):
    """Too many consecutive optimizer steps had a non-finite loss or gradient."""


class SkipCounter:
    """Consecutive optimizer steps skipped for a non-finite loss or gradient; `limit` in a row stop
    the run (trainer.max_skipped_steps)."""

    def __init__(self, limit: int):
        self.limit, self.streak = limit, 0

    def __call__(self, skipped: bool, where: str) -> str | None:
        """The warning for a skipped step (None for an applied one); raises at the limit."""
        if not skipped:
            self.streak = 0
            return None
        self.streak += 1
        if self.streak >= self.limit:
            raise NonFiniteUpdateError(
                f"{where}: {self.streak} optimizer step(s) in a row had a non-finite loss or gradient "
                f"(trainer.max_skipped_steps={self.limit}); stopping before the model is damaged. Check the "
                "rewards, the learning rate and the mismatch metrics of the last steps (metrics.jsonl)."
            )
        return (
            f"{where}: non-finite loss or gradient; the optimizer step was skipped on every rank "
            f"({self.streak} in a row, limit trainer.max_skipped_steps={self.limit})"
        )


class HealthMonitor:
    """Step-level warnings from the logged metrics: the stateless `health_warnings`, a gradient-norm
    jump (> 10x the median of the previous ten steps; users of RL trainers report such jumps ahead
    of collapse) and steps with nothing to learn (every group's rewards equal), the latter shown
    once and counted at the end."""

    def __init__(self, first_minibatch_tolerance: float | None = 1e-4, window: int = 10, spike: float = 10.0):
        self.tolerance = first_minibatch_tolerance
        self.norms: list[float] = []
        self.window, self.spike = window, spike
        self.flat_steps = 0

    def __call__(self, metrics: dict[str, float]) -> list[str]:
        out = health_warnings(metrics, self.tolerance)
        norm = metrics.get("actor/grad_norm")
        if norm is not None and math.isfinite(norm):
            previous = self.norms[-self.window :]
            if previous:
                median = statistics.median(previous)
                if median > 0 and norm > self.spike * median:
                    out.append(
                        f"gradient-norm spike: actor/grad_norm {norm:.3g} is {norm / median:.0f}x the median "
                        f"{median:.3g} of the previous {len(previous)} steps (often precedes a collapse)"
                    )
            self.norms.append(norm)
        if metrics.get("reward/zero_variance_groups") == 1.0:
            self.flat_steps += 1
            if self.flat_steps == 1:
                out.append(
                    "every group's rewards are equal (reward/zero_variance_groups = 1): all advantages are 0 and "
                    "this step teaches nothing; too easy or too hard a task, or a reward that ignores the response? "
                    "(said once; counted at the end)"
                )
        return out

    def summary(self) -> list[str]:
        if self.flat_steps:
            return [f"{self.flat_steps} step(s) had nothing to learn (every group's rewards equal)"]
        return []


class ExactCheck:
    """trainer.true_on_policy: a step where some response token's pi_old != mu warns (or stops the run, `strict`:
    trainer.true_on_policy_strict) naming the first such token over the ranks."""

    def __init__(self, strict: bool, logger):
        self.strict, self.logger = strict, logger

    def __call__(self, step: int, padded, old, fraction: float) -> None:
        """Step `step`'s check; `fraction`: its mismatch/exact_fraction. Collective when it is below 1."""
        if fraction >= 1.0:
            return
        differ = (old.logprobs.float() != padded.rollout_logprobs.float()) & (padded.loss_mask > 0)
        first = None
        if differ.any():
            i, j = map(int, differ.nonzero()[0])
            first = (i, j, float(old.logprobs[i, j]), float(padded.rollout_logprobs[i, j]))
        found = [(r, f) for r, f in enumerate(all_gather_objects(first)) if f is not None]
        if not found:  # the metric's comparison and this one are the same; nothing to name
            return
        rank, (i, j, pi_old, mu) = found[0]
        message = (
            f"trainer.true_on_policy: pi_old != mu on {1 - fraction:.3%} of response tokens; the first on rank "
            f"{rank}, sample {i} of its batch, token position {j}: log pi_old {pi_old!r}, log mu {mu!r}"
        )
        if self.strict:
            raise RuntimeError(message + " (trainer.true_on_policy_strict=true)")
        self.logger.warn(step, message)
