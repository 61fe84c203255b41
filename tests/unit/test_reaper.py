"""The reaper's "in use" test: a file another live process holds is never one of a dead engine's leftovers."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys

import psutil

from moe_rl.rollout.reaper import candidate_files, files_in_use


def test_a_live_named_semaphore_is_in_use():
    """glibc maps a named semaphore under a temporary name: matched by path it looked unused, and a reaper in
    another run removed it while this process was spawning a child that opens it by name."""
    before = candidate_files()
    lock = mp.get_context("spawn").Lock()  # a named semaphore (sem.mp-*) until a spawned child opened it
    new = candidate_files() - before
    assert any("sem.mp-" in f for f in new), new
    # as the reaper of another process sees it: this process is not its owner
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert new <= files_in_use(psutil.Process(other.pid))
        assert not new & files_in_use(psutil.Process())  # held by the owner alone: the owner's holdings do not count
    finally:
        other.kill()
        other.wait()
    del lock


def test_a_clean_close_keeps_what_the_owner_started_since():
    """One process, two engines: closing the first engine's reaper must not remove the semaphore the owner
    just created to spawn the second (held by the owner alone until the child opens it by name)."""
    from moe_rl.rollout.reaper import Reaper

    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # stands in for an engine
    reaper = Reaper()
    reaper.watch([engine.pid])
    before = candidate_files()
    lock = mp.get_context("spawn").Lock()  # the next engine's, created after the first one started
    mine = candidate_files() - before
    assert mine
    reaper.close()
    assert engine.wait(timeout=10) is not None  # the watched engine was killed
    assert mine <= candidate_files(), "the reaper removed a file the owner holds for another engine"
    del lock


OWNER = r"""
import os, socket, subprocess, sys, tempfile, time, uuid
from moe_rl.rollout.reaper import Reaper

reaper = Reaper()
path = os.path.join(tempfile.gettempdir(), str(uuid.uuid4()))  # named as vLLM names its ZMQ socket files
holder = subprocess.Popen([sys.executable, "-c", f"import socket, time; s = socket.socket(socket.AF_UNIX); "
                           f"s.bind({path!r}); print('bound', flush=True); time.sleep(60)"], stdout=subprocess.PIPE)
assert holder.stdout.readline().strip() == b"bound"
reaper.watch([])
print(reaper.proc.pid, path, flush=True)
reaper.close()  # the file is held by a process the reaper does not kill on a clean close
holder.kill()
holder.wait()
"""


def test_a_file_held_at_a_clean_close_is_removed_once_the_owner_has_exited():
    """A clean close leaves what another process still holds at that moment: the reaper looks again once its
    owner has exited."""
    owner = subprocess.run([sys.executable, "-c", OWNER], capture_output=True, text=True, timeout=60)
    assert owner.returncode == 0, owner.stderr
    reaper_pid, path = owner.stdout.split()
    try:
        psutil.Process(int(reaper_pid)).wait(timeout=30)
    except psutil.NoSuchProcess:
        pass
    assert not os.path.exists(path), f"{path} left behind"


KILLED_IN_A_SYNC = r"""
import time
from moe_rl.rollout.reaper import Reaper
from moe_rl.weight_sync import _BucketBuffer

reaper = Reaper()
reaper.watch([])
buffer = _BucketBuffer(4096).__enter__()  # a weight sync under way: its /dev/shm bucket buffer exists
print(reaper.proc.pid, buffer.path, flush=True)
time.sleep(60)
"""


def test_a_rank_killed_during_a_weight_sync_leaves_no_bucket_buffer():
    """kill -9 of a leader rank mid-sync: nothing runs its buffer's __exit__; its reaper removes the file."""
    owner = subprocess.Popen([sys.executable, "-c", KILLED_IN_A_SYNC], stdout=subprocess.PIPE, text=True)
    reaper_pid, path = owner.stdout.readline().split()
    assert os.path.exists(path) and "/moe-rl-weights-" in path
    owner.kill()
    owner.wait()
    try:
        psutil.Process(int(reaper_pid)).wait(timeout=30)
    except psutil.NoSuchProcess:
        pass
    assert not os.path.exists(path), f"{path} left behind"
