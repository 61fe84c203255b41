"""A real Slurm on localhost for tests (Debian's slurm-wlm and munge): one slurmctld and two slurmd
daemons, nodes n1 and n2 (`NodeHostname` this host, `NodeAddr` 127.0.0.1, a port each), so a job can
span two nodes on one machine.

`LocalSlurm.start()` raises `SlurmUnavailable` with the reason when Slurm cannot start here
(not installed, not root); the test then skips with that reason.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from tests.conftest import free_port


class SlurmUnavailable(RuntimeError):
    pass


CONF = """\
ClusterName=moerl
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
ReturnToService=2
MpiDefault=none
SlurmctldPort={ctld_port}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
NodeName=n1 NodeHostname={host} NodeAddr=127.0.0.1 Port={port_1} CPUs={cpus} State=UNKNOWN
NodeName=n2 NodeHostname={host} NodeAddr=127.0.0.1 Port={port_2} CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
"""
NODES = ("n1", "n2")


class LocalSlurm:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.conf = self.root / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))

    def start(self, timeout: float = 60) -> LocalSlurm:
        missing = [b for b in ("slurmctld", "slurmd", "munged", "munge", "sbatch") if shutil.which(b) is None]
        if missing:
            raise SlurmUnavailable(f"{missing} not installed (Debian: apt-get install slurm-wlm munge)")
        if os.geteuid() != 0:
            raise SlurmUnavailable("starting slurmd and munged needs root")
        self._start_munge()
        for sub in ("state", "spool"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        host = socket.gethostname().split(".")[0]
        ports = dict(ctld_port=free_port(), port_1=free_port(), port_2=free_port())
        self.conf.write_text(CONF.format(host=host, cpus=os.cpu_count(), root=self.root, **ports))
        subprocess.run(["slurmctld", "-f", str(self.conf)], env=self.env, check=True, timeout=30)
        for node in NODES:  # `-N`: the slurmd of that node name (both on this host)
            subprocess.run(["slurmd", "-f", str(self.conf), "-N", node], env=self.env, check=True, timeout=30)
        deadline = time.time() + timeout
        state = ""
        while time.time() < deadline:
            out = subprocess.run(["sinfo", "-h", "-o", "%T"], env=self.env, capture_output=True, text=True)
            state = out.stdout.strip()
            if state == "idle":  # every node (sinfo prints each state once)
                return self
            time.sleep(1)
        self.stop()
        raise SlurmUnavailable(f"the local nodes did not become idle (sinfo: {state!r}); see {self.root}/*.log")

    def _start_munge(self) -> None:
        """A munged that answers: one that runs but whose socket another munged (of another pid namespace, since
        gone) replaced does not, and slurmd then hangs at its start; `--force` takes the socket over."""
        key = Path("/etc/munge/munge.key")
        if subprocess.run(["munge", "-n"], capture_output=True, timeout=30).returncode == 0:
            return
        if not key.is_file():
            key.parent.mkdir(parents=True, exist_ok=True)
            key.write_bytes(os.urandom(1024))
        shutil.chown(key, "munge", "munge")
        key.chmod(0o400)
        for d in ("/run/munge", "/var/lib/munge", "/var/log/munge"):
            Path(d).mkdir(parents=True, exist_ok=True)
            shutil.chown(d, "munge", "munge")
        subprocess.run(["runuser", "-u", "munge", "--", "munged", "--force"], check=True, timeout=30)

    def sbatch(self, args: list[str], cwd: Path, env: dict[str, str] | None = None) -> int:
        """Submit; `env`: variables for this job only (sbatch passes its environment on to the job)."""
        out = subprocess.run(
            ["sbatch", "--parsable", *args], cwd=cwd, env={**self.env, **(env or {})}, capture_output=True, text=True
        )
        if out.returncode:
            raise RuntimeError(f"sbatch {args} failed ({out.returncode}): {out.stderr.strip()}")
        return int(out.stdout.strip().split(";")[0])

    def node_state(self) -> str:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], env=self.env, capture_output=True, text=True)
        return out.stdout.strip()

    def job_state(self, job: int) -> str:
        out = subprocess.run(["scontrol", "show", "job", str(job)], env=self.env, capture_output=True, text=True).stdout
        for field in out.split():
            if field.startswith("JobState="):
                return field.split("=", 1)[1]
        return "UNKNOWN"

    def nodes_that_ran(self, job: int) -> list[str]:
        """The nodes whose slurmd launched a step of `job` (their logs: `launch task StepId=<job>.<step>`)."""
        ran = []
        for node in NODES:
            log = self.root / f"slurmd-{node}.log"
            if log.is_file() and f"launch task StepId={job}." in log.read_text(errors="replace"):
                ran.append(node)
        return ran

    def log_tails(self, lines: int = 30) -> str:
        """The last lines of the daemons' logs: why a job failed when its own log says nothing."""
        out = []
        for name in ("slurmctld.log", *(f"slurmd-{n}.log" for n in NODES)):
            path = self.root / name
            text = path.read_text(errors="replace").splitlines()[-lines:] if path.is_file() else ["(missing)"]
            out.append(f"--- {name}\n" + "\n".join(text))
        return "\n".join(out)

    def wait(self, job: int, timeout: float) -> str:
        deadline = time.time() + timeout
        while time.time() < deadline:
            state = self.job_state(job)
            if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
                return state
            time.sleep(2)
        subprocess.run(["scancel", str(job)], env=self.env)
        return "TIMEOUT (test)"

    def stop(self) -> None:
        for name in (*(f"slurmd-{n}" for n in NODES), "slurmctld"):
            pid_file = self.root / f"{name}.pid"
            if pid_file.is_file():
                try:
                    os.kill(int(pid_file.read_text()), signal.SIGTERM)
                except (ProcessLookupError, ValueError):
                    pass
