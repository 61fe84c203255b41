"""What travels between the reward service and its clients: the shared token, Samples as JSON, the request and
response bodies.

POST /score  {"request_id": str, "step": int, "samples": [Sample as a JSON object]}
          -> {"request_id", "rewards": [float], "totals": {metric: [sum, count]}, "counts": {metric: n}, "seconds"}
             (the Scores of those samples on the server, without the per-data_source means, which the client forms
             from the combined rewards as an in-process RewardSet does); 422 {"error"}: a reward failed (not retried)
GET /health -> {"status": "ok", "rewards": [the server's RewardSet.describe() lines]}
Every path needs `Authorization: Bearer <token>`; without it: 401.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from moe_rl.reward.sample import Sample

TOKEN_ENV = "MOE_RL_REWARD_TOKEN"
"""The environment variable holding the shared token when data.reward_token_file is empty."""
SAMPLE_FIELDS = tuple(f.name for f in dataclasses.fields(Sample))
SAMPLE_KEYS = frozenset(SAMPLE_FIELDS)


class WireError(ValueError):
    """A token or a sample that cannot travel (the message says which and why)."""


def read_token(path: str, what: str) -> str:
    """The shared token in file `path` (surrounding whitespace stripped); `what` names the setting in errors."""
    try:
        token = Path(path).read_text().strip()
    except OSError as e:
        raise WireError(f"{what}={path}: the token file cannot be read ({e.strerror or e})") from None
    if not token:
        raise WireError(f"{what}={path}: the token file is empty")
    return token


def client_token(token_file: str) -> str:
    """The client's token: data.reward_token_file, else the environment's MOE_RL_REWARD_TOKEN."""
    if token_file:
        return read_token(token_file, "data.reward_token_file")
    token = os.environ.get(TOKEN_ENV, "").strip()
    if not token:
        raise WireError(f"a reward service needs the shared token: set data.reward_token_file or ${TOKEN_ENV}")
    return token


def auth_header(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _plain(value):
    """json.dumps' fallback: arrays and tensors (a parquet row's numpy values) as lists, numpy scalars as numbers."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"a {type(value).__name__} cannot be sent as JSON")


def samples_json(samples: list[Sample], request_id: str, step: int) -> bytes:
    """The body of POST /score."""
    rows = []
    for j, s in enumerate(samples):
        try:
            rows.append(json.dumps({k: getattr(s, k) for k in SAMPLE_FIELDS}, default=_plain))  # asdict: a deep copy
        except (TypeError, ValueError) as e:
            raise WireError(f"sample {j} ({s.where}) cannot be sent to the reward service: its row: {e}") from None
    head = json.dumps({"request_id": request_id, "step": step})[:-1]
    return f'{head}, "samples": [{", ".join(rows)}]}}'.encode()


def samples_of_json(body: dict) -> tuple[str, int, list[Sample]]:
    """(request_id, step, Samples) of a POST /score body; WireError naming what is missing or wrong."""
    if not isinstance(body, dict) or not isinstance(body.get("request_id"), str) or not body["request_id"]:
        raise WireError("the body needs a non-empty string request_id")
    samples = body.get("samples")
    if not isinstance(samples, list):
        raise WireError("the body needs samples: a list of Sample objects")
    out = []
    for j, s in enumerate(samples):
        if not isinstance(s, dict) or not SAMPLE_KEYS >= set(s) or "response" not in s:
            extra = sorted(set(s) - SAMPLE_KEYS) if isinstance(s, dict) else type(s).__name__
            raise WireError(f"samples[{j}]: not a Sample (fields {sorted(SAMPLE_KEYS)}; got {extra})")
        out.append(Sample(**{"prompt": "", "prompt_messages": None, "response_ids": [], "answer": None} | s))
    return body["request_id"], int(body.get("step", 0)), out
