"""torchrun worker: one independent vLLM engine per rank next to the Megatron process groups.

torchrun --nproc-per-node=2 -m tests.engine.rank_engine_worker MODEL OUT_DIR
"""

import json
import os
import signal
import sys
from pathlib import Path


def main(model: str, out: Path) -> None:
    import torch
    import torch.distributed as dist

    from moe_rl.actor.config import ParallelConfig
    from moe_rl.actor.parallel import destroy_distributed, init_distributed
    from moe_rl.rollout.config import SamplingConfig
    from tests.engine.conftest import start_engine
    from tests.engine.test_rollout_engine import _compare_with_hf, _prompts
    from tests.reference import load_hf

    init_distributed(ParallelConfig())
    rank = dist.get_rank()
    signal.signal(signal.SIGUSR1, lambda *_: None)  # as the trainer's StopFlag does: not the engine's to keep
    eng = start_engine(model)
    try:
        prompts = _prompts(seed=100 + rank, count=8)  # each rank its own prompts
        batch = eng.generate(prompts, SamplingConfig(n=4, max_tokens=8, seed=rank))
        bad, rows, lp_diff = _compare_with_hf(batch, load_hf(model), eng.moe_layers)
        dist.barrier()  # the gloo world still works next to the engine
        t = torch.tensor([float(rows)])
        dist.all_reduce(t)
        (out / f"rank{rank}.json").write_text(
            json.dumps(
                {
                    "rank": rank,
                    "bad": bad,
                    "rows": rows,
                    "lp_diff": lp_diff,
                    "total_rows": t.item(),
                    "first_prompt": batch.prompt_ids[0],
                    "forked": eng.rpc("moe_rl_forked_from_trainer"),
                    "engine_sigusr1": eng.rpc("moe_rl_signal_handler", "SIGUSR1"),
                    "sampler_compiled": eng.rpc("moe_rl_sampler_compiled"),
                }
            )
        )
    finally:
        eng.shutdown()
        destroy_distributed()


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    main(sys.argv[1], Path(sys.argv[2]))
