"""Run one untrusted Python program in a bubblewrap sandbox and read how it ended (`run_program` -> `RunResult`):
the program's files go in as memfds, its stdin is a memfd too (never blocks us), its stdout and stderr are drained
concurrently up to the output limit (the rest counted), the supervisor waits on the process (not on EOF) until the
wall limit and then kills the whole sandbox, and the slot's sweep leaves no process behind."""

from __future__ import annotations

import functools
import json
import os
import selectors
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass

from moe_rl.sandbox.command import ENV, PROGRAM, TOOLS, bwrap_argv, check_file_name
from moe_rl.sandbox.config import Limits
from moe_rl.sandbox.slots import Slot, acquire

STATUSES = ("passed", "failed", "timeout", "crashed", "oom")
INSTALL = "install the Debian package bubblewrap (`apt-get install bubblewrap`, or `bash launch/setup_env.sh`)"
READ_CHUNK = 1 << 20


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot run programs on this machine (bubblewrap missing, namespaces refused)."""


@dataclass(frozen=True)
class RunResult:
    """How one program ended. `status`: passed (exit 0) | failed (exit non-zero: an uncaught exception but
    MemoryError) | timeout (wall or CPU limit) | crashed (killed by another signal) | oom (MemoryError)."""

    status: str
    exit_code: int | None  # the program's exit status; None when it was killed by a signal
    seconds: float
    stdout: bytes
    stderr: bytes
    stdout_bytes: int  # of stdout, kept
    stdout_total: int  # of stdout, written by the program (kept and dropped)
    signal: int | None  # the signal that ended it (SIGKILL for our wall-limit kill)
    stderr_total: int = 0
    uid: int = 0  # the slot uid it ran as
    cgroup: bool = False  # whether a pids cgroup bounded its processes (else the uid's RLIMIT_NPROC alone)
    leftover: int = 0  # processes of the uid still there when bwrap had ended (killed by the slot's sweep)

    def as_json(self) -> dict:
        """The command line's JSON line."""
        return {
            "status": self.status,
            "exit_code": self.exit_code,
            "seconds": round(self.seconds, 3),
            "stdout_bytes": self.stdout_bytes,
            "stdout_total": self.stdout_total,
            "stderr_bytes": len(self.stderr),
            "signal": self.signal,
            "uid": self.uid,
            "cgroup": self.cgroup,
        }


@functools.cache
def check_available() -> None:
    """Raise SandboxUnavailable, saying what to install, unless a trivial program runs in the sandbox here."""
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        raise SandboxUnavailable(f"the code sandbox needs {', '.join(missing)} on PATH: {INSTALL}")
    result = run_program("print(6 * 7)", limits=Limits(wall_s=30.0))
    if result.status != "passed" or result.stdout != b"42\n":
        raise SandboxUnavailable(
            f"bubblewrap cannot run a program here ({result.status}, exit {result.exit_code}): "
            f"{result.stderr.decode(errors='replace').strip()[-500:]}"
        )


def run_program(
    source: str,
    stdin: bytes = b"",
    limits: Limits = Limits(),
    python: str = "/usr/bin/python3",
    files: dict[str, str] | None = None,
) -> RunResult:
    """Run `source` as /tmp/main.py in a fresh sandbox (files: more files written beside it) and say how it ended."""
    contents = {PROGRAM: source, **{check_file_name(k): v for k, v in (files or {}).items()}}
    fds = [memfd(name, text.encode()) for name, text in contents.items()]
    stdin_fd = memfd("stdin", stdin)
    slot = acquire(limits.processes)
    status_r, status_w = os.pipe()
    try:
        argv = bwrap_argv(dict(zip(contents, fds, strict=True)), limits, slot.uid, python, status_w)
        return supervise(argv, slot, limits, stdin_fd, [*fds, status_w], status_r)
    finally:
        for fd in (*fds, stdin_fd, status_r):
            os.close(fd)
        slot.release()


def memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name.replace("/", "_"), os.MFD_CLOEXEC)
    os.write(fd, data)  # a memfd takes the whole buffer at once
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def supervise(argv: list[str], slot: Slot, limits: Limits, stdin_fd: int, pass_fds: list, status_r: int) -> RunResult:
    """Start the sandbox (inside the slot's cgroup from its first instruction), drain its output, end it at the wall
    limit, sweep the slot, and map how it ended to a status."""
    if slot.cgroup is not None:  # a shell that joins the cgroup, then becomes bwrap: every later fork is inside
        argv = ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(slot.cgroup / "cgroup.procs"), *argv]
    start = time.monotonic()
    deadline = start + limits.wall_s
    try:
        proc = subprocess.Popen(
            argv,
            stdin=stdin_fd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=pass_fds,
            start_new_session=True,  # its own process group: the wall-limit kill reaches bwrap and what shares it
            env=ENV,
        )
    finally:
        os.close(pass_fds[-1])  # our copy of the status pipe's write end: EOF once bwrap is gone
    try:
        out, err = drain(proc, deadline, limits.output_bytes)
        wait_status, killed = reap(proc, deadline)
        seconds = time.monotonic() - start
    finally:
        if proc.returncode is None:  # an exception on the way: never leave the sandbox running
            kill_group(proc.pid)
            reap(proc, 0.0)
        for pipe in (proc.stdout, proc.stderr):
            pipe.close()
    leftover = slot.sweep()
    started = read_status(status_r)
    if "child-pid" not in started and not killed:
        raise SandboxUnavailable(
            f"bubblewrap did not start the program: {bytes(err[0]).decode(errors='replace').strip()[-500:]}; {INSTALL}"
        )
    status, exit_code, sig = classify(wait_status, killed, bytes(err[0]), seconds, limits)
    return RunResult(
        status=status,
        exit_code=exit_code,
        seconds=seconds,
        stdout=bytes(out[0]),
        stderr=bytes(err[0]),
        stdout_bytes=len(out[0]),
        stdout_total=out[1],
        signal=sig,
        stderr_total=err[1],
        uid=slot.uid,
        cgroup=slot.cgroup is not None,
        leftover=leftover,
    )


def drain(proc: subprocess.Popen, deadline: float, keep: int) -> tuple[list, list]:
    """Read stdout and stderr as they come until both reach EOF or the deadline: [kept bytearray, total] each."""
    out, err = [bytearray(), 0], [bytearray(), 0]
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ, out)
        sel.register(proc.stderr, selectors.EVENT_READ, err)
        while sel.get_map() and (left := deadline - time.monotonic()) > 0:
            for key, _ in sel.select(left):
                chunk = os.read(key.fd, READ_CHUNK)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                kept, room = key.data[0], keep - len(key.data[0])
                if room > 0:
                    kept += chunk[:room]
                key.data[1] += len(chunk)
    return out, err


def reap(proc: subprocess.Popen, deadline: float) -> tuple[int, bool]:
    """Wait for bwrap until the deadline, then kill its whole group: (wait status, whether we killed it).
    Polls: a program that closed its output and sleeps must still end at the wall limit."""
    delay = 0.0005
    while True:
        pid, wait_status = os.waitpid(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() >= deadline:
            kill_group(proc.pid)
            _, wait_status = os.waitpid(proc.pid, 0)
            proc.returncode = -signal.SIGKILL
            return wait_status, True
        time.sleep(delay)
        delay = min(delay * 2, 0.02)
    proc.returncode = os.waitstatus_to_exitcode(wait_status)
    return wait_status, False


def kill_group(pid: int) -> None:
    """SIGKILL bwrap's process group; --die-with-parent and the PID namespace's end take the rest."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def read_status(fd: int) -> dict:
    """bwrap's --json-status-fd documents ({"child-pid": ...} once the program started, then {"exit-code": ...})."""
    data = b""
    while chunk := os.read(fd, 65536):
        data += chunk
    merged: dict = {}
    for doc in data.decode(errors="replace").replace("}\n{", "}\0{").split("\0"):
        if doc.strip():
            try:
                merged |= json.loads(doc)
            except json.JSONDecodeError:
                pass
    return merged


def classify(wait_status: int, killed: bool, stderr: bytes, seconds: float, limits: Limits) -> tuple:
    """(status, exit code, signal). bwrap reports a program killed by signal N as exit status 128 + N (so a program
    that exits with such a status itself reads as killed by N). SIGXCPU is the CPU limit; a SIGKILL after enough
    wall time for the CPU limit on all cores is its hard limit (a program that ignored SIGXCPU)."""
    if killed:
        return "timeout", None, signal.SIGKILL
    if os.WIFSIGNALED(wait_status):  # bwrap itself killed by someone else
        return "crashed", None, os.WTERMSIG(wait_status)
    code = os.WEXITSTATUS(wait_status)
    if code > 128 and code - 128 in signal.valid_signals():
        sig = code - 128
        cores = len(os.sched_getaffinity(0))
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and seconds * cores >= limits.cpu_s):
            return "timeout", None, sig
        return "crashed", None, sig
    if code == 0:
        return "passed", 0, None
    if code == 1 and last_traceback_line(stderr).split(":")[0] == "MemoryError":
        return "oom", code, None
    return "failed", code, None


def last_traceback_line(stderr: bytes) -> str:
    lines = [line for line in stderr.decode(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""
