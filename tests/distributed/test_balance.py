"""trainer.balance_batch: whole GRPO groups move between data-parallel ranks by token count.

The assignment is checked on random costs; the exchange on 2 gloo ranks whose rollouts differ in
size (tensors, routes, prompts and per-sample lists travel together, groups stay whole and in order).
That balancing changes no step result is checked end to end in tests/e2e/test_packing_runs.py.
"""

from __future__ import annotations

import random

import pytest
import torch

from moe_rl.rollout.balance import assign_groups
from tests.conftest import torchrun
from tests.distributed.balance_worker import GROUPS, MINI_BATCHES, N


def test_assignment_keeps_counts_and_never_raises_the_heaviest_rank():
    rng = random.Random()
    for _ in range(200):
        ranks, per = rng.randint(1, 6), rng.randint(1, 8)
        costs = [[int(rng.lognormvariate(4, 1)) + 1 for _ in range(per)] for _ in range(ranks)]
        plan = assign_groups(costs)
        assert sorted(p for pairs in plan for p in pairs) == sorted((s, g) for s in range(ranks) for g in range(per))
        assert all(len(pairs) == per and pairs == sorted(pairs) for pairs in plan)
        loads = [sum(costs[s][g] for s, g in pairs) for pairs in plan]
        assert max(loads) <= max(sum(c) for c in costs)
        assert assign_groups(costs) == plan  # every rank computes the same plan
    balanced = [[10, 1], [9, 2]]  # already balanced: nothing moves
    assert assign_groups(balanced) == [[(0, 0), (0, 1)], [(1, 0), (1, 1)]]
    assert assign_groups([[50, 40], [1, 2]]) == [[(0, 0), (1, 0)], [(0, 1), (1, 1)]]


@pytest.mark.distributed
def test_two_ranks_exchange_whole_groups_and_even_out_tokens(tmp_path):
    torchrun("tests.distributed.balance_worker", 2, [str(tmp_path)])
    runs = [torch.load(tmp_path / f"rank_{r}.pt", weights_only=False) for r in range(2)]
    before = {(r, g): _group(runs[r]["before"], g) for r in range(2) for g in range(GROUPS)}
    after = [_group(runs[r]["after"], g) for r in range(2) for g in range(GROUPS)]
    # every group arrives exactly once, whole: its tokens, routes, log-probs, prompt and per-sample fields
    assert sorted(a["key"] for a in after) == sorted(b["key"] for b in before.values())
    per = GROUPS // MINI_BATCHES  # and in the mini-batch it came from
    assert {a["key"] for a in after if (after.index(a) % GROUPS) < per} == {
        b["key"] for (r, g), b in before.items() if g < per
    }
    for a in after:
        b = next(b for b in before.values() if b["key"] == a["key"])
        for k in b:
            assert _same(a[k], b[k]), k
    tokens = [int(run[w].padded.attention_mask.sum()) for run in runs for w in ("before", "after")]
    assert max(tokens[1], tokens[3]) < max(tokens[0], tokens[2])  # the heavier rank got lighter
    m = runs[0]["metrics"]
    assert m == runs[1]["metrics"] and m["perf/dp_groups_moved"] > 0
    assert m["perf/dp_token_imbalance"] == pytest.approx(max(tokens[1], tokens[3]) / ((tokens[1] + tokens[3]) / 2))


def _group(r, g):
    rows = slice(g * N, (g + 1) * N)
    prompts = {r.prompts[i].text for i in r.prompt_index[rows]}
    assert len(prompts) == 1  # a group's samples share their prompt after re-indexing too
    p = r.padded
    return {
        "key": prompts.pop(),
        "ids": p.input_ids[rows],
        "attn": p.attention_mask[rows],
        "loss": p.loss_mask[rows],
        "mu": p.rollout_logprobs[rows],
        "routes": p.routes[rows],
        "version": r.policy_version[rows],
        "lengths": r.response_lengths[rows],
        "responses": r.response_ids[rows],
        "rewards": r.rewards[rows],
        "truncated": r.truncated[rows],
    }


def _same(a, b) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
