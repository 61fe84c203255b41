"""StopFlag: the first signal asks for a checkpoint, a second exits, and one more during that exit's cleanup
leaves at once instead of raising inside the cleanup (where it once interrupted multiprocessing's join of
the engine core and the rank hung)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO

CHILD = r"""
import os, signal, sys, time
sys.path.insert(0, sys.argv[1])
from moe_rl.trainer.signals import StopFlag

flag = StopFlag()
os.kill(os.getpid(), signal.SIGTERM)
assert flag.requested and not flag.exiting
os.kill(os.getpid(), signal.SIGTERM)  # a repeat within REPEAT_S: the same request
time.sleep(StopFlag.REPEAT_S + 0.1)
try:
    os.kill(os.getpid(), signal.SIGTERM)  # the second request: SystemExit
    print("not stopped", flush=True)
finally:  # the exit's cleanup, when one more signal arrives
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(1)
        print("cleanup finished", flush=True)
    except SystemExit:
        print("cleanup interrupted", flush=True)
"""


def test_a_signal_during_the_exit_leaves_without_raising_inside_the_cleanup():
    proc = subprocess.run([sys.executable, "-c", CHILD, str(REPO)], capture_output=True, text=True, timeout=60)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 128 + 10, out  # SIGUSR1
    assert "SIGTERM: checkpoint at the next step boundary" in out and "second SIGTERM: exiting now" in out, out
    assert "SIGUSR1 while exiting: exiting without cleanup" in out, out
    assert "cleanup interrupted" not in out and "not stopped" not in out, out


def test_ctrl_c_asks_for_a_checkpoint_like_a_preemption():
    """SIGINT (Ctrl-C, forwarded by torchrun to the ranks) is a stop request, not a KeyboardInterrupt mid-step (a
    2-rank run then died with two tracebacks and without a checkpoint); a second one exits."""
    child = r"""
import os, signal, sys, time
sys.path.insert(0, sys.argv[1])
from moe_rl.trainer.signals import StopFlag

flag = StopFlag()
os.kill(os.getpid(), signal.SIGINT)
time.sleep(0.1)
print("requested", flag.requested, flush=True)
time.sleep(StopFlag.REPEAT_S + 0.1)
os.kill(os.getpid(), signal.SIGINT)
time.sleep(1)
"""
    proc = subprocess.run([sys.executable, "-c", child, str(REPO)], capture_output=True, text=True, timeout=60)
    out = proc.stdout + proc.stderr
    assert "requested True" in out and "KeyboardInterrupt" not in out, out
    assert proc.returncode == 128 + 2 and "second SIGINT: exiting now" in out, out


EXIT_CHILD = r"""
import atexit, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
sys.path.insert(0, sys.argv[1])
from moe_rl.trainer.signals import run_then_exit

how = sys.argv[2]
POOLS = []


def main():
    atexit.register(lambda: print("atexit ran", flush=True))
    sys.stdout.write("buffered, never flushed by main")  # the exit flushes it
    threading.Thread(target=lambda: (time.sleep(0.5), print("thread finished", flush=True))).start()
    POOLS.append(ThreadPoolExecutor(2))  # kept open and idle, as a module's pool is: Python's exit stops it
    POOLS[0].submit(print, "pool ran", flush=True).result()
    if how == "code":
        raise SystemExit(3)
    if how == "message":
        raise SystemExit("a message")
    if how == "error":
        raise ValueError("boom")


run_then_exit(main)
"""


@pytest.mark.parametrize("how, code", [("return", 0), ("code", 3), ("message", 1), ("error", 1)])
def test_run_then_exit_keeps_the_exit_code_output_atexit_and_threads(how, code):
    """The rank's fast exit skips only the interpreter's teardown: the status, buffered output, atexit
    handlers and non-daemon threads (an idle thread pool's too) are as a plain `python` exit leaves them."""
    cmd = [sys.executable, "-c", EXIT_CHILD, str(REPO), how]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    out = proc.stdout + proc.stderr
    assert proc.returncode == code, out
    assert "atexit ran" in proc.stdout and "thread finished" in proc.stdout and "pool ran" in proc.stdout, out
    assert "buffered, never flushed by main" in proc.stdout, out
    assert ("a message" in proc.stderr) == (how == "message"), out
    assert ("ValueError: boom" in proc.stderr) == (how == "error"), out


HELD = r"""
import os, signal, sys, time
sys.path.insert(0, sys.argv[1])
from moe_rl.trainer.checkpoint import _signals_held
from moe_rl.trainer.signals import StopFlag

flag = StopFlag()
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(StopFlag.REPEAT_S + 0.1)
try:
    with _signals_held():
        os.kill(os.getpid(), signal.SIGTERM)  # the second request, inside a checkpoint's commit
        time.sleep(0.2)
        print("commit finished", flush=True)
    print("not stopped", flush=True)
except SystemExit as e:
    print(f"exit {e.code} after the commit", flush=True)
"""


def test_a_second_signal_during_a_checkpoint_commit_exits_after_it():
    """A second SIGTERM between a save's rename and its `latest` once left a complete checkpoint `latest` did not
    name: inside the commit it waits, then exits as it would have."""
    proc = subprocess.run([sys.executable, "-c", HELD, str(REPO)], capture_output=True, text=True, timeout=60)
    out = proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == ["commit finished", "exit 143 after the commit"], out
