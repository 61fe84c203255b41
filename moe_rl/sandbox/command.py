"""The command line of one sandboxed run: bubblewrap with its own network, PID, IPC, UTS and mount namespaces and
a read-only /usr, then prlimit for the limits, then setpriv down to the slot's unprivileged uid with no
capabilities, then the interpreter on the program (docs/guides/sandbox.md, "the security model")."""

from __future__ import annotations

import math
import shutil
from pathlib import PurePosixPath

from moe_rl.sandbox.config import MIB, Limits

WORKDIR = "/tmp"
"""The program's cwd, its private writable folder (a tmpfs), where it and the extra files are written."""
PROGRAM = "main.py"
TOOLS = ("bwrap", "setpriv", "prlimit")
"""The host commands a run needs: bwrap (Debian package bubblewrap), setpriv and prlimit (util-linux)."""
ENV = {"PATH": "/usr/bin:/bin", "HOME": WORKDIR, "TMPDIR": WORKDIR, "LANG": "C.UTF-8"}

# /usr read-only (the interpreter and its standard library) with the merged-/usr symlinks; /usr/local masked (it
# holds this machine's own installs, none of which a program needs).
ROOT_FS = [
    *("--ro-bind", "/usr", "/usr"),
    *("--tmpfs", "/usr/local"),
    *("--remount-ro", "/usr/local"),
    *("--symlink", "usr/lib", "/lib"),
    *("--symlink", "usr/lib64", "/lib64"),
    *("--symlink", "usr/bin", "/bin"),
    *("--symlink", "usr/sbin", "/sbin"),
    *("--proc", "/proc"),
    *("--dev", "/dev"),
]
NAMESPACES = [
    "--unshare-net",  # loopback only: no route out, not even to the host's 127.0.0.1
    "--unshare-pid",  # sees only its own processes; all of them die with the namespace's init
    "--unshare-ipc",
    "--unshare-uts",
    "--unshare-cgroup-try",
    "--die-with-parent",  # the sandbox dies with the supervisor, even when the supervisor is SIGKILLed
    "--new-session",  # no controlling terminal of ours (TIOCSTI)
    *("--hostname", "sandbox"),
]


def check_file_name(name: str) -> str:
    """A relative path inside the work folder (no .., not absolute), as it is given."""
    path = PurePosixPath(name)
    if not name or path.is_absolute() or ".." in path.parts or name.endswith("/"):
        raise ValueError(f"sandbox file {name!r}: give a relative path inside the work folder (no '..')")
    return name


def bwrap_argv(files: dict[str, int], limits: Limits, uid: int, python: str, status_fd: int) -> list[str]:
    """The command of one run; `files` maps each work-folder path (main.py included) to a readable fd holding it."""
    tmp_bytes = limits.tmp_mib * MIB
    argv = [shutil.which("bwrap") or "bwrap", *NAMESPACES, *ROOT_FS]
    argv += ["--perms", "0777", "--size", str(tmp_bytes), "--tmpfs", WORKDIR]
    made = set()
    for name, fd in files.items():
        for parent in reversed(PurePosixPath(name).parents[:-1]):
            if parent not in made:
                made.add(parent)
                argv += ["--perms", "0777", "--dir", f"{WORKDIR}/{parent}"]
        argv += ["--perms", "0666", "--file", str(fd), f"{WORKDIR}/{name}"]
    argv += ["--chdir", WORKDIR, "--clearenv"]
    for key, value in ENV.items():
        argv += ["--setenv", key, value]
    argv += ["--json-status-fd", str(status_fd), "--"]
    cpu = max(1, math.ceil(limits.cpu_s))
    argv += [
        "/usr/bin/prlimit",
        f"--as={limits.memory_mib * MIB}",
        f"--cpu={cpu}:{cpu + 1}",  # SIGXCPU at the limit, SIGKILL a second later for a program that ignores it
        f"--nproc={limits.processes}",
        f"--nofile={limits.open_files}",
        f"--fsize={tmp_bytes}",
        "--core=0",  # no core files (core_pattern may hand them to a host program)
        "--",
        "/usr/bin/setpriv",
        f"--reuid={uid}",
        f"--regid={uid}",
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--no-new-privs",
        "--",
        python,
        "-B",  # no .pyc files
        "-E",  # no PYTHON* variables
        "-s",  # no user site folder
        PROGRAM,
    ]
    return argv
