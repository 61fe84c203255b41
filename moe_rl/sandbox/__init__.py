"""A sandbox for untrusted programs (model-written code): each run in bubblewrap with no network, its own PID
namespace, a read-only /usr and a private /tmp, under an unprivileged uid with limits on wall time, CPU, memory,
processes, open files and output. Torch-free. docs/guides/sandbox.md."""

from moe_rl.sandbox.config import Limits, SandboxConfig
from moe_rl.sandbox.pool import Job, SandboxPool, configure, shared_pool
from moe_rl.sandbox.runner import STATUSES, RunResult, SandboxUnavailable, check_available, run_program

__all__ = [
    "STATUSES",
    "Job",
    "Limits",
    "RunResult",
    "SandboxConfig",
    "SandboxPool",
    "SandboxUnavailable",
    "check_available",
    "configure",
    "run_program",
    "shared_pool",
]
