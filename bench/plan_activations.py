"""moe-rl-plan's activation estimate against a measured peak on CPU, printed as JSON.

The planner's activation row (moe_rl/plan/memory.py: Korthikanti et al. 2022 as Megatron-LM writes it) is an
estimate. This builds the arithmetic recipe's model (10.9M, 6 MoE layers; `tiny_model --size small`) as the trainer's
Actor in one process (world 1, fp32, no Transformer Engine: megatron's local attention keeps its score matrices),
trains it once on one padded micro-batch of `rows` rows of `tokens` tokens, each shape in a fresh process, and
measures the update's memory above the process's resident memory before it: the kernel's high-water mark (VmHWM,
reset through /proc/self/clear_refs) minus VmRSS. That first update also allocates the gradients and AdamW's two
moments (3 x the parameters' bytes, from their sizes); what is left is the activations and the update's temporaries.
Per shape: the measured rise, the rise less those states, the planner's activation + logits rows, and their ratio.

  python bench/plan_activations.py                       # micro-batches of 1 and 4 rows x 128 and 512 tokens
  python bench/plan_activations.py --shapes 8x256 2x1024
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def _status(key: str) -> int:
    """/proc/self/status's `key` in bytes."""
    with open("/proc/self/status") as f:
        return int(re.search(rf"{key}:\s+(\d+) kB", f.read()).group(1)) * 1024


def measure(model: str, rows: int, seq: int) -> dict:
    """One shape in this process (a fresh one): the first update's memory rise and the planner's rows."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    sys.path.insert(0, str(REPO))
    from moe_rl.actor.actor import Actor
    from moe_rl.actor.config import ParallelConfig
    from moe_rl.actor.parallel import init_distributed
    from moe_rl.common.batch import PaddedBatch
    from moe_rl.config import AlgorithmConfig, ModelConfig
    from moe_rl.objectives import Objective
    from moe_rl.plan.layout import build_config, layout_of
    from moe_rl.plan.memory import activations, trainer_table
    from moe_rl.plan.params import count, stage_layers
    from moe_rl.plan.spec import load_spec

    torch.set_num_threads(2)
    init_distributed(ParallelConfig(), seed=5)
    spec = load_spec(model)
    keys = [f"actor.micro_batch_size={rows}", "actor.packing=false", "actor.mini_batches=1", "actor.router_replay=off"]
    keys += [f"data.prompts_per_step={rows}", "sampling.n=1"]
    keys += [f"data.max_prompt_tokens={seq // 2}", f"sampling.max_tokens={seq - seq // 2}"]
    cfg = build_config(keys)
    layout = layout_of(cfg, 1)
    estimate = activations(spec, cfg, layout, stage_layers(spec.num_layers, 1, None, 0), 0, seq)
    logits = next(r.bytes for r in trainer_table(spec, count(spec), cfg, layout, 0).rows if r.name == "log-prob logits")
    actor = Actor(cfg.actor, ModelConfig(), ParallelConfig(), model, record_routes=False)
    g = torch.Generator().manual_seed(seq * 7 + rows)
    ids = torch.randint(3, spec.vocab_size, (rows, seq), generator=g)
    mask = torch.zeros(rows, seq)
    mask[:, seq // 2 :] = 1
    batch = PaddedBatch(ids, torch.ones(rows, seq, dtype=torch.long), mask, torch.zeros(rows, seq), None)
    old = actor.old_logprobs(batch)
    batch.rollout_logprobs = old.logprobs.clone()
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    actor.train(batch, old, torch.randn(rows, generator=g), Objective(AlgorithmConfig(), 1), on_skip=lambda s, i: s)
    rise = _status("VmHWM") - before
    states = 3 * sum(q.numel() * q.element_size() for c in actor.chunks for q in c.parameters())
    return {
        "rows": rows,
        "tokens": seq,
        "measured_rise_bytes": rise,
        "gradient_and_adam_bytes": states,
        "estimate_activations_bytes": estimate,
        "estimate_logits_bytes": logits,
        "measured_less_states_over_estimate": round((rise - states) / (estimate + logits), 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["1x128", "4x128", "1x512", "4x512"], help="ROWSxTOKENS")
    p.add_argument("--one", help=argparse.SUPPRESS)  # ROWSxTOKENS: measure one shape in this process
    p.add_argument("--model", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        print(json.dumps(measure(a.model, *map(int, a.one.split("x")))))
        return
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model = str(Path(tmp) / "small")
        subprocess.run([sys.executable, "-m", "moe_rl.tools.tiny_model", "--size", "small", "--out", model],
                       cwd=REPO, check=True, capture_output=True)  # fmt: skip
        for shape in a.shapes:
            cmd = [sys.executable, __file__, "--one", shape, "--model", model]
            out = subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, text=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            results.append(r)
            rise, states = r["measured_rise_bytes"] / 2**20, r["gradient_and_adam_bytes"] / 2**20
            est = (r["estimate_activations_bytes"] + r["estimate_logits_bytes"]) / 2**20
            print(f"[plan_activations] {shape}: rise {rise:.1f} MiB, less gradients and Adam {rise - states:.1f} MiB; "
                  f"planner {est:.1f} MiB", file=sys.stderr, flush=True)  # fmt: skip
    print(json.dumps({"model": "tiny_model --size small (10.9M, fp32, world 1)", "shapes": results}))


if __name__ == "__main__":
    main()
