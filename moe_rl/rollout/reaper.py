"""Engines die with their owner: one watchdog process per rollout engine.

vLLM's engine core does not watch the process that started it: after a SIGKILL of a training
rank it lives on (reparented to init) with its worker, its shared-memory ring buffers
(`/dev/shm/psm_*`), multiprocessing semaphores (`/dev/shm/sem.mp-*`), its tensor-parallel workers' shared-memory
communicator (`/dev/shm/vllm_dist_*-cpushm_*`), the weight sync's bucket buffer it maps
(`/dev/shm/moe-rl-weights-*`, which the killed rank created) and its ZMQ socket files
in the temp folder; even a clean shutdown leaves the socket files behind. The reaper is a tiny
process in its own session that ignores the signals aimed at the job (torchrun or Slurm killing
the job does not kill it first):

- every `POLL_S` seconds it records the engine's processes and every descendant of its owner;
- when the owner dies (exception, SIGTERM, SIGKILL, a peer rank's failure, torchrun's death)
  it kills every recorded process; on a clean shutdown (`Reaper.close`) the engine's only;
- then it removes the files of those kinds that appeared since the engine started and that no
  other live process holds: a socket file nobody else is bound to (/proc/net/unix), a /dev/shm
  file no other process maps or has open. The owner's own holdings do not count (after a clean
  shutdown it still holds the client ends of the dead engine's sockets, which nobody will
  connect to again); files another run uses are never touched;
- it also removes the files the engine names as its own (`Reaper.own`: the FileStore file of a one-worker
  engine's rendezvous, `vllm_dist_*` in the temp folder, which only a destructor that a killed process never
  runs would remove);
- after a clean shutdown, if some file was still held by another process at that moment, it
  looks once more when the owner has exited, or after `LINGER_S` if the owner lives on; after the
  owner died, it looks again every `POLL_S` until no such file is left or `LINGER_S` has passed.
  (Socket files were left after a clean exit once, and after a second SIGTERM during a save once,
  both under CI's load; which process held them then is not known.)

Which case each part covers is listed in docs/operations/troubleshooting.md.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time

POLL_S = 0.5
LINGER_S = 10.0  # after a clean close: how long to wait for the owner's exit before a last look at held files
SHM = "/dev/shm"
# multiprocessing.shared_memory, multiprocessing semaphores, the shared-memory communicator of a tensor-parallel
# vLLM-CPU engine's workers (vllm_dist_<id>-tp:0-[0-1]-cpushm_<rank>: CI found them left after such engines), and
# the weight sync's bucket buffer (moe-rl-weights-*: the chaos test found one left by a kill -9 during a sync)
SHM_KINDS = re.compile(r"^(psm_|sem\.mp-|vllm_dist_[0-9a-f]{32}-|moe-rl-weights-)")
SOCKET_NAME = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")  # vLLM's ZMQ ipc paths


class Reaper:
    """Trainer side: start the watchdog for this process, tell it the engine's pids, close it."""

    def __init__(self) -> None:
        # Snapshot here, not in the reaper: the engine starts creating files while it boots.
        self.before = candidate_files()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moe_rl.rollout.reaper", str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
            close_fds=True,
        )
        self._send(json.dumps(sorted(self.before)))

    def watch(self, pids: list[int]) -> None:
        """The engine has started: its pids, and (snapshot here, synchronously) the files it created."""
        self._send("started " + json.dumps(sorted(candidate_files() - self.before)))
        self._send("watch " + " ".join(map(str, pids)))

    def close(self, timeout: float = 15.0) -> None:
        """Kill what is left of the engine and remove its files; returns when that is done."""
        if self.proc.poll() is None:
            self._send("exit")
            ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
            if ready:
                self.proc.stdout.readline()  # "killed"

    def own(self, paths: list[str]) -> None:
        """Files only this engine uses, removed with it (once its processes are gone)."""
        if paths:
            self._send("own " + json.dumps(sorted(paths)))

    def _send(self, line: str) -> None:
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass


def candidate_files() -> set[str]:
    """Files of the kinds an engine leaves: /dev/shm segments and semaphores, ZMQ socket files."""
    out = set()
    if os.path.isdir(SHM):
        out |= {os.path.join(SHM, n) for n in os.listdir(SHM) if SHM_KINDS.match(n)}
    tmp = tempfile.gettempdir()
    out |= {os.path.join(tmp, n) for n in os.listdir(tmp) if SOCKET_NAME.match(n)}
    return out


def files_in_use(owner=None) -> set[str]:
    """Socket paths someone is bound to, and /dev/shm files some live process maps or has open;
    `owner` (a psutil.Process): leave out what only it holds.

    /dev/shm files are matched by inode, not by path: glibc's sem_open creates a named semaphore under a
    temporary name, maps it and links it to its real name (sem.mp-*), so /proc/PID/maps shows the deleted
    temporary path. Matched by path, another process's live semaphore looked unused and was removed, and
    the child it was spawning failed to open it (vLLM workers of another run: "SemLock._rebuild ...
    FileNotFoundError")."""
    used = set()
    try:
        with open("/proc/net/unix") as f:
            next(f)
            bound = [parts for line in f if len(parts := line.split()) >= 8]  # ... Inode Path
    except OSError:
        bound = []
    mine = _socket_inodes(owner.pid) if owner is not None else set()
    used |= {parts[7] for parts in bound if parts[6] not in mine}
    inodes = set()  # (device, inode) of /dev/shm files some other process maps or has open
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if owner is not None and int(pid) == owner.pid:
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    if SHM in line:
                        fields = line.split(None, 5)  # address perms offset dev(major:minor, hex) inode path
                        major, minor = (int(x, 16) for x in fields[3].split(":"))
                        inodes.add((os.makedev(major, minor), int(fields[4])))
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(SHM):
                    st = os.stat(f"/proc/{pid}/fd/{fd}")
                    inodes.add((st.st_dev, st.st_ino))
        except OSError:
            continue
    if os.path.isdir(SHM):
        for name in os.listdir(SHM):
            try:
                st = os.stat(os.path.join(SHM, name))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) in inodes:
                used.add(os.path.join(SHM, name))
    return used


def _socket_inodes(pid: int) -> set[str]:
    out = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                out.add(target[8:-1])
    except OSError:
        pass
    return out


class _Watch:
    def __init__(self, owner_pid: int):
        # heavy: psutil, imported on first use
        import psutil

        try:
            self.owner = psutil.Process(owner_pid)
        except psutil.NoSuchProcess:  # it died while this process started: clean up after it all the same
            self.owner = None
        self.engine: dict[int, psutil.Process] = {}  # Process objects keep identity across pid reuse
        self.descendants: dict[int, psutil.Process] = {}
        self.before: set[str] = set()  # engine-kind files that existed before the engine started
        self.started: set[str] | None = None  # those that appeared while it started (known at "watch")
        self.owned: set[str] = set()  # files the engine named as its own ("own")
        self.done = threading.Event()

    def owner_alive(self) -> bool:
        # heavy: psutil, imported on first use
        import psutil

        try:
            return self.owner is not None and self.owner.is_running() and self.owner.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def add_engine(self, pids: list[int]) -> None:
        # heavy: psutil, imported on first use
        import psutil

        for pid in pids:
            try:
                self.engine[pid] = psutil.Process(pid)
            except psutil.NoSuchProcess:
                pass

    def scan(self) -> None:
        # heavy: psutil, imported on first use
        import psutil

        owner = [(self.owner, self.descendants)] if self.owner is not None else []
        for root, into in [*owner, *((p, self.engine) for p in list(self.engine.values()))]:
            try:
                for child in root.children(recursive=True):
                    if child.pid != os.getpid() and not _is_reaper(child):  # other engines' reapers do their own
                        into.setdefault(child.pid, child)
            except psutil.NoSuchProcess:
                continue

    def kill(self, everything: bool) -> list[int]:
        """Kill the engine's processes (all the owner's descendants when `everything`)."""
        # heavy: psutil, imported on first use
        import psutil

        victims = {**(self.descendants if everything else {}), **self.engine}
        alive = []
        for p in victims.values():
            try:
                if p.is_running():
                    p.kill()
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=10)
        return [p.pid for p in alive]

    def remove_files(self) -> list[str]:
        """Remove the files the engine owns, and the engine-kind files that appeared since it started and
        that no other process holds. The owner's holdings do not count for files that appeared while the
        engine started (the client ends of its sockets); they do for later ones while the owner lives:
        another engine the owner started since (its semaphores and sockets, held by the owner alone until
        the engine's processes open them)."""
        removed = []
        stale = candidate_files() - self.before
        if stale:
            alive = self.owner_alive()
            in_use = files_in_use(self.owner if alive else None)
            later = stale - self.started if alive and self.started is not None else set()
            if later - in_use:
                in_use |= later & files_in_use(None)
            stale -= in_use
        for path in sorted(stale | {p for p in self.owned if os.path.exists(p)}):
            try:
                os.unlink(path)
                removed.append(path)
            except OSError:
                pass
        return removed


def _is_reaper(proc) -> bool:
    # heavy: psutil, imported on first use
    import psutil

    try:
        return "moe_rl.rollout.reaper" in proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def _read_commands(watch: _Watch) -> None:
    for line in sys.stdin:
        word, _, rest = line.strip().partition(" ")
        if word == "started":
            watch.started = set(json.loads(rest))
        elif word == "own":
            watch.owned |= set(json.loads(rest))
        elif word == "watch":
            watch.add_engine([int(a) for a in rest.split()])
            watch.scan()
        elif word == "exit":
            break
    watch.done.set()  # "exit", or EOF: the owner closed the pipe or died


def main() -> None:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)  # the job's signals are for the trainer, not for us
    watch = _Watch(int(sys.argv[1]))
    watch.before = set(json.loads(sys.stdin.readline() or "[]"))
    threading.Thread(target=_read_commands, args=(watch,), daemon=True).start()
    while not watch.done.is_set() and watch.owner_alive():
        watch.scan()
        watch.done.wait(POLL_S)
    watch.scan()
    owner_gone = not watch.owner_alive()
    killed = watch.kill(everything=owner_gone)
    removed = watch.remove_files()
    if not owner_gone:  # a clean close: the owner waits for this answer
        try:
            print("killed", flush=True)
        except OSError:  # the owner died while waiting for it (e.g. a second SIGTERM)
            pass
        # Files some other process still held at that pass: one more look once the owner has exited (a rank
        # exits right after closing its engine), or after LINGER_S if it lives on (a notebook, pytest).
        if candidate_files() - watch.before:
            deadline = time.monotonic() + LINGER_S
            while watch.owner_alive() and time.monotonic() < deadline:
                time.sleep(POLL_S)
            removed += watch.remove_files()
    if owner_gone:
        # Files another process still held at that pass (seen: two engine sockets after a second SIGTERM during a
        # checkpoint save, with the ranks' other processes still exiting): looked at again until they are free or
        # LINGER_S has passed; a file another run holds all that time stays.
        deadline = time.monotonic() + LINGER_S
        while candidate_files() - watch.before and time.monotonic() < deadline:
            time.sleep(POLL_S)
            removed += watch.remove_files()
        print(
            f"[moe-rl reaper] process {watch.owner.pid} ended without shutting its rollout engine down: killed "
            f"{len(killed)} process(es) {killed}, removed {len(removed)} leftover file(s)",
            file=sys.stderr,
            flush=True,
        )


if __name__ == "__main__":
    main()
