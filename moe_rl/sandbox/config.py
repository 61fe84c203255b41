"""`data.sandbox.*` as data: the limits of one sandboxed run (`Limits`, what moe_rl.sandbox.runner enforces) and the
settings of the process-wide pool the code rewards run their programs on (`SandboxConfig`)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from moe_rl.common.errors import ConfigError

MIB = 2**20


@dataclass(frozen=True)
class Limits:
    """What one program may use. Each limit ends the run with a status (docs/guides/sandbox.md)."""

    wall_s: float = 10.0  # the supervisor kills the whole sandbox after this many seconds: timeout
    cpu_s: float = 10.0  # RLIMIT_CPU of each process (SIGXCPU, then SIGKILL a second later): timeout
    memory_mib: int = 1024  # RLIMIT_AS (address space) of each process: MemoryError, oom
    processes: int = 64  # processes and threads: the pids cgroup's pids.max and the slot uid's RLIMIT_NPROC
    open_files: int = 256  # RLIMIT_NOFILE
    output_bytes: int = 64 * MIB  # kept of stdout and of stderr each; the rest is counted, never blocks the program
    tmp_mib: int = 64  # size of the private /tmp (a tmpfs; also RLIMIT_FSIZE of one file)

    def check(self, prefix: str = "limits.") -> None:
        """Refuse a limit no program can run under, naming it."""
        for name in ("wall_s", "cpu_s", "memory_mib", "processes", "open_files", "output_bytes", "tmp_mib"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{prefix}{name}: {getattr(self, name)}: must be > 0")
        if self.memory_mib < 32:
            raise ConfigError(f"{prefix}memory_mib: {self.memory_mib}: the interpreter alone needs ~32 MiB")
        if self.open_files < 8:
            raise ConfigError(f"{prefix}open_files: {self.open_files}: the interpreter needs at least 8")


@dataclass
class SandboxConfig:
    """data.sandbox: the pool of sandboxed runs of model-written programs (moe_rl.sandbox; code rewards)."""

    workers: int = 0
    """Programs run at the same time in this process's pool (threads, each run in its own sandbox under its own
    uid); 0: the CPU cores this process may use."""
    timeout_s: float = 10.0
    """Wall-clock seconds one program may run; past it the whole sandbox is killed and the run reads `timeout`."""
    cpu_s: float = 10.0
    """CPU seconds each process of a program may use (RLIMIT_CPU); past it the run reads `timeout`."""
    memory_mib: int = 1024
    """Address space of each process of a program in MiB (RLIMIT_AS); an allocation past it raises MemoryError and
    the run reads `oom`."""
    processes: int = 64
    """Processes and threads a program may have at once (a pids cgroup where /sys/fs/cgroup/pids is writable, and
    RLIMIT_NPROC of the run's own uid); a fork bomb stops there."""
    open_files: int = 256
    """Open files of each process of a program (RLIMIT_NOFILE)."""
    output_mib: int = 64
    """MiB of a program's stdout, and of its stderr, kept; the rest is counted and dropped."""
    tmp_mib: int = 64
    """Size in MiB of the program's private writable /tmp (a tmpfs gone with the sandbox); also the largest file."""
    python: str = "/usr/bin/python3"
    """The interpreter programs run with, under /usr (the only host folder the sandbox sees): Debian's python3 with
    its standard library. Not the venv's (it lives under the home folder, which the sandbox does not see)."""

    def limits(self) -> Limits:
        """The limits of one run."""
        return Limits(
            wall_s=self.timeout_s,
            cpu_s=self.cpu_s,
            memory_mib=self.memory_mib,
            processes=self.processes,
            open_files=self.open_files,
            output_bytes=self.output_mib * MIB,
            tmp_mib=self.tmp_mib,
        )

    def pool_workers(self) -> int:
        """data.sandbox.workers, 0 resolved to the cores this process may use."""
        return self.workers or len(os.sched_getaffinity(0))

    def check(self) -> None:
        """This section's own rules (that bubblewrap is installed is moe_rl.sandbox.check_available's)."""
        if self.workers < 0:
            raise ConfigError(f"config data.sandbox.workers: {self.workers}: must be >= 0 (0: the cores)")
        try:
            self.limits().check()
        except ConfigError as e:
            names = {"wall_s": "timeout_s", "output_bytes": "output_mib"}
            key, _, message = str(e).removeprefix("limits.").partition(":")
            raise ConfigError(f"config data.sandbox.{names.get(key, key)}:{message}") from None
        if not self.python.startswith("/usr/"):
            raise ConfigError(
                f"config data.sandbox.python: {self.python!r}: the sandbox sees only /usr of this machine; choose an "
                "interpreter under /usr (e.g. /usr/bin/python3)"
            )
