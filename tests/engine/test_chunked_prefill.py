"""Chunked prefill of seeded requests on CPU (rollout.max_num_batched_tokens): vLLM 0.32 rewinds a chunked request's
generator by Philox offset, which a CPU generator lacks; moe_rl.compat.vllm.keep_seeded_samples_across_chunks rewinds
it by state. A budget below every prompt's length (each prefilled in chunks) samples what an unchunked engine does."""

from __future__ import annotations

import numpy as np
import pytest

from moe_rl.rollout.config import SamplingConfig

pytestmark = pytest.mark.engine

CHUNKED = 64  # tokens per engine step: below every prompt's length
WHOLE = 16384  # every request of the step in one prefill


def test_chunked_prefill_samples_what_a_whole_prefill_samples(engines):
    seed = int(np.random.SeedSequence().entropy % 2**31)  # fresh inputs each run; printed to reproduce a failure
    print(f"\nprompt seed {seed}")
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 500, size=int(n)).tolist() for n in rng.integers(CHUNKED + 40, 300, size=4)]
    sampling = SamplingConfig(n=4, max_tokens=16, seed=int(rng.integers(0, 1000)))
    whole = engines("qwen3_moe", max_num_batched_tokens=WHOLE).generate(prompts, sampling)
    chunked = engines("qwen3_moe", max_num_batched_tokens=CHUNKED).generate(prompts, sampling)
    assert sum(len(p) for p in prompts) * sampling.n <= WHOLE
    assert chunked.response_ids == whole.response_ids
    # most samples run their full length (a random model samples its end-of-text token now and then), so the
    # comparison covers the decode steps after the chunked prefill, not only the first token
    assert sum(len(r) for r in whole.response_ids) >= 0.75 * len(whole.response_ids) * sampling.max_tokens
    # chunks attend over the cached keys in another summation order: fp32 rounding, measured up to 1.5e-5 (CI,
    # prompt seed 609289557), far below what another token in the context would change
    for i, (a, b) in enumerate(zip(chunked.rollout_logprobs, whole.rollout_logprobs, strict=True)):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0, err_msg=f"sample {i}")
    # routes captured across a request's chunks are placed by position: the same rows (fp32; a near-tie may flip)
    pairs = zip(chunked.routes, whole.routes, strict=True)
    same = sum(int((np.sort(a, -1) == np.sort(b, -1)).all(-1).sum()) for a, b in pairs)
    rows = sum(a.shape[0] * a.shape[1] for a in whole.routes)
    assert same >= rows - 2, (same, rows)
