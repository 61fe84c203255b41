"""A rank's lifetime: stop requests (Slurm preemption, torchrun shutdown and the launcher's death become a
checkpoint at the next step boundary) and its exit."""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager

import torch
import torch.distributed as dist

from moe_rl.rollout.engine import RolloutEngineError


class StopFlag:
    """SIGTERM/SIGUSR1 (Slurm preemption, torchrun shutdown) and SIGINT (Ctrl-C, which torchrun forwards to the
    ranks) ask for a checkpoint at the next step boundary; a second signal exits at once, and one more during that
    exit leaves without cleanup (never raising inside it). Ranks agree on stopping with one all-reduce.

    A repeat within `REPEAT_S` seconds is the same request, not a second one: under Slurm a rank
    gets the signal twice within milliseconds (`scancel --signal` reaches every process of the
    step, and torchrun forwards the one it got)."""

    REPEAT_S = 2.0

    def __init__(self):
        self.requested = False
        self.exiting = False
        self.first_at = 0.0
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame):
        name = signal.Signals(signum).name
        if self.exiting:  # a signal during that exit's cleanup: leave now, never raise inside the cleanup
            # (seen: a SIGUSR1 raised inside multiprocessing's atexit join of the engine core, and the rank hung)
            print(
                f"[moe-rl] pid {os.getpid()}: {name} while exiting: exiting without cleanup",
                file=sys.stderr,
                flush=True,
            )
            os._exit(128 + signum)  # the engine's reaper removes what this process leaves
        if self.requested and time.monotonic() - self.first_at > self.REPEAT_S:
            print(f"[moe-rl] pid {os.getpid()}: second {name}: exiting now", file=sys.stderr, flush=True)
            self.exiting = True
            raise SystemExit(128 + signum)
        if not self.requested:
            print(
                f"[moe-rl] pid {os.getpid()}: {name}: checkpoint at the next step boundary", file=sys.stderr, flush=True
            )
            self.requested, self.first_at = True, time.monotonic()

    @contextmanager
    def engine_may_stop(self, warn: Callable[[str], object]):
        """Under a stop signal (SIGTERM reaches the engine's processes too) an engine failure ends the engine work
        instead of the run, saying so through `warn`: the checkpoint does not need the engine."""
        try:
            yield
        except RolloutEngineError as e:
            if not self.requested:
                raise
            warn(f"engine stopped by the signal ({e}); checkpointing without it")

    def agreed(self) -> bool:
        t = torch.tensor([int(self.requested)])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())


def stop_with_launcher() -> None:
    """Under torchrun: receive SIGUSR1 when the launcher dies (even by SIGKILL), so the rank
    checkpoints at the next step boundary and exits instead of training on unsupervised.
    Linux prctl(PR_SET_PDEATHSIG); elsewhere a no-op. (SIGUSR1, not SIGTERM: with SIGTERM a rank
    was seen to receive it twice, which StopFlag takes as "exit now".)"""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGUSR1, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    if os.getppid() != parent:  # the launcher died before prctl took effect
        os.kill(os.getpid(), signal.SIGUSR1)


def run_then_exit(main: Callable[[], object], *, end: Callable[[int], object] = os._exit) -> None:
    """Run a rank's `main`, then end the process as Python would, less the interpreter's teardown.

    After the atexit handlers (wandb, logging, multiprocessing's children, the engine's cleanup) Python frees
    torch's, megatron's and vLLM's modules one by one: 3-5 s of CPU per process that end nothing the OS does not
    end. The exit status is main's: 0, or its SystemExit's code (Hydra exits 1 on an error). Other exceptions
    (KeyboardInterrupt) take Python's own way out. `end` ends the process with the status (the test suite's
    forked ranks hand it back to torch's multiprocessing instead)."""
    code = 0
    try:
        main()
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:  # SystemExit("message"): Python prints the message and exits 1
            print(e.code, file=sys.stderr)
            code = 1
    # as Python does first (threading._shutdown): tell the thread pools to stop (concurrent.futures registers its
    # executors' shutdown there, not with atexit: an idle pool's workers would wait for work forever), then wait for
    # the non-daemon threads
    for stop_call in reversed(getattr(threading, "_threading_atexits", [])):
        stop_call()
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    end(code)
