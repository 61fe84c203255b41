"""The RL loop in other parallel layouts: the same samples and the same update as the layout it
is compared to (the oracle for every layout), and learning under TP=2, PP=2 and CP=2.

Runs `torchrun launch/train_moe.py` with the engine in bf16 (so the training-inference mismatch
is ~3e-3, far above fp32 rounding, and `mismatch/*` can be compared relatively) and the actor
in fp32. Sampling seeds and data shards depend only on the step and the data-parallel rank, and
engines sit on the leaders of their data-parallel ranks (rollout/engine_groups.py): TP=2, PP=2
and CP=2 on 2 ranks sample exactly what 1 rank samples; TP=2 x EP=2 on 4 ranks (two engines)
exactly what DP=2 on 2 ranks samples. The DP=2 reference runs as two torchrun agents of one
process each joined by c10d rendezvous on localhost: two simulated nodes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import TORCHRUN, free_port, run_job

pytestmark = [pytest.mark.e2e, pytest.mark.distributed, pytest.mark.slow]

COMMON = ["logging.wandb.mode=disabled", "rollout.dtype=bfloat16", "trainer.checkpoint_every=-1"]  # no saves
EXACT = ("reward/mean", "response/length_mean")  # same samples
CLOSE = ("actor/grad_norm", "actor/entropy", "actor/clipfrac", "mismatch/kl", "mismatch/k3_kl")
REL_TOL = 1e-4
# mismatch/kl (k1) is a signed mean whose per-token terms nearly cancel (-1.1e-3 from terms of about +-0.1 on a CPU
# with AMX): compared absolutely. Layout noise in pi_old moved it by 1.5e-7 (TP=2 there); the bf16 mismatch is 1e-3.
KL_ABS_TOL = 1e-6


def _history(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _train(run_dir: Path, nproc: int, overrides: list[str], timeout: int = 900, env: dict | None = None) -> list[dict]:
    cmd = [*TORCHRUN, "--standalone", f"--nproc-per-node={nproc}", "launch/train_moe.py"]
    run_job([*cmd, f"hydra.run.dir={run_dir}", *COMMON, *overrides], timeout=timeout, env=env)
    return _history(run_dir)


# The toy reward plus a verl-form reward of weight 0 that records its calls (tests/e2e/plugins.py): the run learns
# what it learns without it, and the calls show who scored what.
COUNTED = [
    'data.reward=["moe_rl.data.rewards:toy_low_token_reward","tests.e2e.plugins:count_calls"]',
    "data.reward_weights=[1.0,0.0]",
]
SAMPLES_PER_STEP = 4 * 8  # data.prompts_per_step x sampling.n (the defaults) per data-parallel rank


def _calls(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _train_two_nodes(run_dir: Path, overrides: list[str], calls: Path, timeout: int = 900) -> list[dict]:
    """Two torchrun agents (--nnodes=2 --nproc-per-node=1) meeting through c10d rendezvous; the first hosts its
    store, as launch/slurm/multi_node.sbatch says (on one host torch's guess makes both agents try to)."""
    port = free_port()

    def agent(host: bool) -> str:
        rdzv = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-conf=is_host={str(host).lower()}"]
        args = [*TORCHRUN, "--nnodes=2", "--nproc-per-node=1", *rdzv, "--rdzv-id=moe-rl-two-nodes"]
        args += ["launch/train_moe.py", f"hydra.run.dir={run_dir}", *COMMON, *overrides]
        return " ".join(f"'{a}'" for a in args)

    script = f"{agent(True)} > {run_dir}.node0.log 2>&1 & a=$!; {agent(False)} > {run_dir}.node1.log 2>&1 & b=$!; "
    script += "wait $a; ra=$?; wait $b; rb=$?; cat " + f"{run_dir}.node0.log {run_dir}.node1.log; exit $((ra | rb))"
    run_job(["bash", "-c", script], timeout=timeout, env={"MOE_RL_TEST_REWARD_CALLS": str(calls)})
    return _history(run_dir)


def _assert_same_step(got: dict, ref: dict, where: str) -> None:
    for k in EXACT:
        assert got[k] == ref[k], f"{where}: {k} {got[k]} vs {ref[k]}"
    for k in CLOSE:
        tol = KL_ABS_TOL if k == "mismatch/kl" else REL_TOL * abs(ref[k])
        assert abs(got[k] - ref[k]) <= tol, f"{where}: {k} {got[k]} vs {ref[k]}"
    assert abs(got["router/agreement"] - ref["router/agreement"]) <= 1e-3, where
    assert abs(got["actor/first_minibatch_ppo_kl"]) < 1e-4, where  # pi_theta == pi_old, every stage


def _assert_dumps_hold_every_layer(step_dir: Path) -> None:
    """Both pipeline stages' dumps hold the same samples' engine and live routes for every MoE layer (each stage
    replayed only its own layers; the dump gathers the others), and the live routes are real on every layer."""
    from moe_rl.rollout import dump
    from moe_rl.routing.compare import route_sets_differ, routed_positions

    (first, meta), (second, _) = (dump.read(f) for f in sorted(step_dir.glob("rank_*.safetensors")))
    layers = len(meta["model"]["moe_layers"])
    for key in ("routes", "routes_live"):
        assert first[key].shape[2] == layers and (first[key] == second[key]).all(), key
    valid = routed_positions(first["attention_mask"])
    differ, _ = route_sets_differ(first["routes_live"][valid], first["routes"][valid])
    agreement = 1 - differ.double().mean(0)  # per MoE layer: the actor's own routing vs the bf16 engine's
    assert (agreement > 0.8).all(), agreement


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> dict:
    return _train(tmp_path_factory.mktemp("w1"), 1, ["trainer.steps=1"])[0]


@pytest.mark.parametrize("layout", ["parallel.tp=2", "parallel.pp=2", "parallel.cp=2"])
def test_tp2_pp2_and_cp2_learn_and_step_1_equals_one_rank(layout, one_rank, tmp_path):
    pp = layout == "parallel.pp=2"  # each stage gets (and replays) its own layers' routes; dumps hold every layer's
    # the default job length (30 steps), as the issue states it: at 20 steps TP=2 learned 2.02x, too near the bound
    tp = layout == "parallel.tp=2"  # counts the reward's calls: each sample once per step, on one rank of the two
    extra = [*(["trainer.dump_every=10"] if pp else []), *(COUNTED if tp else [])]
    calls = tmp_path / "reward_calls.jsonl"
    history = _train(tmp_path, 2, [layout, "trainer.steps=30", *extra], env={"MOE_RL_TEST_REWARD_CALLS": str(calls)})
    if tp:  # data-parallel size 1: 30 steps x 32 samples, every call from rank 0, none for anything but training
        got = _calls(calls)
        assert len(got) == 30 * SAMPLES_PER_STEP and {c["rank"] for c in got} == {"0"}, len(got)
        assert {c["source"] for c in got} == {"toy"}
        assert all(h["reward/count_calls/mean"] == 0.0 and h["reward/timeouts"] == 0 for h in history)
        assert all(h["reward/toy/mean"] == h["reward/mean"] for h in history)
    if pp:
        _assert_dumps_hold_every_layer(tmp_path / "dumps" / "step_000000")
        # both stages dump data-parallel rank 0's 32 samples; moe-rl-diagnose offline pools them once (it counted 64)
        from moe_rl.diagnostics.report import load_dumps

        pooled, metas, _ = load_dumps(tmp_path / "dumps", step=0)
        assert [m["dp_rank"] for m in metas] == [0, 0] and pooled["input_ids"].shape[0] == 32
        # training on those dumps under PP=2 (each stage keeps its layers' routes) repeats step 1's update
        again = _train(
            tmp_path / "from_dump",
            2,
            [layout, "trainer.steps=1", "trainer.mode=from_dump", f"trainer.dump_dir={tmp_path / 'dumps'}"],
        )
        for k in ("actor/grad_norm", "actor/entropy", "actor/clipfrac"):
            assert again[0][k] == pytest.approx(history[0][k], rel=1e-6), k
    # bf16 engine: a mismatch well above fp32 noise (k3: never negative; the k1 estimate `mismatch/kl` can be, and was
    # -1.1e-3 on a CPU with AMX where k3 was 3.3e-3)
    assert one_rank["mismatch/k3_kl"] > 1e-4
    _assert_same_step(history[0], one_rank, layout)
    first = sum(h["reward/mean"] for h in history[:5]) / 5
    last = sum(h["reward/mean"] for h in history[-5:]) / 5
    print(f"\n{layout}: mean reward first 5 steps {first:.3f}, last 5 steps {last:.3f}")
    assert last >= 2 * first
    assert all(h["actor/skipped_steps"] == 0 for h in history)
    assert max(abs(h["actor/first_minibatch_ppo_kl"]) for h in history) < 1e-4
    assert not (tmp_path / "checkpoints").exists()  # trainer.checkpoint_every=-1: not even the last step's save


def test_tp2_ep2_on_4_ranks_equals_dp2_on_two_nodes(tmp_path):
    calls = tmp_path / "reward_calls.jsonl"
    reference = _train_two_nodes(tmp_path / "dp2_two_nodes", ["trainer.steps=1", *COUNTED], calls)
    assert reference[0]["step"] == 1
    by_rank = [[c["response"] for c in _calls(calls) if c["rank"] == r] for r in ("0", "1")]
    assert [len(r) for r in by_rank] == [SAMPLES_PER_STEP] * 2  # each data-parallel rank scores its own 32 samples
    history = _train(tmp_path / "tp2_ep2", 4, ["parallel.tp=2", "parallel.ep=2", "trainer.steps=2"])
    assert len(history) == 2
    _assert_same_step(history[0], reference[0], "tp=2 x ep=2 vs dp=2")


def test_an_engine_with_tensor_parallelism_serves_the_tp2_actor(one_rank, tmp_path):
    """rollout.tensor_parallel_size=2: one engine whose two workers each hold a shard. Its routes replay exactly,
    the actor's own routing agrees with them as with the TP=1 engine's, and its log-probs stay as close to the
    actor's as the TP=1 engine's, before and after a weight sync (a sync that left one worker's shard stale would
    put step 2 far off)."""
    history = _train(tmp_path, 2, ["parallel.tp=2", "rollout.tensor_parallel_size=2", "trainer.steps=2"])
    assert len(history) == 2
    for h in history:
        assert h["router/replay_mismatches"] == 0  # the captured routes replay exactly
        if "router/agreement" in h:  # step 1 (logging.router_agreement_every)
            assert h["router/agreement"] > one_rank["router/agreement"] - 0.02  # bf16 engine: ~3% disagree
        assert abs(h["actor/first_minibatch_ppo_kl"]) < 1e-4
        k3, one = h["mismatch/k3_kl"], one_rank["mismatch/k3_kl"]
        assert k3 < 10 * one, (h["step"], k3, one)  # the TP=2 engine's mismatch is of the TP=1 engine's order
