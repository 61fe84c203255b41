"""The slot a sandboxed run holds: an unprivileged uid no other run on this machine uses at the same time (a lock
file per uid, so threads and processes alike get distinct ones), its pids cgroup where cgroup v1's pids controller
is writable, and the sweep afterwards that kills whatever still runs under the uid or in the cgroup."""

from __future__ import annotations

import fcntl
import os
import signal
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

FIRST_UID = 61000
"""The uids of the runs: FIRST_UID .. FIRST_UID + UIDS - 1 (no account on these machines uses them)."""
UIDS = 1000
PIDS_CGROUP = Path("/sys/fs/cgroup/pids")
LOCKS = Path(tempfile.gettempdir()) / "moe-rl-sandbox-uids"


class SandboxBusy(RuntimeError):
    """Every uid of the range is held by a run."""


@dataclass
class Slot:
    """A held uid and, where the pids controller is writable, the run's own cgroup (else None)."""

    uid: int
    cgroup: Path | None
    lock_fd: int

    def sweep(self) -> int:
        """Kill every process still running as the uid or in the cgroup, wait until they are gone and remove the
        cgroup; returns how many ran as the uid at the first look (0 after a run that ended by itself: a killed
        run's processes may still be on their way out)."""
        found = None
        deadline = time.monotonic() + 5.0
        while True:
            mine = uid_processes(self.uid)
            found = len(mine) if found is None else found
            pids = set(mine) | set(cgroup_processes(self.cgroup))  # also bwrap's init, root, while it tears down
            if not pids:
                break
            for pid in mine:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"sandbox uid {self.uid}: processes {sorted(pids)} survive SIGKILL")
            time.sleep(0.002)
        if self.cgroup is not None:
            remove_cgroup(self.cgroup)
        return found

    def release(self) -> None:
        os.close(self.lock_fd)


def acquire(processes: int) -> Slot:
    """Hold the lowest free uid of the range, and make its cgroup allowing `processes` tasks (plus bubblewrap's
    two: its monitor and the namespace's init)."""
    LOCKS.mkdir(mode=0o700, exist_ok=True)
    for uid in range(FIRST_UID, FIRST_UID + UIDS):
        fd = os.open(LOCKS / str(uid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        # what a run whose supervisor was killed (SIGKILL of the trainer) left: its processes, its cgroup
        for stale in [None, *(PIDS_CGROUP / "moe-rl-sandbox").glob(f"{uid}-*")]:
            Slot(uid, stale, -1).sweep()
        slot = Slot(uid, None, fd)
        slot.cgroup = make_cgroup(uid, processes + 2)
        return slot
    raise SandboxBusy(f"all {UIDS} sandbox uids from {FIRST_UID} are in use")


def make_cgroup(uid: int, tasks: int) -> Path | None:
    """A new pids cgroup with pids.max = tasks, or None where cgroup v1's pids controller is not writable here."""
    if not os.access(PIDS_CGROUP, os.W_OK):
        return None
    path = PIDS_CGROUP / "moe-rl-sandbox" / f"{uid}-{uuid.uuid4().hex[:8]}"
    try:
        path.mkdir(parents=True)
        (path / "pids.max").write_text(str(tasks))
    except OSError:
        remove_cgroup(path)
        return None
    return path


def remove_cgroup(path: Path) -> None:
    try:
        path.rmdir()
    except FileNotFoundError:
        pass


def cgroup_processes(path: Path | None) -> list[int]:
    if path is None:
        return []
    try:
        return [int(p) for p in (path / "cgroup.procs").read_text().split()]
    except FileNotFoundError:
        return []


def uid_processes(uid: int) -> list[int]:
    """The pids of the processes whose uid is `uid` (the owner of /proc/PID), zombies left out (nothing runs)."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid and not is_zombie(name):
                    out.append(int(name))
            except (FileNotFoundError, ProcessLookupError):
                pass
    return out


def is_zombie(pid: str) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat.rpartition(")")[2].split()[0] in ("Z", "X")
