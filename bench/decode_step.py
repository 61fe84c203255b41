"""What one engine decode step costs against how many samples it decodes, printed as JSON: the reason a step's
longest sample costs a CPU engine little (bench/inflight.py, docs/performance.md).

A synchronous or one-step-ahead step waits for its longest sample; while it finishes, the engine decodes a batch
that shrinks to one sample. On a GPU a decode step is bound by reading the weights and costs about the same for 1
sample as for 128, so that tail is idle hardware and in-flight rollouts win it back. Here the step's cost grows with
its batch; this measures by how much. One moe-rl engine (route capture on, fp32 as the CPU runs use) on one core,
the bench's model (the `small` tiny model, 10.9M parameters), a 12-token prompt; each batch size decodes 8 and then
72 tokens a sample (EOS ignored) and the difference over 64 steps is one step's cost.

  python bench/decode_step.py                       # ~1 minute on one core
  python bench/decode_step.py --batches 1 8 64 256
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")  # keep stdout for the JSON result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    p.add_argument("--core", type=int, default=1, help="the one CPU core the engine runs on (its processes inherit it)")
    a = p.parse_args()
    os.sched_setaffinity(0, {a.core})

    from transformers import AutoConfig
    from vllm import SamplingParams

    from moe_rl.models.tiny import SIZES, TinySpec, build_tiny_model
    from moe_rl.rollout.config import RolloutConfig
    from moe_rl.rollout.engine import RolloutEngine
    from moe_rl.routing.model_layout import moe_layout

    spec = TinySpec(**SIZES["small"])
    path = build_tiny_model(spec, Path(tempfile.mkdtemp(prefix="moe-rl-bench-")) / "model")
    lay = moe_layout(AutoConfig.from_pretrained(path))
    prompt = {"prompt_token_ids": list(range(5, 17))}
    steps: dict[int, float] = {}
    cfg = RolloutConfig(model=str(path), dtype="float32", capture="hook")
    with RolloutEngine(cfg, lay.moe_layers, lay.num_experts, lay.topk) as eng:
        for batch in a.batches:
            took = {}
            for tokens in (8, 72):
                params = SamplingParams(max_tokens=tokens, ignore_eos=True, seed=0)
                eng.llm.generate([prompt] * batch, params, use_tqdm=False)  # warm: this batch's shapes
                t0 = time.perf_counter()
                eng.llm.generate([prompt] * batch, params, use_tqdm=False)
                took[tokens] = time.perf_counter() - t0
            steps[batch] = (took[72] - took[8]) / 64
    full = max(a.batches)
    out = {
        "model": {"size": "small", **SIZES["small"]},
        "ms_per_step": {b: round(s * 1e3, 2) for b, s in steps.items()},
        "ms_per_sample_token": {b: round(s * 1e3 / b, 3) for b, s in steps.items()},
        # a step of one sample against one of the full batch: on a GPU about 1 (the tail costs a whole step each)
        "one_over_full_step": steps[min(a.batches)] / steps[full],
        "full_batch": full,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
