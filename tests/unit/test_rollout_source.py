"""trainer.mode=from_dump: a dump that does not fit the run's config is refused, naming why."""

from __future__ import annotations

import pytest
import torch

from moe_rl.rollout import dump
from moe_rl.rollout.source import DumpSource
from tests.unit.test_diagnostics import FINGERPRINT, _synthetic


def _training_dump(root, n: int):
    tensors = _synthetic(root)
    path = dump.rank_file(root, 0, 0)
    t, meta = dump.read(path)
    t["rewards"] = torch.tensor([1.0, 0.0])
    dump.write(path, t, {**meta, "n": n, "router_replay": "r3"})
    return tensors


def test_dump_source_gives_the_dumped_batch(tmp_path, world1):
    tensors = _training_dump(tmp_path, n=2)
    rollout = DumpSource(tmp_path, FINGERPRINT, group_size=2, mini_batches=2, router_replay="r3").next(0)
    assert torch.equal(rollout.padded.input_ids, tensors["input_ids"]) and torch.equal(
        rollout.padded.routes, tensors["routes"]
    )
    assert rollout.rewards.tolist() == [1.0, 0.0] and rollout.response_lengths.tolist() == [2, 2]
    assert rollout.policy_version.tolist() == [0, 0]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(group_size=4), "sampled 2 responses per prompt, sampling.n=4"),
        (dict(mini_batches=3), "2 samples on rank 0 are not divisible into actor.mini_batches=3"),
    ],
)
def test_dump_that_does_not_fit_the_config_is_refused(tmp_path, world1, kwargs, match):
    _training_dump(tmp_path, n=2)
    args = dict(group_size=2, mini_batches=1, router_replay="r3") | kwargs
    with pytest.raises(dump.DumpError, match=match):
        DumpSource(tmp_path, FINGERPRINT, **args).next(0)
