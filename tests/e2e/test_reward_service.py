"""A training run scoring through a reward service (data.reward=http://HOST:PORT, issue 80): launch/train_moe.py for
2 steps of the toy task on one rank with a moe-rl-reward-server started here (the token from $MOE_RL_REWARD_TOKEN);
the rewards it trained on equal the toy reward computed in this process on the rollouts it dumped."""

from __future__ import annotations

import json
import sys

import pytest

from moe_rl.reward.builtin import toy_low_token_reward
from tests.conftest import ONE_ENGINE, run_job
from tests.unit.test_reward_service import TOKEN, Server, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.distributed, pytest.mark.slow]

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "launch/train_moe.py"]


def test_a_run_scored_by_the_service_trains_on_the_in_process_rewards(tmp_path):
    from moe_rl.rollout import dump

    server = Server(tmp_path, ["moe_rl.data.rewards:toy_low_token_reward"], free_port())
    run_dir = tmp_path / "run"
    try:
        overrides = [f"hydra.run.dir={run_dir}", "logging.wandb.mode=disabled", "trainer.checkpoint_every=-1"]
        overrides += ["trainer.steps=2", "trainer.dump_every=1", ONE_ENGINE, f"data.reward={server.url}"]
        out = run_job([*TORCHRUN, *overrides], timeout=600, env={"MOE_RL_REWARD_TOKEN": TOKEN})
    finally:
        server.kill()
    assert f"reward {server.url}: reward service [reward toy_low_token_reward:" in out, out[-4000:]
    history = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [h for h in history if "reward/mean" in h]
    assert [h["step"] for h in steps] == [1, 2]
    for h, step in zip(steps, range(2), strict=True):
        tensors, _ = dump.read(run_dir / "dumps" / f"step_{step:06d}" / "rank_00000.safetensors")
        trained = tensors["rewards"].tolist()
        ids = [row[mask.bool()].tolist() for row, mask in zip(tensors["input_ids"], tensors["loss_mask"], strict=True)]
        assert trained == pytest.approx(toy_low_token_reward([""] * len(ids), [None] * len(ids), ids), abs=1e-6)
        assert h["reward/mean"] == pytest.approx(sum(trained) / len(trained), abs=1e-6)
        assert h["reward/toy_low_token_reward/mean"] == pytest.approx(h["reward/mean"], abs=1e-6)
        assert h["reward/service_retries"] == 0 and len(set(trained)) > 1
