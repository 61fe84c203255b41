"""The trainer's side of a reward service (data.reward=http://HOST:PORT): a batch of Samples split into requests of
data.reward_batch_size samples sent concurrently, each with its own time limit (data.reward_request_timeout_s) and
retried with backoff under the same request id (the server answers a retry from its cache: nothing is scored
twice), until data.reward_retries or data.reward_service_timeout_s of failing is used up; then the step stops with
an error naming the URL and what happened. A 401 (wrong token), a 400 and a reward that failed on the server (422)
are not retried."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field

import aiohttp

from moe_rl.common import progress
from moe_rl.reward.inprocess import RewardError, run_awaitable
from moe_rl.reward.sample import Sample
from moe_rl.reward.service.wire import WireError, auth_header, client_token, samples_json

BACKOFF_S = (0.25, 5.0)
"""The first wait before a retry and the longest (doubling in between)."""
HEALTH_TIMEOUT_S = 10.0
"""The time limit of one /health request."""
FINAL = (400, 401, 403, 404, 413, 422)
"""Answers a retry would get again."""


class ServiceError(RewardError):
    """The reward service could not score a batch (the message names the URL and what happened)."""


@dataclass(frozen=True)
class ServiceSettings:
    """The client's settings (data.reward_* keys; the defaults are DataConfig's)."""

    token: str
    batch_size: int = 64
    request_timeout_s: float = 240.0
    retries: int = 30
    service_timeout_s: float = 300.0

    @classmethod
    def from_data(cls, data) -> ServiceSettings:
        """From the data config section; the token from data.reward_token_file or $MOE_RL_REWARD_TOKEN."""
        try:
            token = client_token(getattr(data, "reward_token_file", ""))
        except WireError as e:
            raise ServiceError(str(e)) from None
        keys = ("batch_size", "request_timeout_s", "retries", "service_timeout_s")
        return cls(token, **{k: getattr(data, f"reward_{k}") for k in keys if hasattr(data, f"reward_{k}")})


@dataclass
class RemoteScores:
    """What the service returned for a batch: the combined reward per sample, and its metrics' totals and counts
    (as moe_rl.reward.Scores holds them; reward/service_retries counts the retried requests)."""

    rewards: list[float]
    totals: dict[str, list[float]] = field(default_factory=dict)
    counts: dict[str, float] = field(default_factory=dict)


@dataclass
class _Failing:
    """A request's failures so far."""

    first: float | None = None
    attempts: int = 0
    last: str = ""


class RewardService:
    """One reward service, at `url` (http(s)://HOST:PORT)."""

    def __init__(self, url: str, settings: ServiceSettings):
        self.url, self.settings = url, settings
        self.describe_lines: list[str] = []  # the server's rewards, from /health

    def check(self) -> None:
        """The startup check: the server answers /health with the token (retrying a server not up yet within
        data.reward_service_timeout_s); ServiceError naming the URL otherwise. Keeps the server's reward lines."""
        body = run_awaitable(self._health())
        if body.get("status") != "ok":
            raise ServiceError(f"reward service {self.url}: /health answered {body!r}")
        self.describe_lines = [str(line) for line in body.get("rewards", [])]

    def score(self, samples: list[Sample], step: int) -> RemoteScores:
        """The service's scores of `samples` (ServiceError when it cannot score them in time)."""
        return run_awaitable(self._score(samples, step))

    def _session(self) -> aiohttp.ClientSession:
        headers = auth_header(self.settings.token) | {"Content-Type": "application/json"}
        return aiohttp.ClientSession(headers=headers)

    async def _health(self) -> dict:
        async with self._session() as session:
            return await self._call(session, "GET", "/health", None, "the health check", HEALTH_TIMEOUT_S, {})

    async def _score(self, samples: list[Sample], step: int) -> RemoteScores:
        size, batch = max(1, self.settings.batch_size), uuid.uuid4().hex
        chunks = [samples[k : k + size] for k in range(0, len(samples), size)]
        retried: dict[str, float] = {}
        try:
            bodies = [samples_json(chunk, f"{batch}-{k}", step) for k, chunk in enumerate(chunks)]
        except WireError as e:
            raise ServiceError(f"step {step}: {e}") from None
        what = [f"step {step}: request {k + 1} of {len(chunks)} ({len(c)} samples)" for k, c in enumerate(chunks)]
        timeout = self.settings.request_timeout_s
        async with self._session() as session:
            tasks = [
                asyncio.ensure_future(self._call(session, "POST", "/score", body, w, timeout, retried))
                for body, w in zip(bodies, what, strict=True)
            ]
            try:
                answers = await asyncio.gather(*tasks)
            finally:
                for t in tasks:  # the first failure stops the batch: the other requests are not waited for
                    t.cancel()
        out = RemoteScores([], counts={"reward/service_retries": retried.get("n", 0.0)})
        for chunk, answer, w in zip(chunks, answers, what, strict=True):
            rewards = answer.get("rewards")
            if not isinstance(rewards, list) or len(rewards) != len(chunk):
                raise ServiceError(f"reward service {self.url}: {w}: answered {str(answer)[:200]}, not one reward each")
            out.rewards += rewards
            for k, (s, n) in answer.get("totals", {}).items():
                t = out.totals.setdefault(k, [0.0, 0.0])
                t[0], t[1] = t[0] + s, t[1] + n
            for k, n in answer.get("counts", {}).items():
                out.counts[k] = out.counts.get(k, 0.0) + n
        return out

    async def _call(self, session, method: str, path: str, body: bytes | None, what: str, timeout_s: float, retried):
        """One request, retried with backoff under the same body (the same request id) until it succeeds, fails
        for good, or has failed for data.reward_retries retries or data.reward_service_timeout_s seconds."""
        s, failing = self.settings, _Failing()
        while True:
            limit = timeout_s
            if failing.first is not None:  # once failing, no attempt runs past the service's limit
                limit = min(limit, max(0.1, failing.first + s.service_timeout_s - time.monotonic()))
            try:
                return await self._attempt(session, method, path, body, limit, what)
            except _Retry as e:
                failing.last = str(e)
            now = time.monotonic()
            failing.first = now if failing.first is None else failing.first
            failing.attempts += 1
            spent = now - failing.first
            if failing.attempts > s.retries or spent >= s.service_timeout_s:
                raise ServiceError(
                    f"reward service {self.url}: {what}: failed {failing.attempts} times over {spent:.1f} s "
                    f"(data.reward_retries={s.retries}, data.reward_service_timeout_s={s.service_timeout_s:g}); "
                    f"the last: {failing.last}"
                )
            retried["n"] = retried.get("n", 0.0) + 1
            progress.mark()  # retrying is progress: data.reward_service_timeout_s, not the hang watchdog, ends it
            wait = min(BACKOFF_S[0] * 2 ** (failing.attempts - 1), BACKOFF_S[1])
            await asyncio.sleep(max(0.0, min(wait, failing.first + s.service_timeout_s - now)))

    async def _attempt(self, session, method: str, path: str, body, limit: float, what: str) -> dict:
        """One attempt: the answer's JSON, ServiceError for an answer a retry would get again, _Retry otherwise."""
        try:
            timeout = aiohttp.ClientTimeout(total=limit)
            async with session.request(method, self.url + path, data=body, timeout=timeout) as resp:
                text = await resp.text()
                status = resp.status
        except aiohttp.ClientConnectorError as e:
            refused = isinstance(e.os_error, ConnectionRefusedError)
            raise _Retry(("connection refused" if refused else "cannot connect") + f" ({e})") from None
        except TimeoutError:
            raise _Retry(f"no answer within {limit:.1f} s (data.reward_request_timeout_s)") from None
        except aiohttp.ClientError as e:  # e.g. the server died with the request in flight
            raise _Retry(f"{type(e).__name__}: {e}") from None
        progress.mark()
        if status == 200:
            try:
                return json.loads(text)
            except ValueError:
                raise ServiceError(f"reward service {self.url}: {what}: answered non-JSON: {text[:200]!r}") from None
        if status == 401:
            raise ServiceError(
                f"reward service {self.url}: {what}: 401 Unauthorized: the token is wrong (the server's --token-file "
                "and this run's data.reward_token_file or $MOE_RL_REWARD_TOKEN must hold the same token)"
            )
        if status in FINAL:
            try:
                message = json.loads(text).get("error", text)
            except (ValueError, AttributeError):
                message = text
            raise ServiceError(f"reward service {self.url}: {what}: HTTP {status}: {str(message)[:4000]}")
        raise _Retry(f"HTTP {status}: {text[:200]}")


class _Retry(Exception):
    """An attempt that failed in a way a retry may not (connection, time limit, a 5xx)."""
