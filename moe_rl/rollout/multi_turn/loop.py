"""The multi-turn agent loop (runs on an engine leader): token in, token out.

Every trajectory starts from its prompt's token ids. Each turn the engine samples one continuation per live
trajectory from the trajectory's exact token ids; the environment answers; its observation is tokenized
alone (with the chat template's turn markers) and appended. The conversation is never re-rendered, and every
turn checks that the engine saw exactly the tokens the trajectory holds. Only the model's tokens are trained
(`response_masks`), each with mu's log-prob from the turn that sampled it; routes are stitched append-only
(routes.py).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moe_rl.common.batch import RolloutBatch
from moe_rl.rollout.multi_turn.builtin_envs import env_class
from moe_rl.rollout.multi_turn.config import MultiTurnConfig
from moe_rl.rollout.multi_turn.environment import EnvSample, StepResult, Turn
from moe_rl.rollout.multi_turn.routes import StitchedRoutes, check_append_only
from moe_rl.routing.records import RouteError, missing_row, route_dtype, validate_routes

END_REASONS = ("env_done", "max_turns", "context_limit", "env_error", "env_timeout")


class ObservationEncoder:
    """Token ids of one observation: its message as the chat template renders it after an assistant turn
    (closing that turn, opening the next assistant turn), tokenized alone; at most `max_tokens`."""

    def __init__(self, tokenizer, max_tokens: int):
        self.tokenizer, self.max_tokens = tokenizer, max_tokens
        self._frames: dict[str, tuple[str, str, str]] = {}

    def _frame(self, role: str) -> tuple[str, str, str]:
        """(close of an assistant turn, text before the content, text after it) for `role`."""
        if role not in self._frames:
            tok, marker = self.tokenizer, "\x00OBSERVATION\x00"
            history = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]
            before = tok.apply_chat_template(history, tokenize=False)
            after = tok.apply_chat_template(
                [*history, {"role": role, "content": marker}], tokenize=False, add_generation_prompt=True
            )
            if not after.startswith(before) or marker not in after:
                raise ValueError(
                    "the chat template renders earlier turns differently once a message follows them; multi-turn "
                    "rollouts need a template that appends messages"
                )
            head, _, tail = after[len(before) :].partition(marker)
            self._frames[role] = (before[before.rindex("A") + 1 :], head, tail)
        return self._frames[role]

    def __call__(self, observation: str | list[int], role: str, after_eos: bool) -> tuple[list[int], bool]:
        """(token ids, whether the content was cut to fit max_tokens). `after_eos`: the model's turn ended with
        the EOS token, which then stands for the template's end-of-turn text if that starts with it."""
        tok = self.tokenizer
        if not isinstance(observation, str):
            ids = [int(t) for t in observation]
            return ids[: self.max_tokens], len(ids) > self.max_tokens
        if tok.chat_template is None:
            ids = tok.encode(observation, add_special_tokens=False)
            return ids[: self.max_tokens], len(ids) > self.max_tokens
        close, head, tail = self._frame(role)
        if after_eos and tok.eos_token and close.startswith(tok.eos_token):
            close = close[len(tok.eos_token) :]
        content, cut = observation, False
        for _ in range(4):
            ids = tok.encode(close + head + content + tail, add_special_tokens=False)
            if len(ids) <= self.max_tokens:
                return ids, cut
            content_ids = tok.encode(content, add_special_tokens=False)
            keep = max(0, len(content_ids) - (len(ids) - self.max_tokens) - 1)
            content, cut = tok.decode(content_ids[:keep]), True
        raise ValueError(
            f"rollout.multi_turn.max_observation_tokens={self.max_tokens} cannot hold the chat template's "
            f"markers for a {role} message"
        )


@dataclass
class Trajectory:
    k: int  # its place in the step's batch
    prompt_index: int
    sample_index: int
    name: str  # for errors: "k (prompt i, sample j)"
    tokens: list[int]
    prompt_len: int
    routes: StitchedRoutes | None
    env: Any = None
    logps: list[float] = field(default_factory=list)  # over tokens[prompt_len:]
    mask: list[float] = field(default_factory=list)
    turn_ids: list[int] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    end: str = ""  # one of END_REASONS once done
    finish_reason: str = ""
    truncated_observations: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache, turns after the first
    reprompted_tokens: int = 0  # prompt tokens of turns after the first
    env_error: str = ""
    failed: str = ""  # env_error | env_timeout when reset failed: it samples its first turn, then ends
    last_turn: list[int] = field(default_factory=list)


def _call_with_timeout(calls: list, timeout_s: float) -> list[tuple[str, Any]]:
    """Run each zero-argument call on its own daemon thread; [("ok", result) | ("error", exc) | ("timeout",
    None)] after at most `timeout_s` (a call that overruns keeps running on its thread, detached)."""
    results: list[tuple[str, Any]] = [("timeout", None)] * len(calls)

    def run(i, fn):
        try:
            results[i] = ("ok", fn())
        except Exception as e:  # reported per trajectory
            results[i] = ("error", e)

    threads = [threading.Thread(target=run, args=(i, fn), daemon=True) for i, fn in enumerate(calls)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return list(results)


class AgentLoop:
    """Multi-turn rollouts of a batch of prompts on one engine (rollout.multi_turn.*)."""

    def __init__(self, engine, cfg: MultiTurnConfig, tokenizer, context_limit: int):
        self.engine, self.cfg, self.tokenizer = engine, cfg, tokenizer
        self.env_cls = env_class(cfg.env)
        self.limit = min(cfg.max_context_tokens or context_limit, context_limit)
        self.encode = ObservationEncoder(tokenizer, cfg.max_observation_tokens)
        self.missing = None  # the row marking a position without a route (missing_routes=live)
        if cfg.missing_routes == "live" and engine.capture is not None:
            self.missing = missing_row(len(engine.moe_layers), engine.topk, route_dtype(engine.num_experts))

    def __call__(self, prompts: list, sampling) -> RolloutBatch:
        """`prompts`: data.prompts.Prompt (ids set); `sampling.n` trajectories each, contiguous per prompt."""
        e = self.engine
        n = sampling.n
        trajs = [
            Trajectory(
                i * n + j,
                i,
                j,
                f"{i * n + j} (prompt {i}, sample {j})",
                list(p.ids),
                len(p.ids),
                None if e.capture is None else StitchedRoutes(len(e.moe_layers), e.topk, route_dtype(e.num_experts)),
            )
            for i, p in enumerate(prompts)
            for j in range(n)
        ]
        base = 0 if sampling.seed is None else sampling.seed
        samples = [
            EnvSample(
                prompts[t.prompt_index].text,
                prompts[t.prompt_index].answer,
                t.prompt_index,
                t.sample_index,
                (base + t.prompt_index) * n + t.sample_index,
                self.cfg.max_turns,
                self.tokenizer,
            )
            for t in trajs
        ]
        env_wall = self._envs(trajs, [lambda t=t, s=s: self._reset(t, s) for t, s in zip(trajs, samples, strict=True)])
        for turn in range(self.cfg.max_turns):
            live = [t for t in trajs if not t.end]
            if not live:
                break
            budgets = [min(sampling.max_tokens, self.limit - len(t.tokens)) for t in live]
            seeds = [None if sampling.seed is None else self._seed(sampling.seed, t, turn, n) for t in live]
            outs = e.generate_turn([t.tokens for t in live], sampling, budgets, seeds)
            self._record_turn(trajs, live, outs, turn)
            for t in live:
                t.end = t.failed
            stepping = [t for t in live if not t.end]
            turns = [
                Turn(self.tokenizer.decode(t.last_turn, skip_special_tokens=True), t.last_turn, turn, t.finish_reason)
                for t in stepping
            ]
            env_wall += self._envs(
                stepping, [lambda t=t, x=x: t.env.step(x) for t, x in zip(stepping, turns, strict=True)], turn
            )
        failed = [t for t in trajs if t.end in ("env_error", "env_timeout")]
        if failed and len(failed) == len(trajs):
            raise RuntimeError(f"every trajectory's environment failed this step; the first: {failed[0].env_error}")
        return self._batch(trajs, env_wall)

    def _seed(self, base: int, t: Trajectory, turn: int, n: int) -> int:
        """The sampling seed of trajectory `t`'s turn: prompt i of the batch has seed base + i, as in single-turn
        rollouts (the engine source gives each data-parallel rank's prompts their own seeds), and each of its n
        trajectories and turns one of its own. Independent of how many ranks' prompts this engine serves, so a
        change of rollout.engines samples the same trajectories."""
        return ((base + t.prompt_index) * n + t.sample_index) * self.cfg.max_turns + turn

    def _record_turn(self, trajs: list[Trajectory], live: list[Trajectory], outs: list, turn: int) -> None:
        """Append each live trajectory's sampled tokens, mu's log-probs and this turn's new route rows."""
        missing = {}
        for t, o in zip(live, outs, strict=True):
            if o.prompt_ids != t.tokens:
                at = next((k for k, (a, b) in enumerate(zip(o.prompt_ids, t.tokens, strict=False)) if a != b), None)
                raise RouteError(
                    f"sample {t.name}, turn {turn}: the engine's prompt ({len(o.prompt_ids)} tokens) is not the "
                    f"trajectory's {len(t.tokens)} tokens (first difference at {at}): a turn must extend the "
                    "previous tokens exactly"
                )
            if turn:
                t.cached_tokens += o.cached_tokens
                t.reprompted_tokens += len(o.prompt_ids)
            before = None if t.routes is None else t.routes.rows.copy()
            t.tokens += o.response_ids
            t.last_turn = list(o.response_ids)
            t.logps += o.logprobs.tolist()
            t.mask += [1.0] * len(o.response_ids)
            t.turn_ids += [turn] * len(o.response_ids)
            t.turns, t.finish_reason = turn + 1, o.finish_reason
            if t.routes is not None:
                if o.routes is None or o.routes.shape[0] != len(t.tokens) - 1:
                    got = None if o.routes is None else o.routes.shape[0]
                    raise RouteError(
                        f"sample {t.name}, turn {turn}: {got} route rows captured for {len(t.tokens)} tokens "
                        f"(expected {len(t.tokens) - 1})"
                    )
                gaps = t.routes.add_turn(o.routes, o.computed, len(t.tokens) - 1)
                if gaps:
                    missing[id(t)] = (t, gaps)
                check_append_only(before, t.routes.rows, t.name, turn)
        for t, gaps in missing.values():  # prefix-cache hits on blocks another trajectory computed
            for p in gaps:
                donor = next(
                    (u for u in trajs if u is not t and len(u.routes) > p and u.tokens[: p + 1] == t.tokens[: p + 1]),
                    None,
                )
                if donor is None and self.missing is not None:
                    t.routes.fill(p, self.missing)
                    t.routes.missing += 1
                    continue
                if donor is None:
                    raise RouteError(
                        f"sample {t.name}, turn {turn}: position {p} has no route: the engine computed it in no turn "
                        "of this trajectory and no trajectory with the same tokens recorded it "
                        "(rollout.multi_turn.missing_routes=error)"
                    )
                t.routes.fill(p, donor.routes.rows[p])

    def _reset(self, t: Trajectory, sample: EnvSample) -> None:
        t.env = self.env_cls()
        t.env.reset(sample)

    def _apply(self, t: Trajectory, turn: int, result: StepResult) -> None:
        """The environment's answer to turn `turn`: reward, end, or the observation appended."""
        if not isinstance(result, StepResult):
            raise TypeError(f"{type(t.env).__name__}.step returned {type(result).__name__}, not a StepResult")
        t.reward += float(result.reward)
        if result.done or result.observation is None:
            t.end = "env_done"
            return
        if turn + 1 >= self.cfg.max_turns:
            t.end = "max_turns"
            return
        eos = self.tokenizer.eos_token_id
        obs, cut = self.encode(result.observation, result.role, bool(t.last_turn) and t.last_turn[-1] == eos)
        if len(t.tokens) + len(obs) + 1 > self.limit:  # no room to answer the observation
            t.end = "context_limit"
            return
        t.truncated_observations += cut
        t.tokens += obs
        t.logps += [0.0] * len(obs)
        t.mask += [0.0] * len(obs)
        t.turn_ids += [-1] * len(obs)

    def _envs(self, trajs: list[Trajectory], calls: list, turn: int | None = None) -> float:
        """Run each trajectory's environment call (reset when `turn` is None, else that turn's step) under the
        timeout, on worker threads; apply the results here (a call that overran cannot touch its trajectory).
        A failure ends its trajectory: after its first turn for reset, at once for a step."""
        t0 = time.perf_counter()
        results = _call_with_timeout(calls, self.cfg.env_timeout_s)
        reported = 0
        for t, (status, value) in zip(trajs, results, strict=True):
            if status == "ok" and turn is not None:
                try:
                    self._apply(t, turn, value)
                    continue
                except (TypeError, ValueError) as e:  # a bad StepResult or an observation that cannot fit
                    status, value = "error", e
            if status == "ok":
                continue
            reason = "env_timeout" if status == "timeout" else "env_error"
            if turn is None:
                t.failed = reason
            else:
                t.end = reason
            what = "reset" if turn is None else f"step of turn {turn}"
            t.env_error = f"sample {t.name}: the environment's {what} " + (
                f"took over {self.cfg.env_timeout_s} s" if status == "timeout" else f"raised {value!r}"
            )
            if reported < 3:
                print(f"[moe-rl] WARNING multi-turn: {t.env_error}; the trajectory ends here", flush=True)
            reported += 1
        if reported > 3:
            print(f"[moe-rl] WARNING multi-turn: {reported - 3} more environment failures this call", flush=True)
        return time.perf_counter() - t0

    def _batch(self, trajs: list[Trajectory], env_wall: float) -> RolloutBatch:
        e = self.engine
        records = None
        if e.capture is not None:
            records = [
                validate_routes(
                    t.routes.rows,
                    num_tokens=len(t.tokens),
                    num_experts=e.num_experts,
                    num_moe_layers=len(e.moe_layers),
                    topk=e.topk,
                    sample=t.name,
                    allow_missing=self.missing is not None,
                )
                for t in trajs
            ]
        sampled = np.array([sum(t.mask) for t in trajs])
        info = {
            "turns": np.array([t.turns for t in trajs], dtype=np.float64),
            "observation_tokens": np.array([len(t.mask) for t in trajs]) - sampled,
            "sampled_tokens": sampled,
            "observations_truncated": np.array([t.truncated_observations for t in trajs], dtype=np.float64),
            "cached_tokens": np.array([t.cached_tokens for t in trajs], dtype=np.float64),
            "reprompted_tokens": np.array([t.reprompted_tokens for t in trajs], dtype=np.float64),
            "env_wall_s": np.full(len(trajs), env_wall),
        }
        for reason in END_REASONS:
            info[f"ended_{reason}"] = np.array([t.end == reason for t in trajs], dtype=np.float64)
        if records is not None:
            for key in ("recomputed", "recomputed_changed", "computed", "missing"):
                info[key] = np.array([getattr(t.routes, key) for t in trajs], dtype=np.float64)
        return RolloutBatch(
            [t.tokens[: t.prompt_len] for t in trajs],
            [t.tokens[t.prompt_len :] for t in trajs],
            [np.array(t.logps, dtype=np.float32) for t in trajs],
            [t.finish_reason for t in trajs],
            np.array([t.prompt_index for t in trajs]),
            np.array([t.sample_index for t in trajs]),
            records,
            e.moe_layers,
            e.num_experts,
            e.topk,
            response_masks=[np.array(t.mask, dtype=np.float32) for t in trajs],
            turn_index=[np.array(t.turn_ids, dtype=np.int64) for t in trajs],
            rewards=np.array([t.reward for t in trajs], dtype=np.float32),
            info=info,
        )
