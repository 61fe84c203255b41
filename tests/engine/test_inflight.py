"""In-flight weight updates on a CPU engine (moe_rl/rollout/inflight.py): requests keep running across updates
(keep mode) or are aborted and continued from their prefix (abort mode, partial rollouts).

- Keep updates that load the same weights change no sample: tokens, log-probs and routes are a synchronous
  `RolloutEngine.generate`'s with the same seeds, bit for bit (the engine's CPU ops are batch-invariant, so the
  prefill after an update computes what decoding did), while every sample's tokens carry the versions 0, 1, 2.
  With an abort update instead, each sample's prefix up to the abort is the synchronous run's (its continuation is
  seeded anew).
- Updates that change the weights, a keep update then an abort update: every token's log-prob mu and every
  position's routes are those the version recorded for it computes, bit for bit, re-derived by the engine-op forward
  (the engine's own kernels, one sequence at a time: actor/engine_ops.py) under that version's weights; under the
  first version's weights the later positions route differently (the check can fail), and most samples span both a
  pause-resume and an abort-continue.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from moe_rl.common.batch import RolloutBatch
from moe_rl.rollout.config import SamplingConfig
from moe_rl.rollout.inflight import InflightEngine, route_versions
from moe_rl.weight_sync import push_weights

pytestmark = pytest.mark.engine

STEPS_BETWEEN_UPDATES = 4  # engine steps (decode steps of the batch) before each of the two updates


@pytest.fixture(scope="module")
def setup(tiny_models):
    """(engine, model path, prompts, sampling, W0): an fp32 engine with split-KV attention off, as the engine-op
    forward reproduces it."""
    from moe_rl.actor.weights import HFCheckpoint
    from tests.engine.conftest import start_engine

    path = tiny_models["qwen3_moe"]
    before = os.environ.get("VLLM_CPU_ATTN_SPLIT_KV")
    os.environ["VLLM_CPU_ATTN_SPLIT_KV"] = "0"
    try:
        engine = start_engine(path, "float32")
    finally:
        if before is None:
            del os.environ["VLLM_CPU_ATTN_SPLIT_KV"]
        else:
            os.environ["VLLM_CPU_ATTN_SPLIT_KV"] = before
    seed = int(np.random.SeedSequence().entropy % 2**31)  # fresh inputs each run; printed to reproduce a failure
    print(f"\nprompt seed {seed}")
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 500, size=int(n)).tolist() for n in rng.integers(4, 60, size=5)]
    sampling = SamplingConfig(n=3, max_tokens=20, seed=int(rng.integers(0, 1000)))
    ckpt = HFCheckpoint(path)
    try:
        yield engine, path, prompts, sampling, {k: ckpt.get(k) for k in ckpt.weight_map}
    finally:
        engine.shutdown()


def _run_inflight(engine, prompts, sampling, updates: list[dict], aborts: list[bool]) -> dict[tuple[int, int], tuple]:
    """Submit every prompt, run STEPS_BETWEEN_UPDATES engine steps before each update (version 1, 2, ...; update i
    aborts its running samples if aborts[i]), then to the end: {(prompt, sample): (response ids, mu, versions,
    routes)}."""
    inflight = InflightEngine(engine)
    for i, p in enumerate(prompts):
        inflight.submit(i, p, sampling, sampling.seed + i)
    got: dict[tuple[int, int], tuple] = {}

    def take(keys, batch: RolloutBatch | None) -> None:
        for r in range(len(batch) if batch is not None else 0):
            key = (keys[int(batch.prompt_index[r])], int(batch.sample_index[r]))
            got[key] = (batch.response_ids[r], batch.rollout_logprobs[r], batch.versions[r], batch.routes[r])

    for version, (weights, abort) in enumerate(zip(updates, aborts, strict=True), start=1):
        take(*inflight.poll(max_steps=STEPS_BETWEEN_UPDATES))
        inflight.update_weights(lambda w=weights: push_weights(engine, w.items()), version, abort=abort)
    while inflight.running:
        take(*inflight.poll())
    assert len(got) == len(prompts) * sampling.n
    return got


@pytest.mark.parametrize("abort", [False, True], ids=["keep", "abort"])
def test_updates_with_the_same_weights_change_no_sample(setup, abort):
    engine, _, prompts, sampling, w0 = setup
    sync = engine.generate(prompts, sampling)
    got = _run_inflight(engine, prompts, sampling, [w0, w0], [False, abort])
    spans = 0
    for r in range(len(sync)):
        ids, mu, versions, routes = got[(int(sync.prompt_index[r]), int(sync.sample_index[r]))]
        assert (np.diff(versions) >= 0).all() and set(versions) <= {0, 1, 2}
        assert len(ids) == len(mu) == len(versions) == len(routes) - len(sync.prompt_ids[r]) <= sampling.max_tokens
        spans += len(set(versions)) == 3
        # abort: the synchronous sample up to the abort (tokens of versions 0, 1, their input positions' routes)
        k = int((versions < 2).sum()) if abort else len(sync.response_ids[r])
        assert ids[:k] == sync.response_ids[r][:k], r
        assert np.array_equal(mu[:k], sync.rollout_logprobs[r][:k]), r
        rows = len(sync.prompt_ids[r]) + k - 1
        assert np.array_equal(routes[:rows], sync.routes[r][:rows]), r
        if not abort:
            assert ids == sync.response_ids[r], r
    print(f"\n{spans}/{len(sync)} samples have tokens of all three versions")
    assert spans >= len(sync) // 2  # most samples ran across both updates (a few end early on their EOS token)
    if abort:  # the continuations were sampled anew (their own seeds): somewhere after the abort the tokens differ
        assert any(
            got[(int(sync.prompt_index[r]), int(sync.sample_index[r]))][0] != sync.response_ids[r]
            for r in range(len(sync))
        )


def _perturbed(weights: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """The weights with noise on the router gates and attention projections, enough to change routes."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, t in weights.items():
        if k.endswith(("mlp.gate.weight", "q_proj.weight", "o_proj.weight")):
            t = t + 0.5 * t.std() * torch.randn(t.shape, generator=g)
        out[k] = t
    return out


def test_every_token_keeps_the_mu_and_routes_of_its_version(setup):
    from transformers import AutoConfig

    from moe_rl.actor.engine_ops import EngineOpForward

    engine, path, prompts, sampling, w0 = setup
    weights = [w0, _perturbed(w0, 1), None]
    weights[2] = _perturbed(weights[1], 2)
    try:
        got = _run_inflight(engine, prompts, sampling, weights[1:], [False, True])
    finally:
        push_weights(engine, w0.items())
    m = EngineOpForward(AutoConfig.from_pretrained(path), torch.float32)
    tokens = {v: 0 for v in range(3)}
    moved = 0  # positions computed by a later version whose routes under version 0's weights differ
    for v, w in enumerate(weights):
        m.load(w, v)
        for (i, _), (ids, mu, versions, routes) in got.items():
            seq = torch.tensor(prompts[i] + ids)
            out = m.logprobs(seq[None], torch.ones(1, len(seq)))
            p = len(prompts[i])
            mine = versions == v
            assert torch.equal(out["logprobs"][0, p:][torch.from_numpy(mine)], torch.from_numpy(mu[mine])), (i, v)
            tokens[v] += int(mine.sum())
            rows = route_versions(p, versions)
            computed = out["routes"][0, : len(seq) - 1].numpy()
            assert np.array_equal(computed[rows == v], routes[: len(seq) - 1][rows == v]), (i, v)
            if v == 0:
                moved += int((computed[rows > 0] != routes[: len(seq) - 1][rows > 0]).any(-1).any(-1).sum())
    both = sum(len(set(versions)) == 3 for _, _, versions, _ in got.values())  # a pause-resume and an abort-continue
    print(
        f"\ntokens per version {tokens}; {moved} later positions route otherwise under version 0; {both}/{len(got)} "
        "samples span both updates"
    )
    assert min(tokens.values()) > 0 and moved > 0 and both >= len(got) // 2


def test_an_error_of_a_command_nobody_waits_for_is_raised_by_the_next_wait(setup):
    """The in-flight source's engine thread (rollout/inflight_source.py): a submit nobody waits for (every submit: a
    step's new prompts, a dropped group's resample) that fails ends the thread, and the trainer's next wait raises
    that error instead of waiting for a group that never comes."""
    import contextlib

    from moe_rl.rollout.inflight_source import _Driver

    engine, _, prompts, sampling, _ = setup
    driver = _Driver(InflightEngine(engine), None)
    try:
        too_long = [1] * engine.llm.llm_engine.model_config.max_model_len
        driver.call(lambda: driver.engine.submit("x", too_long, sampling, 0), wait=False)
        with pytest.raises(ValueError, match="submit 'x': .* prompt tokens"):
            driver.wait(lambda new: False, contextlib.nullcontext)
    finally:
        driver.close()
