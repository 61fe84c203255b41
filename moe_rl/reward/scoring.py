"""The run's reward: one or more reward functions (data.reward, data.reward_weights) over a batch of Samples, the
combined reward (the weighted sum over the functions that scored each sample) and its metrics. A reward service
(data.reward=http://HOST:PORT) is one more function: its combined rewards and metrics come back from the server."""

from __future__ import annotations

from dataclasses import dataclass, field

from moe_rl import sandbox
from moe_rl.common.errors import refuse
from moe_rl.reward import builtin, code
from moe_rl.reward.inprocess import RewardError, SampleFailed, TimedOut, as_number, call_batch, within
from moe_rl.reward.load import Kind, RewardFunction, RewardLoadError, load
from moe_rl.reward.pool import Outcome, RewardPool, default_workers
from moe_rl.reward.sample import Sample
from moe_rl.reward.service.client import RewardService, ServiceError, ServiceSettings

BUILTIN_SPEC = "moe_rl.reward.builtin:compute_score"
"""The built-in dispatch by data_source (what a file dataset with no data.reward is scored with)."""
KIND_NAMES = {
    Kind.verl: "verl",
    Kind.trl: "TRL",
    Kind.batched: "moe-rl batched",
    Kind.per_sample: "moe-rl per sample",
    Kind.remote: "reward service",
}


@dataclass
class Scores:
    """A batch's rewards and metrics. `totals` (metric -> [sum, count]) and `counts` (metric -> count) are what
    `combine` adds up over ranks; `metrics` is this batch's own."""

    rewards: list[float]
    totals: dict[str, list[float]] = field(default_factory=dict)
    counts: dict[str, float] = field(default_factory=dict)

    @property
    def metrics(self) -> dict[str, float]:
        """reward/<name>/mean per function, reward/<name>/<key> per extra metric, reward/<data_source>/mean, and
        reward/timeouts and reward/errors (calls of this batch)."""
        return combine([(self.totals, self.counts)])


def combine(parts: list[tuple[dict[str, list[float]], dict[str, float]]]) -> dict[str, float]:
    """The metrics of several Scores' (totals, counts) together (every data-parallel rank's): means of the summed
    sums and counts, and summed counts. The keys may differ per part (each rank sees its own data sources)."""
    totals: dict[str, list[float]] = {}
    counts: dict[str, float] = {}
    for part_totals, part_counts in parts:
        for k, (s, n) in part_totals.items():
            t = totals.setdefault(k, [0.0, 0.0])
            t[0], t[1] = t[0] + s, t[1] + n
        for k, n in part_counts.items():
            counts[k] = counts.get(k, 0.0) + n
    return {k: s / n for k, (s, n) in sorted(totals.items()) if n} | dict(sorted(counts.items()))


class RewardSet:
    """The reward functions of a run, loaded and checked once (data.reward: a spec or a list of them)."""

    def __init__(self, functions: list[RewardFunction], weights: list[float], data):
        """`functions` as loaded, `weights` one per function, `data` the data config section (its reward_* keys)."""
        self.functions, self.weights = functions, weights
        self.names = unique_names([rf.name for rf in functions])
        self.timeout_s = data.reward_timeout_s
        self.call_timeout_s = data.reward_call_timeout_s
        self.timeout_score, self.error_score = data.reward_timeout_score, data.reward_error_score
        self.workers = data.reward_workers or default_workers()
        pooled = [rf.spec for rf in functions if rf.in_pool]
        preload = ["moe_rl.reward.math_answer"] if BUILTIN_SPEC in pooled else []  # math-verify: ~1 s to import
        self.pool = RewardPool(pooled, self.workers, self.call_timeout_s, preload) if pooled else None
        remote = [i for i, rf in enumerate(functions) if rf.kind is Kind.remote]
        settings = ServiceSettings.from_data(data) if remote else None
        self.services = {i: RewardService(functions[i].spec, settings) for i in remote}

    @classmethod
    def from_config(cls, data) -> RewardSet:
        """The reward functions data.reward names (or the task's own), with data.reward_weights (null: all 1.0)."""
        specs = data.reward_specs
        weights = list(data.reward_weights) if data.reward_weights is not None else [1.0] * len(specs)
        if len(weights) != len(specs):
            refuse("data.reward_weights", f"{len(weights)} weights for {len(specs)} reward functions")
        functions = []
        for spec in specs:
            try:
                functions.append(load(spec))
            except RewardLoadError as e:
                refuse("data.reward", str(e))
        sandboxed = [rf.spec for rf in functions if getattr(rf.fn, "uses_sandbox", False)]
        if sandboxed:
            prepare_sandbox(data, sandboxed[0])
        try:
            rewards = cls(functions, [float(w) for w in weights], data)
            for service in rewards.services.values():  # before the model is built: a wrong URL or token fails now
                service.check()
        except ServiceError as e:
            refuse("data.reward", str(e))
        return rewards

    @property
    def needs_answer(self) -> str | None:
        """The reward that scores against every prompt's reference answer (named in errors), or None."""
        for rf in self.functions:
            if getattr(rf.fn, "needs_answer", False):
                return f"data.reward={rf.spec}"
        return None

    def describe(self) -> list[str]:
        """One header line per reward function: its name, spec, form, weight and where it runs."""
        lines = []
        for rf, name, w in zip(self.functions, self.names, self.weights, strict=True):
            if rf.spec == BUILTIN_SPEC:
                what = f"built-in by data_source ({builtin.KNOWN})"
            elif rf.kind is Kind.remote:
                service = self.services[self.functions.index(rf)]
                s = service.settings
                served = f" [{'; '.join(service.describe_lines)}]" if service.describe_lines else ""
                lines.append(
                    f"reward {name}: reward service{served}, weight {w:g}, requests of {s.batch_size} samples, "
                    f"{s.request_timeout_s:g} s each, {s.retries} retries within {s.service_timeout_s:g} s"
                )
                continue
            else:
                what = f"{rf.spec}, {KIND_NAMES[rf.kind]} form"
            runs = "in process"
            if rf.in_pool:
                runs = f"{self.workers} worker processes, {self.call_timeout_s:g} s per call"
            lines.append(f"reward {name}: {what}, weight {w:g}, {runs}")
        return lines

    def check_prompts(self, prompts: list, what: str) -> None:
        """Refuse prompts (moe_rl.data.prompts.Prompt) the rewards cannot score, naming the row: a data_source
        the built-in dispatch does not know, no answer where a reward needs one. `what` names the data."""
        for rf in self.functions:
            builtin_dispatch, needs = rf.spec == BUILTIN_SPEC, getattr(rf.fn, "needs_answer", False)
            for p in prompts:
                if builtin_dispatch and not builtin.knows(p.data_source):
                    shown = repr(p.data_source) if p.data_source else "none (no data_source column)"
                    refuse(
                        "data.reward",
                        f"{p.source} ({what}): data_source {shown} has no built-in reward (known: {builtin.KNOWN}); "
                        "set data.reward to your reward function",
                    )
                if needs and p.answer is None:
                    refuse("data.reward", f"{p.source} ({what}): the prompt has no answer, and {rf.spec} needs one")

    def score(self, samples: list[Sample], step: int, phase: str = "") -> Scores:
        """Score `samples` with every function; the combined rewards and the metrics (see Scores)."""
        scores = self.score_functions(samples, step, phase)
        for j, s in enumerate(samples):
            if s.data_source:
                t = scores.totals.setdefault(f"reward/{s.data_source}/mean", [0.0, 0.0])
                t[0], t[1] = t[0] + scores.rewards[j], t[1] + 1
        return scores

    def score_functions(self, samples: list[Sample], step: int, phase: str = "") -> Scores:
        """`score` without the per-data_source means (what a reward service answers: its client forms those from
        the combined rewards, with its own functions')."""
        where = f"step {step}" + (f" {phase}" if phase else "")
        scores = Scores([0.0] * len(samples), counts={"reward/timeouts": 0.0, "reward/errors": 0.0})
        pooled = [i for i, rf in enumerate(self.functions) if rf.in_pool]
        outcomes = self.pool.run([(self.functions[i].spec, s) for i in pooled for s in samples]) if pooled else []
        scored = [0] * len(samples)
        for i, (rf, name, w) in enumerate(zip(self.functions, self.names, self.weights, strict=True)):
            if rf.in_pool:
                k = pooled.index(i) * len(samples)
                values = self._pool_values(outcomes[k : k + len(samples)], samples, name, where, scores.counts)
            elif rf.kind is Kind.remote:
                self._remote(self.services[i], samples, step, where, w, scores)
                scored = [n + 1 for n in scored]
                continue
            else:
                values = self._in_process(rf, samples, step, name, where, scores)
            for j, v in enumerate(values):
                if v is None:
                    continue
                value = self._record(rf, name, v, samples[j], j, where, scores.totals)
                scores.rewards[j] += w * value
                scored[j] += 1
        for j, (s, n) in enumerate(zip(samples, scored, strict=True)):
            if not n:
                raise RewardError(f"{where}: no reward function scored sample {j} ({s.where}, {_source(s)})")
        return scores

    def _remote(self, service: RewardService, samples: list[Sample], step: int, where: str, w: float, scores) -> None:
        """A reward service's combined rewards (weighted by `w`) and its metrics, merged into `scores`."""
        got = service.score(samples, step)
        for j, v in enumerate(got.rewards):
            value = as_number(v)
            if value is None:
                raise RewardError(f"{where}: reward service {service.url} returned {v!r} for sample {j}")
            scores.rewards[j] += w * value
        for k, (total, n) in got.totals.items():
            t = scores.totals.setdefault(k, [0.0, 0.0])
            t[0], t[1] = t[0] + total, t[1] + n
        for k, n in got.counts.items():
            scores.counts[k] = scores.counts.get(k, 0.0) + n

    def _pool_values(self, outcomes: list[Outcome], samples, name: str, where: str, counts: dict) -> list:
        values = []
        for j, o in enumerate(outcomes):
            if o.timed_out:
                counts["reward/timeouts"] += 1
                values.append(self.timeout_score)
            elif o.error is not None:
                if self.error_score is None:
                    s = samples[j]
                    raise RewardError(
                        f"{where}: reward function {name} raised {type(o.error).__name__} for sample {j} "
                        f"({s.where}, {_source(s)}; row {_short(s.row)}): {o.error}"
                        + (f"\nworker traceback:\n{o.traceback}" if o.traceback else "")
                        + "\n(set data.reward_error_score to score such calls instead)"
                    ) from o.error
                counts["reward/errors"] += 1
                values.append(self.error_score)
            else:
                values.append(o.value)
        return values

    def _in_process(self, rf: RewardFunction, samples: list[Sample], step: int, name: str, where: str, scores):
        done: set[int] = set()

        def log_metric(key: str, value: float) -> None:  # TRL's log_metric: one value per call, averaged per step
            t = scores.totals.setdefault(f"reward/{name}/{key}", [0.0, 0.0])
            t[0], t[1] = t[0] + float(value), t[1] + 1

        try:
            values = within(self.timeout_s, lambda: call_batch(rf, samples, step, done, log_metric))
        except TimedOut:
            pending = [j for j in range(len(samples)) if j not in done]
            shown = ", ".join(map(str, pending[:10])) + (", ..." if len(pending) > 10 else "")
            first = f"; the first: {samples[pending[0]].where}, {_source(samples[pending[0]])}" if pending else ""
            raise RewardError(
                f"{where}: reward function {name} did not return within data.reward_timeout_s={self.timeout_s:g} s; "
                f"{len(pending)} of {len(samples)} samples pending (samples {shown}{first}). A judge or sandbox that "
                "stopped answering? Raise data.reward_timeout_s if it is only slow"
            ) from None
        except SampleFailed as e:
            s, cause = samples[e.index], e.__cause__
            raise RewardError(
                f"{where}: reward function {name} raised {type(cause).__name__} for sample {e.index} "
                f"({s.where}, {_source(s)}; row {_short(s.row)}): {cause}"
            ) from cause
        except Exception as e:
            raise RewardError(f"{where}: reward function {name} raised {type(e).__name__}: {e}") from e
        try:
            count = len(values)
        except TypeError:
            raise RewardError(f"{where}: reward function {name} returned {type(values).__name__}, not a list") from None
        if count != len(samples):
            raise RewardError(f"{where}: reward function {name} returned {count} rewards for {len(samples)} samples")
        return values

    def _record(self, rf: RewardFunction, name: str, v, s: Sample, j: int, where: str, totals: dict) -> float:
        """The score of one value (a number, or a dict with "score" and extra metrics, kept in `totals`)."""
        extras = {}
        if isinstance(v, dict):
            if "score" not in v:
                raise RewardError(f"{where}: reward function {name} returned a dict without 'score' for sample {j}")
            extras, v = {k: x for k, x in v.items() if k != "score"}, v["score"]
        value = as_number(v)
        if value is None:
            raise RewardError(
                f"{where}: reward function {name} returned {v!r} for sample {j} ({s.where}, {_source(s)}); rewards "
                "must be finite real numbers (None only from a TRL-form function: not scored)"
            )
        for key, value_x in [(f"reward/{name}/mean", value)] + [(f"reward/{name}/{k}", x) for k, x in extras.items()]:
            x = as_number(value_x)
            if x is not None:  # verl's extras may hold strings (e.g. the extracted answer): only numbers are metrics
                t = totals.setdefault(key, [0.0, 0.0])
                t[0], t[1] = t[0] + x, t[1] + 1
        return value

    def close(self) -> None:
        """Stop the worker processes (none is left behind)."""
        if self.pool is not None:
            self.pool.close()

    def __enter__(self) -> RewardSet:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def prepare_sandbox(data, spec: str) -> None:
    """A reward that runs programs (`spec`): the sandbox set from data.sandbox and data.code_score, and checked to
    run on this machine (a missing bubblewrap is refused here, before the model is built)."""
    if getattr(data, "sandbox", None) is not None:
        sandbox.configure(data.sandbox)
    code.configure(str(getattr(data, "code_score", "all")))
    try:
        sandbox.check_available()
    except sandbox.SandboxUnavailable as e:
        refuse("data.reward", f"{spec} runs programs in the sandbox, which cannot run here: {e}")


def unique_names(names: list[str]) -> list[str]:
    """`names` made unique: a repeated name gets _2, _3, ..."""
    seen: dict[str, int] = {}
    out = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        out.append(n if seen[n] == 1 else f"{n}_{seen[n]}")
    return out


def _source(s: Sample) -> str:
    """The sample's data_source and the start of its prompt, for errors."""
    source = f"data_source {s.data_source!r}" if s.data_source else "no data_source"
    return f"{source}, prompt {s.prompt[:60]!r}"


def _short(row: dict) -> str:
    text = repr(row)
    return text if len(text) <= 200 else text[:200] + "..."
