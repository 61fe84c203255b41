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
must see one run directory, which this command sets with hydra.run.dir).
"""

from __future__ import annotations

import argparse
import json
import os
import random
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


class Job:
    """One run directory's launches of torchrun; each launch in a session of its own, its processes found by it."""

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

    def processes(self) -> list[psutil.Process]:
        """Every live process this job has started (torchrun, the ranks, the engines, the reapers), remembered as
        they appear: a rank whose launcher was killed is no longer its descendant, and torchrun starts each rank in
        a session of its own."""
        try:
            root = psutil.Process(self.proc.pid)
            for p in [root, *root.children(recursive=True)]:
                self.seen.setdefault(p.pid, p)
        except psutil.NoSuchProcess:
            pass
        for p in list(self.seen.values()):
            try:
                for c in p.children(recursive=True):
                    self.seen.setdefault(c.pid, c)
            except psutil.NoSuchProcess:
                pass
        return [p for p in self.seen.values() if _alive(p)]

    def ranks(self) -> dict[int, psutil.Process]:
        """The current launch's ranks by RANK, the newest process of each (torchrun restarts them)."""
        found: dict[int, psutil.Process] = {}
        for p in self.processes():
            try:
                if p.ppid() == self.proc.pid and self.script in " ".join(p.cmdline()):
                    rank = int(p.environ().get("RANK", -1))
                    if rank not in found or p.create_time() > found[rank].create_time():
                        found[rank] = p
            except psutil.Error:
                pass
        return found

    def engines(self) -> list[psutil.Process]:
        out = []
        for p in self.processes():
            try:
                if "EngineCore" in p.name():
                    out.append(p)
            except psutil.Error:
                pass
        return sorted(out, key=lambda p: p.pid)

    def wait_gone(self, timeout: float = 180) -> None:
        deadline = time.time() + timeout
        while self.processes():
            if time.time() > deadline:
                raise RuntimeError(f"the processes of launch {self.launches} still run {timeout:.0f} s after it ended")
            time.sleep(0.2)


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


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


def inject(job: Job, fault: Fault, deadline: float) -> str:
    """Wait for the fault's victim to exist, then inject it; returns what was done."""
    while time.time() < deadline and job.proc.poll() is None:
        if fault.kind == "agent":
            job.proc.send_signal(signal.SIGKILL)
            return f"kill -9 of torchrun (pid {job.proc.pid})"
        ranks = job.ranks()
        everyone = set(ranks) >= set(range(job.nproc))
        if fault.kind == "sigterm" and everyone:
            for p in ranks.values():
                p.send_signal(signal.SIGTERM)
            return f"SIGTERM of every rank (pids {sorted(p.pid for p in ranks.values())})"
        if fault.kind == "rank" and everyone:
            rank = fault.victim % job.nproc
            ranks[rank].send_signal(signal.SIGKILL)
            return f"kill -9 of rank {rank} (pid {ranks[rank].pid})"
        if fault.kind == "engine" and (engines := job.engines()):
            p = engines[fault.victim % len(engines)]
            p.send_signal(signal.SIGKILL)
            return f"kill -9 of engine core {fault.victim % len(engines)} (pid {p.pid})"
        time.sleep(0.1)
    raise RuntimeError(f"no {fault.kind} to inject the fault into: the launch ended first")


def run_chaos(job: Job, plan: list[Fault], steps: int, timeout: float, say) -> list[str]:
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
        code = job.proc.poll()
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
                what = inject(job, fault, deadline)
                launcher_killed = fault.kind == "agent"
                seen_at_injection = set(metrics(job.run_dir))
                done.append(f"after step {fault.after_step} +{fault.delay_s:.2f} s: {what}")
                say(f"[moe-rl-chaos] {done[-1]}")
        time.sleep(0.05)


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


def main(argv: list[str] | None = None) -> int:
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
    parser.add_argument("overrides", nargs="*", help="after --: the job's key=value overrides")
    args = parser.parse_args(argv)
    kinds = tuple(k for k in args.kinds.split(",") if k)
    if bad := [k for k in kinds if k not in KINDS]:
        parser.error(f"--kinds: {', '.join(bad)} not among {', '.join(KINDS)}")
    if not Path(args.script).is_file():
        parser.error(f"--script {args.script} does not exist here: run from the repository root")
    if any(o.startswith(("hydra.run.dir=", "trainer.steps=", "trainer.checkpoint_every=")) for o in args.overrides):
        parser.error(
            "hydra.run.dir, trainer.steps and trainer.checkpoint_every are this command's (--out, --steps, "
            "--checkpoint-every)"
        )
    try:
        plan = schedule(args.seed, args.faults, args.steps, args.nproc, kinds)
    except ValueError as e:
        parser.error(str(e))
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
        if args.reference is None:
            print(f"[moe-rl-chaos] the reference run (undisturbed): {reference}", flush=True)
            ref = Job(reference, args.nproc, args.script, overrides, 0, log)
            ref.launch()
            if ref.proc.wait(timeout=args.timeout) != 0:
                print(f"[moe-rl-chaos] the reference run failed; see {out / 'chaos.log'}", file=sys.stderr)
                return 2
            ref.wait_gone()
        chaos_dir = out / "chaos_run"
        print(f"[moe-rl-chaos] the chaos run: {chaos_dir}", flush=True)
        job = Job(chaos_dir, args.nproc, args.script, overrides, len(plan), log)
        try:
            done = run_chaos(job, plan, args.steps, args.timeout, lambda line: print(line, flush=True))
        except (RuntimeError, TimeoutError) as e:
            print(f"[moe-rl-chaos] {e}; see {out / 'chaos.log'}", file=sys.stderr)
            if job.proc is not None and job.proc.poll() is None:
                os.killpg(job.proc.pid, signal.SIGKILL)
            return 2
    metric_diff = compare_metrics(reference, chaos_dir, args.steps)
    weight_diff = compare_weights(reference, chaos_dir, out)
    summary = {
        "seed": args.seed,
        "schedule": [asdict(f) for f in plan],
        "injected": done,
        "launches": job.launches,
        "steps": args.steps,
        "metrics_equal": metric_diff is None,
        "weights_equal": weight_diff is None,
        "first_difference": metric_diff or weight_diff,
        "seconds": round(time.time() - t0, 1),
    }
    print(json.dumps(summary), flush=True)
    return 0 if metric_diff is None and weight_diff is None else 1


if __name__ == "__main__":
    raise SystemExit(main())
