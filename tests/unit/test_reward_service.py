"""The reward service (moe_rl/reward/service, moe-rl-reward-server): real server processes on 127.0.0.1 scoring the
same rewards value for value as the same RewardSet in process, refusing requests without the token on every path,
answering a repeated request id once, and a client that rides out a server killed mid-batch and restarted (no
sample lost or scored twice by a server that answered) or stops with an error naming the URL after the limit."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from moe_rl.common.errors import ConfigError
from moe_rl.config.schema import DataConfig
from moe_rl.reward import RewardSet, Sample
from moe_rl.reward.load import Kind, load
from moe_rl.reward.service.client import ServiceError

FILES = Path(__file__).parent / "reward_files"
REPO = Path(__file__).parents[2]
VERL = f"{FILES / 'verl_reward.py'}:compute_score"
LENGTHS = f"{FILES / 'service_reward.py'}:lengths"
TRL = f"{FILES / 'service_reward.py'}:trl_format"
TOKEN = "s3cret-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """moe-rl-reward-server as a process of its own (its output in a file), stopped with SIGKILL."""

    def __init__(self, tmp: Path, rewards: list[str], port: int, env: dict | None = None, *args: str):
        token = tmp / "token"
        token.write_text(TOKEN + "\n")
        self.log = tmp / f"server-{time.monotonic_ns()}.log"
        cmd = [sys.executable, "-m", "moe_rl.tools.reward_server", "--port", str(port), "--token-file", str(token)]
        cmd += [a for r in rewards for a in ("--reward", r)] + list(args)
        with self.log.open("w") as out:
            full_env = os.environ | {"PYTHONPATH": str(REPO)} | (env or {})
            self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=full_env)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while "listening on" not in self.log.read_text():
            assert self.proc.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, f"the server did not start:\n{self.log.read_text()}"
            time.sleep(0.1)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


def _data(reward, tmp: Path, **keys) -> DataConfig:
    (tmp / "token").write_text(TOKEN + "\n")
    keys = {"reward_workers": 2, "reward_token_file": str(tmp / "token")} | keys
    return DataConfig(reward=reward, **keys)


def _samples(n: int, seed: int, prefix: str = "") -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        answer = str(rng.randint(0, 9))
        response = (
            prefix + rng.choice(["skip ", "", "so ", "the answer is "]) + str(rng.randint(0, 9)) * rng.randint(1, 3)
        )
        messages = [{"role": "user", "content": f"q{i}"}] if rng.random() < 0.5 else None
        row = {"data_source": rng.choice(["a/x", "b/y"]), "prompt": messages or f"q{i}", "extra_info": {"index": i}}
        ids = [rng.randint(0, 99) for _ in range(rng.randint(1, 5))]
        out.append(Sample(f"<q{i}>", messages, response, ids, answer, row["data_source"], row, f"t:row {i}"))
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(
        tmp_path_factory.mktemp("service"), [VERL, LENGTHS, TRL], free_port(), None, "--weights", "1", "0.5", "2"
    )
    yield s
    s.kill()


def test_a_url_is_a_remote_reward_not_loaded():
    rf = load("http://127.0.0.1:8701/")
    assert (rf.kind, rf.spec, rf.name, rf.in_pool) == (
        Kind.remote,
        "http://127.0.0.1:8701",
        "http://127.0.0.1:8701",
        False,
    )
    with pytest.raises(ValueError, match="http://HOST:PORT"):
        load("http://127.0.0.1:notaport")


def test_the_service_scores_value_for_value_as_in_process(server, tmp_path):
    local = RewardSet.from_config(_data([VERL, LENGTHS, TRL], tmp_path, reward_weights=[1.0, 0.5, 2.0]))
    remote = RewardSet.from_config(_data(server.url, tmp_path))  # one request per step, as one in-process call
    split = RewardSet.from_config(_data(server.url, tmp_path, reward_batch_size=3))  # 4 concurrent requests
    assert "reward service [reward compute_score:" in remote.describe()[0], remote.describe()
    with local, remote, split:
        for step, seed in ((1, 11), (2, 12)):
            samples = _samples(10, seed)
            want, got = local.score(samples, step), remote.score(samples, step)
            assert got.rewards == want.rewards and len(set(want.rewards)) > 3
            metrics = got.metrics
            assert metrics.pop("reward/service_retries") == 0
            assert metrics == pytest.approx(want.metrics, rel=1e-12)
            # the verl dict's extra, TRL's log_metric, a None not scored and the per-data_source means came back
            assert {"reward/compute_score/acc", "reward/trl_format/short", "reward/a/x/mean"} <= set(metrics)
            # split into requests: the same rewards; a batched function's per-call metric is per request
            chunked = split.score(samples, step)
            assert chunked.rewards == want.rewards
            assert chunked.metrics["reward/compute_score/mean"] == want.metrics["reward/compute_score/mean"]


def _get(url: str, token: str | None, body: bytes | None = None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    req = urllib.request.Request(url, data=body, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}") if e.code == 401 else {}


@pytest.mark.parametrize("token", [None, "wrong", TOKEN + "x", ""])
def test_a_request_without_the_token_is_refused_on_every_path(server, token):
    body = json.dumps({"request_id": "r", "samples": []}).encode()
    for path, data in (("/score", body), ("/health", None), ("/no/such/path", None), ("/score", b"not json")):
        status, answer = _get(server.url + path, token, data)
        assert status == 401 and "Unauthorized" in answer["error"], (path, status)
    assert _get(server.url + "/no/such/path", TOKEN)[0] == 404  # with the token, routing answers


def test_a_wrong_token_or_no_server_is_named_at_start(server, tmp_path):
    (tmp_path / "bad").write_text("nope")
    with pytest.raises(ConfigError, match=f"reward service {server.url}.*401 Unauthorized: the token is wrong"):
        RewardSet.from_config(_data(server.url, tmp_path, reward_token_file=str(tmp_path / "bad")))
    url = f"http://127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(ConfigError, match=f"reward service {url}: the health check.*connection refused"):
        RewardSet.from_config(_data(url, tmp_path, reward_service_timeout_s=1.0))
    assert time.monotonic() - start < 10


def test_a_repeated_request_id_is_scored_once(tmp_path):
    calls = tmp_path / "calls.txt"
    env = {"MOE_RL_TEST_SERVICE_CALLS": str(calls), "MOE_RL_TEST_SERVICE_SLEEP": "0.5"}
    server = Server(tmp_path, [LENGTHS], free_port(), env)
    try:
        samples = [{"response": f"r{i}", "answer": None} for i in range(3)]
        body = json.dumps({"request_id": "same", "step": 1, "samples": samples}).encode()
        answers: list = []
        threads = [
            threading.Thread(target=lambda: answers.append(_get(server.url + "/score", TOKEN, body))) for _ in "12"
        ]
        for t in threads:  # concurrent: the second waits for the first
            t.start()
            time.sleep(0.1)
        for t in threads:
            t.join(timeout=60)
        answers.append(_get(server.url + "/score", TOKEN, body))  # later: from the cache
        assert [a[0] for a in answers] == [200] * 3 and all(a[1] == answers[0][1] for a in answers)
        assert answers[0][1]["rewards"] == [0.5, 0.5, 0.5]
        assert sorted(calls.read_text().split()[1::2]) == ["r0", "r1", "r2"]  # scored once
        assert _get(server.url + "/health", TOKEN)[1]["scored"] == 1
    finally:
        server.kill()


def _records(calls: Path) -> dict[str, list[str]]:
    """{server pid: the responses it scored, in order}."""
    out: dict[str, list[str]] = {}
    for line in calls.read_text().splitlines():
        pid, response = line.split(" ", 1)
        out.setdefault(pid, []).append(response)
    return out


def test_a_killed_server_is_retried_then_restarted_or_named(tmp_path):
    calls, port = tmp_path / "calls.txt", free_port()
    env = {"MOE_RL_TEST_SERVICE_CALLS": str(calls), "MOE_RL_TEST_SERVICE_SLEEP": "0.5"}
    first = Server(tmp_path, [LENGTHS], port, env)
    data = _data(first.url, tmp_path, reward_batch_size=2, reward_service_timeout_s=30.0, reward_retries=100)
    rewards = RewardSet.from_config(data)
    second = None
    try:
        a = [Sample("", None, f"a{i}" + "x" * i, [], None) for i in range(4)]
        assert rewards.score(a, 1).rewards == [len(s.response) / 4 for s in a]  # answered by the first server
        b = [Sample("", None, f"b{i}" + "y" * i, [], None) for i in range(8)]
        box: dict = {}
        scoring = threading.Thread(target=lambda: box.update(scores=rewards.score(b, 2)))
        scoring.start()
        deadline = time.monotonic() + 30
        while not any(line.split()[1].startswith("b") for line in calls.read_text().splitlines()):
            assert time.monotonic() < deadline, "batch b never reached the server"
            time.sleep(0.02)
        first.kill()  # batch b in flight
        time.sleep(1.0)
        second = Server(tmp_path, [LENGTHS], port, env)  # the same port, within data.reward_service_timeout_s
        scoring.join(timeout=60)
        assert not scoring.is_alive()
        scores = box["scores"]
        assert scores.rewards == [len(s.response) / 4 for s in b]  # every sample, in its place: none lost
        assert scores.counts["reward/service_retries"] > 0
        by_server = _records(calls)
        assert len(by_server) == 2
        for responses in by_server.values():  # no server scored a sample twice
            assert len(responses) == len(set(responses))
        later = by_server[str(second.proc.pid)]
        assert not {s.response for s in a} & set(later)  # what the first server answered is not scored again
        assert set(later) | set(by_server[str(first.proc.pid)]) >= {s.response for s in b}
        # killed for good: the retries stop after data.reward_service_timeout_s with the URL named
        quick = RewardSet.from_config(_data(second.url, tmp_path, reward_service_timeout_s=2.0, reward_retries=100))
        second.kill()
        start = time.monotonic()
        with pytest.raises(ServiceError, match=rf"reward service {second.url}: step 3: .*over \d+\.\d s.*refused"):
            quick.score(a, 3)
        assert 2.0 <= time.monotonic() - start < 10.0  # the limit, plus one backoff and a loaded machine's slack
    finally:
        first.kill()
        if second is not None:
            second.kill()
        rewards.close()
