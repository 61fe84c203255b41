"""moe-rl-chaos: a training job hit again and again must end where an undisturbed one ends.

Runs the job twice from the repository root: once undisturbed (the reference), once under `torchrun --max-restarts`
with faults injected at times drawn from a seed: kill -9 of a rank, of an engine core, of torchrun's agent (the job
is then launched again, as a user would), and SIGTERM of the ranks (a preemption: they checkpoint and exit; the job
is launched again, as a Slurm requeue would). Each fault lands 0 to 1 s (drawn) after the run logs a step drawn from
the seed, later than the one before it. Resumed segments train again the steps after their checkpoint; at the end
the chaos run's metrics.jsonl must equal the reference's value for value, step by step (the machine's numbers
aside: time/*, perf/*, memory/*, weight_sync/seconds and weight_sync/gb_per_s), and its final weights must be
bitwise equal. Prints the seed and the schedule first, each fault as it lands, and one JSON line at the end; exit
code 0 when both are equal, 1 when not (naming the first difference), 2 when a launch failed on its own.

The job is `launch/train_moe.py` with the overrides given after `--` (a user's own config runs as it is; every rank
must see one run directory, which this command sets with hydra.run.dir). With --slurm TEMPLATE both runs are jobs of
that sbatch template instead (its RUN_DIR set): a fault on a rank, an engine or torchrun lands on the job's first
node through `srun --overlap` and fails the job, which is submitted again; SIGTERM is `scancel --batch
--signal=TERM`, the time-limit signal, after which the template checkpoints and requeues the job.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

KINDS = ("rank", "engine", "agent", "sigterm")
MACHINE = ("time/", "perf/", "memory/", "weight_sync/seconds", "weight_sync/gb_per_s")  # not compared

EXAMPLES = """examples:
  moe-rl-chaos --seed 7                                  # the default job, 10 steps, 3 faults of 3 kinds
  moe-rl-chaos --seed 7 --slurm launch/slurm/single_node.sbatch --sbatch-args "-p debug"   # as Slurm jobs
  moe-rl-chaos --seed 7 --faults 4 --steps 20 --checkpoint-every 4 --out /scratch/chaos -- rollout.engines=1
  moe-rl-chaos --seed 7 --reference /scratch/chaos/reference   # reuse an undisturbed run of the same settings
"""


@dataclass
class Fault:
    kind: str  # one of KINDS
    after_step: int  # lands once the run (as it is now) has logged this step ...
    delay_s: float  # ... and this long after
    victim: int  # which rank (rank kind) or engine (engine kind), modulo how many there are

    def __str__(self) -> str:
        what = {"rank": f"kill -9 of rank {self.victim}", "engine": f"kill -9 of an engine core (#{self.victim} mod n)"}
        what |= {"agent": "kill -9 of torchrun's agent (then launched again)", "sigterm": "SIGTERM of every rank"}
        return f"after step {self.after_step} +{self.delay_s:.2f} s: {what[self.kind]}"


def schedule(seed: int, faults: int, steps: int, nproc: int, kinds: tuple[str, ...] = KINDS) -> list[Fault]:
    """`faults` faults at distinct steps in 1..steps-1, in step order; their kinds cycle through `kinds` shuffled (so
    any `len(kinds)` faults in a row are of different kinds)."""
    if not 1 <= faults < steps:
        raise ValueError(f"--faults {faults}: choose 1 to {steps - 1} (one fault per step, before the last step)")
    rng = random.Random(seed)
    order = rng.sample(kinds, len(kinds))
    at = sorted(rng.sample(range(1, steps), faults))
    return [
        Fault(order[i % len(order)], s, round(rng.uniform(0.0, 1.0), 2), rng.randrange(nproc)) for i, s in enumerate(at)
    ]


def local_processes(run_dir: Path) -> tuple[list[psutil.Process], dict[int, psutil.Process], list[psutil.Process]]:
    """This host's processes of the run in `run_dir`: its torchrun agents, its ranks by RANK (the newest process of
    each: torchrun restarts them) and its engine cores, found by the hydra.run.dir argument they carry."""
    tag = f"hydra.run.dir={run_dir}"
    agents, others, ranks, engines = [], [], {}, []
    for p in psutil.process_iter(["cmdline", "ppid"]):
        cmd = p.info["cmdline"] or []
        if tag not in cmd or os.path.basename(cmd[0]) == "srun":
            continue
        if "torch.distributed.run" in cmd or any(os.path.basename(c) == "torchrun" for c in cmd[:2]):
            agents.append(p)
        else:
            others.append(p)
    for p in others:  # a rank is a child of an agent (the processes a rank forks carry its command line too)
        try:
            rank = int(p.environ().get("RANK", -1))
            if p.info["ppid"] in {a.pid for a in agents} and rank >= 0:
                if rank not in ranks or p.create_time() > ranks[rank].create_time():
                    ranks[rank] = p
        except psutil.Error:
            pass
    for p in ranks.values():
        try:
            engines += [c for c in p.children(recursive=True) if "EngineCore" in c.name()]
        except psutil.Error:
            pass
    return agents, ranks, sorted(engines, key=lambda p: p.pid)


def inject_here(kind: str, run_dir: Path, victim: int, nproc: int) -> str | None:
    """Inject a fault of `kind` into the run's processes on this host; what was done, or None when its victim is
    not there (yet)."""
    agents, ranks, engines = local_processes(run_dir)
    if kind == "agent" and agents:
        for p in agents:
            p.send_signal(signal.SIGKILL)
        return f"kill -9 of torchrun (pid {', '.join(str(p.pid) for p in agents)})"
    if kind in ("rank", "sigterm") and set(ranks) >= set(range(nproc)):
        if kind == "sigterm":
            for p in ranks.values():
                p.send_signal(signal.SIGTERM)
            return f"SIGTERM of every rank (pids {sorted(p.pid for p in ranks.values())})"
        ranks[victim % nproc].send_signal(signal.SIGKILL)
        return f"kill -9 of rank {victim % nproc} (pid {ranks[victim % nproc].pid})"
    if kind == "engine" and engines:
        p = engines[victim % len(engines)]
        p.send_signal(signal.SIGKILL)
        return f"kill -9 of engine core {victim % len(engines)} (pid {p.pid})"
    return None


class Job:
    """One run directory's launches of torchrun on this host, each in a session of its own."""

    poll_s = 0.05
    ends_on = {"agent"}  # faults after which the launch ends (torchrun restarts its ranks after the others)

    def __init__(self, run_dir: Path, nproc: int, script: str, overrides: list[str], max_restarts: int, log):
        self.run_dir, self.nproc, self.script, self.overrides = run_dir, nproc, script, overrides
        self.max_restarts, self.log = max_restarts, log
        self.proc: subprocess.Popen | None = None
        self.launches = 0
        self.seen: dict[int, psutil.Process] = {}

    def launch(self) -> None:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={self.nproc}"]
        if self.max_restarts:
            cmd.append(f"--max-restarts={self.max_restarts}")
        cmd += [self.script, f"hydra.run.dir={self.run_dir}", *self.overrides]
        self.launches += 1
        self.log.write(f"\n[moe-rl-chaos] launch {self.launches}: {' '.join(cmd)}\n")
        self.log.flush()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def ended(self) -> int | None:
        """The launch's exit code; None while it runs."""
        return self.proc.poll()

    def inject(self, fault: Fault, deadline: float) -> str:
        """Wait for the fault's victim, then inject it; returns what was done."""
        while time.time() < deadline and self.proc.poll() is None:
            if fault.kind == "agent":
                self.proc.send_signal(signal.SIGKILL)
                return f"kill -9 of torchrun (pid {self.proc.pid})"
            if (done := inject_here(fault.kind, self.run_dir, fault.victim, self.nproc)) is not None:
                return done
            time.sleep(0.1)
        raise RuntimeError(f"no {fault.kind} to inject the fault into: the launch ended first")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)

    def processes(self) -> list[psutil.Process]:
        """Every live process this launch started (torchrun, the ranks, the engines, the reapers)."""
        return remember(self.proc.pid, self.seen)

    def wait_gone(self, timeout: float = 180) -> None:
        deadline = time.time() + timeout
        while self.processes():
            if time.time() > deadline:
                raise RuntimeError(f"the processes of launch {self.launches} still run {timeout:.0f} s after it ended")
            time.sleep(0.2)


class SlurmJob:
    """One run directory's jobs of an sbatch template (launch/slurm/*.sbatch), whose RUN_DIR it sets. Faults land
    on the job's first node through `srun --overlap` (this command with --inject), SIGTERM through `scancel --batch
    --signal=TERM` (the time-limit signal, after which the template checkpoints and requeues). A job that failed is
    submitted again, as a user would; a requeued one is started 5 s after its nodes are free, not Slurm's 2 minutes
    later."""

    poll_s = 1.0
    ends_on = {"agent", "rank", "engine"}  # the templates run torchrun without restarts: the job fails

    def __init__(self, run_dir: Path, nproc: int, template: str, overrides: list[str], sbatch_args: list[str], log):
        self.run_dir, self.nproc, self.template, self.overrides = run_dir, nproc, template, overrides
        self.sbatch_args, self.log = sbatch_args, log
        self.job: int | None = None
        self.launches = 0
        self.hurried = 0  # the restart count whose start was brought forward

    def launch(self) -> None:
        out = self.run_dir.parent / f"{self.run_dir.name}-slurm-%j.out"
        cmd = ["sbatch", "--parsable", f"--output={out}", *self.sbatch_args, self.template, *self.overrides]
        env = {**os.environ, "RUN_DIR": str(self.run_dir), "NPROC": str(self.nproc)}
        self.launches += 1
        submitted = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if submitted.returncode:
            raise RuntimeError(f"sbatch failed: {submitted.stderr.strip()}")
        self.job = int(submitted.stdout.strip().split(";")[0])
        self.hurried = 0
        self.log.write(f"\n[moe-rl-chaos] launch {self.launches}: job {self.job}: {' '.join(cmd)}\n")
        self.log.flush()

    def show(self) -> dict[str, str]:
        shown = subprocess.run(["scontrol", "-o", "show", "job", str(self.job)], capture_output=True, text=True)
        return dict(kv.split("=", 1) for kv in shown.stdout.split() if "=" in kv)

    def ended(self) -> int | None:
        info = self.show()
        state, restarts = info.get("JobState", "UNKNOWN"), int(info.get("Restarts", "0"))
        if state == "PENDING" and restarts > self.hurried and info.get("Reason") == "BeginTime":
            update = ["scontrol", "update", f"JobId={self.job}", "StartTime=now+5"]
            if subprocess.run(update, capture_output=True).returncode == 0:
                self.hurried = restarts
        if state == "COMPLETED":
            return 0
        if state in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"):
            return int(info.get("ExitCode", "1:0").split(":")[0]) or 1
        return None

    def inject(self, fault: Fault, deadline: float) -> str:
        while time.time() < deadline and self.ended() is None:
            if self.show().get("JobState") != "RUNNING":
                time.sleep(1)
                continue
            if fault.kind == "sigterm":
                subprocess.run(["scancel", "--batch", "--signal=TERM", str(self.job)], check=True)
                return f"scancel --batch --signal=TERM {self.job} (the time-limit signal: checkpoint, requeue)"
            here = [sys.executable, "-m", "moe_rl.tools.chaos", "--inject", fault.kind, "--run-dir", str(self.run_dir)]
            here += ["--victim", str(fault.victim), "--nproc", str(self.nproc)]
            cmd = ["srun", f"--jobid={self.job}", "--overlap", "--nodes=1", "--ntasks=1", *here]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode == 0:
                return f"{done.stdout.strip()} on job {self.job}'s first node"
            time.sleep(1)
        raise RuntimeError(f"no {fault.kind} to inject the fault into: job {self.job} ended first")

    def stop(self) -> None:
        if self.job is not None:
            subprocess.run(["scancel", str(self.job)], check=False)

    def wait_gone(self, timeout: float = 180) -> None:
        """Slurm ends a job's processes before it reports the job ended."""


def alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def remember(root_pid: int, seen: dict[int, psutil.Process]) -> list[psutil.Process]:
    """Add the descendants of `root_pid` and of every process in `seen` to `seen` (by pid), and return the live ones:
    remembered as they appear, a rank whose launcher was killed stays known (it is no longer a descendant), and so
    do the processes of a rank that torchrun started in a session of its own."""
    for root in [root_pid, *list(seen)]:
        try:
            p = psutil.Process(root) if root not in seen else seen[root]
            for q in [p, *p.children(recursive=True)]:
                seen.setdefault(q.pid, q)
        except psutil.NoSuchProcess:
            pass
    return [p for p in seen.values() if alive(p)]


def metrics(run_dir: Path) -> list[str]:
    path = run_dir / "metrics.jsonl"
    return path.read_text().splitlines() if path.is_file() else []


def last_records(run_dir: Path) -> dict[int, dict]:
    """The last record of each step in metrics.jsonl."""
    out: dict[int, dict] = {}
    for line in metrics(run_dir):
        record = json.loads(line)
        out[record["step"]] = record
    return out


def run_chaos(job: Job | SlurmJob, plan: list[Fault], steps: int, timeout: float, say) -> list[str]:
    """Launch, inject each fault when due, launch again whenever the job ended before its last step; returns what
    was injected."""
    deadline = time.time() + timeout
    done: list[str] = []
    seen_at_injection: set[str] = set()  # metrics lines that existed when the last fault landed
    pending = list(plan)
    launcher_killed = False  # the launch's end is the fault's doing
    job.launch()
    while True:
        if time.time() > deadline:
            raise TimeoutError(f"the chaos run did not finish within {timeout:.0f} s")
        code = job.ended()
        if code is not None:
            job.wait_gone()
            reached = max(last_records(job.run_dir), default=0)
            if reached >= steps and code == 0:
                if pending:
                    raise RuntimeError(f"the run finished before the fault '{pending[0]}' could land")
                return done
            if code != 0 and not launcher_killed:  # torchrun gave up: restarts used up, or a failure of its own
                raise RuntimeError(f"launch {job.launches} failed (exit code {code}) at step {reached}; see the log")
            done.append(f"launch {job.launches} ended (exit code {code}) at step {reached}: launched again")
            say(f"[moe-rl-chaos] {done[-1]}")
            launcher_killed = False
            job.launch()
            continue
        if pending:
            new = [json.loads(line)["step"] for line in metrics(job.run_dir) if line not in seen_at_injection]
            if new and max(new) >= pending[0].after_step:
                fault = pending.pop(0)
                time.sleep(fault.delay_s)
                what = job.inject(fault, deadline)
                launcher_killed = fault.kind in job.ends_on
                seen_at_injection = set(metrics(job.run_dir))
                done.append(f"after step {fault.after_step} +{fault.delay_s:.2f} s: {what}")
                say(f"[moe-rl-chaos] {done[-1]}")
        time.sleep(job.poll_s)


def compare_metrics(reference: Path, chaos: Path, steps: int) -> str | None:
    """The first difference between the runs' last records per step (None: equal)."""
    a, b = last_records(reference), last_records(chaos)
    for step in range(1, steps + 1):
        if step not in a or step not in b:
            return f"step {step} is missing from {'the reference' if step not in a else 'the chaos run'}"
        ra = {k: v for k, v in a[step].items() if not k.startswith(MACHINE)}
        rb = {k: v for k, v in b[step].items() if not k.startswith(MACHINE)}
        for key in sorted(set(ra) | set(rb)):
            if ra.get(key) != rb.get(key):
                return f"step {step}, {key}: reference {ra.get(key)!r}, chaos run {rb.get(key)!r}"
    return None


def compare_weights(reference: Path, chaos: Path, out: Path) -> str | None:
    """The first tensor of the final checkpoints' model/ that differs in any bit (None: equal)."""
    # heavy: torch, imported on first use
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    loaded = []
    for name, run in (("reference", reference), ("chaos", chaos)):
        marker = run / "checkpoints" / "latest"
        if not marker.is_file():
            return f"the {name} run has no final checkpoint ({marker})"
        dcp_to_torch_save(run / "checkpoints" / marker.read_text().strip() / "model", out / f"{name}.pt")
        loaded.append(torch.load(out / f"{name}.pt", weights_only=False))
    a, b = (_tensors(x) for x in loaded)
    if set(a) != set(b):
        return f"the checkpoints hold other tensors: {sorted(set(a) ^ set(b))[:5]}"
    for key in sorted(a):
        if a[key].dtype != b[key].dtype or not torch.equal(
            a[key].view(-1).view(torch.uint8), b[key].view(-1).view(torch.uint8)
        ):
            return f"weight {key} differs"
    return None


def _tensors(tree, prefix: str = "") -> dict:
    # heavy: torch, imported on first use
    import torch

    if isinstance(tree, torch.Tensor):
        return {prefix: tree.contiguous()}
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _tensors(sub, f"{prefix}/{key}").items()}
    return {}


def _parser() -> argparse.ArgumentParser:
    """The command line; --inject, --run-dir and --victim (hidden) are what a Slurm job runs on a node via srun."""
    parser = argparse.ArgumentParser(
        prog="moe-rl-chaos",
        description=__doc__.split("\n\n")[0] + " " + __doc__.split("\n\n")[1],
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--seed", type=int, default=0, help="draws the schedule: kinds, steps, delays, victims")
    parser.add_argument("--faults", type=int, default=3, help="faults to inject (default 3)")
    parser.add_argument(
        "--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)} (default all)"
    )
    parser.add_argument("--steps", type=int, default=10, help="trainer.steps of both runs (default 10)")
    parser.add_argument("--checkpoint-every", type=int, default=2, help="trainer.checkpoint_every (default 2)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (torchrun --nproc-per-node, default 2)")
    parser.add_argument("--out", type=Path, default=Path("chaos"), help="folder of both runs (default ./chaos)")
    parser.add_argument("--reference", type=Path, help="an undisturbed run of the same settings to compare with")
    parser.add_argument("--script", default="launch/train_moe.py", help="the training script (default: the RL loop)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds each run may take (default 1800)")
    parser.add_argument(
        "--slurm",
        metavar="TEMPLATE",
        help="run both as jobs of this sbatch template (launch/slurm/single_node.sbatch) instead of torchrun here",
    )
    parser.add_argument("--sbatch-args", default="", help="more sbatch arguments with --slurm, e.g. '-p debug'")
    parser.add_argument("--inject", choices=KINDS, help=argparse.SUPPRESS)  # on a job's node, through srun
    parser.add_argument("--run-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--victim", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="after --: the job's key=value overrides")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the reference (unless --reference names one) and the chaos run, print the JSON summary; the exit code
    is the module docstring's (0 equal, 1 not, 2 a launch failed on its own; --inject: 0 done, 3 no victim)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.inject:  # the fault itself, on the node `srun --overlap` chose: 0 done, 3 no victim here yet
        done = inject_here(args.inject, args.run_dir.resolve(), args.victim, args.nproc)
        print(done or f"no {args.inject} of {args.run_dir} on this node")
        return 0 if done else 3
    plan = _checked_plan(parser, args)
    overrides = [f"trainer.steps={args.steps}", f"trainer.checkpoint_every={args.checkpoint_every}", *args.overrides]
    print(
        f"[moe-rl-chaos] seed {args.seed}: {len(plan)} faults over {args.steps} steps, a checkpoint every "
        f"{args.checkpoint_every}",
        flush=True,
    )
    for fault in plan:
        print(f"[moe-rl-chaos]   {fault}", flush=True)
    out = args.out.resolve()
    if out.exists() and any(out.iterdir()):  # a run directory resumes what it holds: both runs start fresh
        parser.error(f"--out {out} is not empty: give an empty or new folder")
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with (out / "chaos.log").open("a") as log:
        reference = args.reference.resolve() if args.reference else out / "reference"
        sbatch_args = shlex.split(args.sbatch_args)

        def job_for(run_dir: Path, restarts: int) -> Job | SlurmJob:
            if args.slurm:
                return SlurmJob(run_dir, args.nproc, args.slurm, overrides, sbatch_args, log)
            return Job(run_dir, args.nproc, args.script, overrides, restarts, log)

        if args.reference is None and not _reference_run(job_for, reference, args.timeout, out):
            return 2
        chaos_dir = out / "chaos_run"
        print(f"[moe-rl-chaos] the chaos run: {chaos_dir}", flush=True)
        job = job_for(chaos_dir, len(plan))
        try:
            done = run_chaos(job, plan, args.steps, args.timeout, lambda line: print(line, flush=True))
        except (RuntimeError, TimeoutError) as e:
            print(f"[moe-rl-chaos] {e}; see {out / 'chaos.log'}", file=sys.stderr)
            job.stop()
            return 2
    metric_diff = compare_metrics(reference, chaos_dir, args.steps)
    weight_diff = compare_weights(reference, chaos_dir, out)
    print(json.dumps(_summary(args, plan, done, job.launches, metric_diff, weight_diff, t0)), flush=True)
    return 0 if metric_diff is None and weight_diff is None else 1


def _checked_plan(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[Fault]:
    """The fault schedule the options draw, after refusing (parser.error) options this command cannot run: an
    unknown kind, a missing script or sbatch template, an override of a key the command sets itself."""
    kinds = tuple(k for k in args.kinds.split(",") if k)
    if bad := [k for k in kinds if k not in KINDS]:
        parser.error(f"--kinds: {', '.join(bad)} not among {', '.join(KINDS)}")
    if not Path(args.script).is_file():
        parser.error(f"--script {args.script} does not exist here: run from the repository root")
    if args.slurm and not Path(args.slurm).is_file():
        parser.error(f"--slurm {args.slurm} does not exist here: run from the repository root")
    if any(o.startswith(("hydra.run.dir=", "trainer.steps=", "trainer.checkpoint_every=")) for o in args.overrides):
        parser.error(
            "hydra.run.dir, trainer.steps and trainer.checkpoint_every are this command's (--out, --steps, "
            "--checkpoint-every)"
        )
    try:
        return schedule(args.seed, args.faults, args.steps, args.nproc, kinds)
    except ValueError as e:
        parser.error(str(e))


def _reference_run(job_for, reference: Path, timeout: float, out: Path) -> bool:
    """The undisturbed run into `reference` (`job_for(run_dir, restarts)` makes its job), waited for until it ends
    or `timeout` s pass; False, said on stderr, when it did not end well."""
    print(f"[moe-rl-chaos] the reference run (undisturbed): {reference}", flush=True)
    ref = job_for(reference, 0)
    ref.launch()
    deadline = time.time() + timeout
    while (code := ref.ended()) is None and time.time() < deadline:
        time.sleep(ref.poll_s)
    if code != 0:
        print(f"[moe-rl-chaos] the reference run failed ({code}); see {out}", file=sys.stderr)
        ref.stop()
        return False
    ref.wait_gone()
    return True


def _summary(
    args: argparse.Namespace,
    plan: list[Fault],
    injected: list[str],
    launches: int,
    metric_diff: str | None,
    weight_diff: str | None,
    t0: float,
) -> dict:
    """The final JSON line: the schedule, what landed, and whether metrics and weights came out equal."""
    return {
        "seed": args.seed,
        "schedule": [asdict(f) for f in plan],
        "injected": injected,
        "launches": launches,
        "steps": args.steps,
        "metrics_equal": metric_diff is None,
        "weights_equal": weight_diff is None,
        "first_difference": metric_diff or weight_diff,
        "seconds": round(time.time() - t0, 1),
    }


if __name__ == "__main__":
    raise SystemExit(main())
