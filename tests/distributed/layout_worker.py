"""torchrun worker (2 ranks): our route slicing vs megatron-core's own token slicing.

- sequence parallel: megatron's `scatter_to_sequence_parallel_region` on `[S, B, 1]` tokens;
- context parallel: megatron's `get_batch_on_this_cp_rank` (zig-zag) on `[B, S]` tokens.
Routes are built as a function of (sample, position) so equality proves they land together.
"""

import json
import os
import sys
from pathlib import Path

import torch


def main(out: Path) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import scatter_to_sequence_parallel_region
    from megatron.core.utils import get_batch_on_this_cp_rank

    from moe_rl.actor.config import ParallelConfig
    from moe_rl.actor.parallel import init_distributed
    from moe_rl.routing.layout import rank_positions, slice_sequence, to_router_order

    b, s = 3, 16
    tokens = torch.arange(b * s).reshape(b, s)  # token id = b * S + position
    routes = torch.stack([tokens, tokens + 1000], dim=-1)[:, :, None, :]  # [B, S, L=1, K=2]
    for kind, parallel in (("sp", ParallelConfig(tp=2)), ("cp", ParallelConfig(cp=2))):
        init_distributed(parallel)
        if kind == "sp":
            theirs = scatter_to_sequence_parallel_region(tokens.t().unsqueeze(-1).float())  # [S/tp, B, 1]
            theirs = theirs.squeeze(-1).long().reshape(-1)  # router order s * B + b
        else:
            theirs = to_router_order(get_batch_on_this_cp_rank({"tokens": tokens.clone()})["tokens"])
        pos = rank_positions(
            s,
            tp=ps.get_tensor_model_parallel_world_size(),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            cp=ps.get_context_parallel_world_size(),
            cp_rank=ps.get_context_parallel_rank(),
            sequence_parallel=kind == "sp",
        )
        mine = to_router_order(slice_sequence(routes, pos)[:, :, 0])  # [s_local * B, K]
        equal = bool(torch.equal(mine[:, 0], theirs) and torch.equal(mine[:, 1], theirs + 1000))
        (out / f"{kind}.rank{dist.get_rank()}.json").write_text(json.dumps({"kind": kind, "equal": equal}))
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    from moe_rl.trainer.signals import run_then_exit

    run_then_exit(lambda: main(Path(sys.argv[1])))
