"""Checkpoints: megatron-core distributed checkpoints of the actor, its megatron optimizer (the
optimizers' own sharded state dicts) and every rank's RNG state, plus the trainer state (step,
data position, wandb run id).

Layout: `<dir>/step_000012/{model/, optimizer/, trainer.json, manifest.json}`; a save is written
to `<dir>/.step_000012.partial/` and renamed when complete; `<dir>/latest` names the newest
complete checkpoint and is written last, so a save cut short (a second SIGTERM, a node loss) is
never resumed. `model/` is a sharded checkpoint: it loads under another parallel layout (the HF
export runs at world 1 on a checkpoint saved with EP=2).

Every complete checkpoint has `manifest.json` (each file's size and CRC-32, computed by the
ranks in parallel), written after all ranks finished and before `latest`. Resume verifies it
first (`verify`): a damaged or incomplete checkpoint fails before any other work, naming the
file, what is wrong, and the newest older checkpoint that passes, with the override to resume
from it. Resume is all or nothing: a missing optimizer/ or trainer.json is an error, never a
silently re-initialised optimizer.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import re
import shutil
import signal
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from moe_rl.actor import lora
from moe_rl.common import progress
from moe_rl.common.distributed import all_gather_objects
from moe_rl.compat.megatron_checkpoint import optimizers_map_their_own_parameters, writes_in_this_process
from moe_rl.trainer.logger import say


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed as a whole."""


class CheckpointSaveError(CheckpointError):
    """A save that failed (a full disk, an I/O error), raised on every rank alike; the partial save is removed and
    the previous checkpoint stays what `latest` names."""


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def save_due(step: int, steps: int, every: int) -> bool:
    """Whether trainer.checkpoint_every (`every`: N > 0 every N steps, 0 the last step only, -1 never) saves after
    `step` of `steps` (a stop signal's save: whenever `every` >= 0, decided by the loops)."""
    return every >= 0 and (step == steps or (every > 0 and step % every == 0))


def signal_stop_warning(no_checkpoint_because: str | None) -> str:
    """The warning of a run a stop signal ended: after its checkpoint, or with the setting that meant none."""
    if no_checkpoint_because is None:
        return "stopped by a signal after saving a checkpoint"
    return f"stopped by a signal (no checkpoint: {no_checkpoint_because})"


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:06d}"


def latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint under `root`, or None."""
    marker = Path(root) / "latest"
    if not marker.is_file():
        return None
    path = Path(root) / marker.read_text().strip()
    if not path.is_dir():
        raise CheckpointError(f"{marker} names {path.name}, which does not exist")
    return path


MANIFEST = "manifest.json"
_CHUNK = 16 * 2**20


def _crc32(path: Path) -> str:
    crc = 0
    with path.open("rb") as f:
        while block := f.read(_CHUNK):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def _my_share(items: list, rank: int, world: int) -> list:
    return items[rank::world]


def write_manifest(path: Path) -> None:
    """Collective: every file's size and CRC-32 (files split over the ranks), written by rank 0."""
    rank, world = _rank_world()
    files = sorted(str(f.relative_to(path)) for f in path.rglob("*") if f.is_file() and f.name != MANIFEST)
    mine = {}
    for name in _my_share(files, rank, world):
        mine[name] = {"size": (path / name).stat().st_size, "crc32": _crc32(path / name)}
        progress.mark()
    entries = {k: v for part in all_gather_objects(mine) for k, v in part.items()}
    if rank == 0:
        (path / MANIFEST).write_text(json.dumps({"version": 1, "checksum": "crc32", "files": entries}, indent=1))


def problems(path: Path) -> list[str]:
    """What is wrong with one checkpoint folder ([] = it passes). Collective when distributed:
    the checksums are split over the ranks."""
    rank, world = _rank_world()
    manifest = path / MANIFEST
    if not path.is_dir():
        return [f"{path} does not exist"]
    if not manifest.is_file():
        return [f"{manifest} is missing: the save did not finish (or the folder is not a checkpoint)"]
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError) as e:
        return [f"{manifest} is unreadable ({e})"]
    found = []
    for name in _my_share(sorted(files), rank, world):
        f, want = path / name, files[name]
        if not f.is_file():
            found.append(f"{f} is missing")
        elif f.stat().st_size != want["size"]:
            found.append(
                f"{f} has {f.stat().st_size} bytes, the manifest says {want['size']} (truncated or overwritten)"
            )
        elif _crc32(f) != want["crc32"]:
            found.append(f"{f} does not match its checksum (crc32 {_crc32(f)}, manifest {want['crc32']}): corrupted")
    return sorted(x for part in all_gather_objects(found) for x in part)


def resume_point(root: Path, how: str, rank: int) -> Path | None:
    """resolve_resume, its warnings printed by rank 0."""
    path, notes = resolve_resume(root, how)
    for note in notes if rank == 0 else []:
        say(f"[moe-rl] WARNING: {note}")
    return path


def resolve_resume(root: Path, how: str) -> tuple[Path | None, list[str]]:
    """The checkpoint to resume for `trainer.resume` (auto | auto_skip_damaged | off | a path) and
    warnings to print; verifies it first. Collective when distributed. Under auto, a folder without any
    completed save starts fresh (with a warning if a save was cut short there).

    A damaged or missing checkpoint raises CheckpointError naming the folder, the file, what is wrong
    and the newest older checkpoint that passes, with the override to resume from it; under
    `auto_skip_damaged` that older checkpoint is resumed instead, with a warning."""
    if how == "off":
        return None, []
    root = Path(root)
    if how in ("auto", "auto_skip_damaged"):
        marker = root / "latest"
        if not marker.is_file():  # no save ever completed: a fresh start, said aloud if one was cut short
            cut = sorted(p.name for p in [*root.glob("step_*"), *root.glob(".step_*")] if p.is_dir())
            note = f"{root} holds {', '.join(cut)} but no complete checkpoint (a save cut short): starting fresh"
            return None, [note] if cut else []
        wanted = root / marker.read_text().strip()
    else:
        wanted = Path(how)
        root = wanted.parent
    found = problems(wanted)
    if not found:
        return wanted, []
    what = f"checkpoint {wanted} cannot be resumed: " + "; ".join(found[:5]) + (" ..." if len(found) > 5 else "")
    older = [p for p in sorted(root.glob("step_*"), reverse=True) if p.is_dir() and p.name < wanted.name]
    fallback = next((p for p in older if not problems(p)), None)
    if how == "auto_skip_damaged" and fallback is not None:
        return fallback, [f"{what}. RESUMING FROM THE OLDER CHECKPOINT {fallback} (trainer.resume=auto_skip_damaged)"]
    if fallback is not None:
        hint = (
            f"The newest older checkpoint that passes the check is {fallback}: resume from it with "
            f"trainer.resume={fallback} (or trainer.resume=auto_skip_damaged)."
        )
    else:
        hint = "No older checkpoint passes the check; start fresh with trainer.resume=off."
    raise CheckpointError(f"{what}. {hint}")


def model_sharded_state_dict(chunks: list[torch.nn.Module]) -> dict:
    """megatron's naming: `model` for one chunk, `model0`, `model1`, ... for virtual pipeline chunks. A LoRA actor
    (actor.lora): its adapters only, under `lora` (the base weights are the HF folder trainer.json names)."""
    if lora.has_lora(chunks):
        return {"lora": lora.sharded_state_dict(chunks)}
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict()}
    return {f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}


def _rng_object():
    # heavy: megatron-core, imported on first use
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    rank, world = _rank_world()
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    return ShardedObject("rng_state", state, (world,), (rank,), replica_id=0)


def save(root: str | Path, step: int, chunks, optimizer, trainer_state: dict, keep: int = 0, extra=None) -> Path:
    """Collective: every rank calls it. Returns the checkpoint folder. keep > 0: afterwards delete
    all but the newest `keep` complete checkpoints. `extra(folder)`: every rank writes its own further
    files (the replay buffer) into the folder before it is complete."""
    # heavy: megatron-core, imported on first use
    from megatron.core import dist_checkpointing

    rank, _ = _rank_world()
    path = step_dir(root, step)
    # Written under a hidden name and renamed when complete: an existing folder of the same step
    # (a re-run after resuming an older checkpoint, possibly the one `latest` names) stays intact
    # until its replacement is whole, and a save cut short never carries a step_* name.
    partial = path.with_name(f".{path.name}.partial")
    if rank == 0:
        if partial.exists():
            shutil.rmtree(partial)
        (partial / "model").mkdir(parents=True)
        (partial / "optimizer").mkdir()
    if dist.is_initialized():
        dist.barrier()

    states: dict[str, dict] = {}

    def prepare() -> None:  # what this rank saves, built without a collective: a rank that fails here fails before
        # any rank starts megatron's collective writes, and the gather after it tells every rank (a failure between
        # two writes left the other rank inside the next write's collectives: the gathers fell out of step)
        states["model"] = {**model_sharded_state_dict(chunks), "rng_state": _rng_object()}
        states["optimizer"] = {"optimizer": _optimizer_sharded_state_dict(chunks, optimizer)}

    def write() -> None:  # every rank's files (megatron's writes are collective: a failure raises on every rank)
        writes_in_this_process()
        dist_checkpointing.save(states["model"], str(partial / "model"))
        progress.mark()
        dist_checkpointing.save(states["optimizer"], str(partial / "optimizer"))
        progress.mark()
        if rank == 0:
            (partial / "trainer.json").write_text(json.dumps({"step": step, **trainer_state}, indent=1))
        if extra is not None:
            extra(partial)

    def commit() -> None:
        with _signals_held():
            _commit(root, path, partial)

    _agreed(prepare, root, step, partial)
    _agreed(write, root, step, partial)
    _agreed(lambda: write_manifest(partial), root, step, partial)  # after every rank's files, before `latest`
    _agreed(commit if rank == 0 else lambda: None, root, step, partial)
    if rank == 0:
        older = sorted(p for p in Path(root).glob("step_*") if p.is_dir() and p != path)
        for old in older[: max(0, len(older) - keep + 1)] if keep > 0 else []:
            shutil.rmtree(old)
    if dist.is_initialized():
        dist.barrier()  # no rank returns before the checkpoint has its final name
    return path


def _agreed(fn, root: Path, step: int, partial: Path) -> None:
    """Collective: run `fn` on every rank; if it raised on any, every rank raises CheckpointSaveError naming the
    rank, the error and the free space (rank 0 first removes the partial save), rather than the others waiting for
    the failed rank in the next collective."""
    rank, _ = _rank_world()
    try:
        fn()
        error = None
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # an OSError (ENOSPC, EIO), or torch's CheckpointException (a BaseException)
        error = f"rank {rank}: {_cause(e)}"
        # said at once: if this rank left `fn` inside a collective the others are still in, the gather below pairs
        # with theirs and nothing after it is reliable
        say(f"[moe-rl] checkpoint step {step}: {error}")
        # and where it was raised: a failure that is not the disk's (an intermittent one in a library) is then
        # located by the first run that meets it
        logging.getLogger("moe_rl").warning("checkpoint step %d: rank %d: traceback", step, rank, exc_info=e)
    free = shutil.disk_usage(root).free if error is not None else None  # before the partial save is removed
    gathered = all_gather_objects((error, free))
    if not all(isinstance(g, tuple) and len(g) == 2 for g in gathered):
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise CheckpointSaveError(
            f"checkpoint step {step}: the ranks' collectives fell out of step during the save (a rank left a "
            "collective write early; its error is printed above as '[moe-rl] checkpoint step ...: rank N: ...')"
        )
    found = [(e, f) for e, f in gathered if e is not None]
    if not found:
        return
    errors = [e for e, _ in found if not e.endswith(OTHER_RANK)] or [e for e, _ in found]  # where it happened
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
    raise CheckpointSaveError(save_failure(root, step, errors, min(f for _, f in found)))


OTHER_RANK = "the save failed on another rank"


def _cause(e: BaseException) -> str:
    """The error's text, with torch's CheckpointException unwrapped to each failed rank's own error."""
    failures = getattr(e, "failures", None)  # CheckpointException: {rank: exception or (exception, traceback)}
    if not isinstance(failures, dict):
        return f"{type(e).__name__}: {e}"
    own = [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return "; ".join(f"{type(f).__name__}: {f}" for f in own) or OTHER_RANK


def save_failure(root: Path, step: int, errors: list[str], free: int) -> str:
    """The message of a failed save: where, what, the free space (`free` bytes when it failed) beside the last
    complete checkpoint's size, and what stays resumable."""
    root = Path(root)
    usage = shutil.disk_usage(root)
    try:
        last = latest(root)
    except CheckpointError:
        last = None
    mib = 2**20
    if last is not None:
        size = sum(f.stat().st_size for f in last.rglob("*") if f.is_file())
        kept = (
            f"{last.name}, {size / mib:.1f} MiB, is intact and stays the one `latest` names: resume from it with "
            "trainer.resume=auto once there is room"
        )
    else:
        kept = "no earlier checkpoint exists"
    return (
        f"checkpoint step {step}: saving to {root} failed ({'; '.join(errors)[:600]}). {root} has "
        f"{free / mib:.1f} MiB free of {usage.total / mib:.1f} MiB (a full disk?); the partial save was "
        f"removed; {kept}"
    )


def _commit(root: str | Path, path: Path, partial: Path) -> None:
    """Give the complete save its step_* name, then point `latest` at it."""
    if path.exists():
        replaced = path.with_name(f".{path.name}.replaced")
        if replaced.exists():  # left by a crash between the two renames below
            shutil.rmtree(replaced)
        path.rename(replaced)
        partial.rename(path)
        shutil.rmtree(replaced)
    else:
        partial.rename(path)
    (Path(root) / "latest.tmp").write_text(path.name)
    (Path(root) / "latest.tmp").replace(Path(root) / "latest")  # atomic: `latest` is never half-written


_HELD = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Stop signals that arrive inside the block are handled when it ends, as they would have been.

    The commit (rename, then `latest`) takes milliseconds; a second SIGTERM exits a rank at once (StopFlag),
    and one landing between the rename and `latest` left a complete checkpoint that `latest` did not name
    (seen in CI). Only the main thread can swap handlers; elsewhere the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []
    before = {sig: signal.signal(sig, lambda signum, frame: arrived.append(signum)) for sig in _HELD}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
        for signum in arrived:
            handler = before[signal.Signals(signum)]
            if callable(handler):
                handler(signum, None)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(signum)


def load_model(path: str | Path, chunks, extra: dict | None = None) -> dict:
    """Load the actor weights (any parallel layout) from a checkpoint folder; `extra` sharded
    entries stored beside them (the RNG states) come back in the returned dict."""
    # heavy: megatron-core, imported on first use
    from megatron.core import dist_checkpointing

    model_dir = Path(path) / "model"
    if not (model_dir / "metadata.json").is_file():
        raise CheckpointError(f"{path} holds no model checkpoint ({model_dir}/metadata.json missing)")
    sharded = model_sharded_state_dict(chunks)
    saved = _saved_keys(model_dir)
    if ("lora" in sharded) != any(k.endswith(".lora.a") for k in saved):
        kind = "adapters only (a LoRA run)" if "lora" not in sharded else "full weights (no actor.lora)"
        raise CheckpointError(
            f"{path} holds {kind}: load it with the actor.lora settings it was trained with (actor.lora.rank)"
        )
    loaded = dist_checkpointing.load({**sharded, **(extra or {})}, str(model_dir))
    if "lora" in sharded:
        lora.load_state_dict(chunks, loaded["lora"])
        return loaded
    for i, c in enumerate(chunks):
        c.load_state_dict(loaded["model" if len(chunks) == 1 else f"model{i}"], strict=True)
    return loaded


def _saved_keys(model_dir: Path) -> list[str]:
    # heavy: torch.distributed.checkpoint, imported on first use
    from torch.distributed.checkpoint import FileSystemReader

    return list(FileSystemReader(str(model_dir)).read_metadata().state_dict_metadata)


def saved_state(path: str | Path) -> dict:
    """The trainer state (trainer.json: step, data position, sizes, wandb run id) of the checkpoint at `path`, without
    loading it; {} where that file is missing (`load` refuses such a checkpoint)."""
    saved = Path(path) / "trainer.json"
    return json.loads(saved.read_text()) if saved.is_file() else {}


def saved_world(path: str | Path) -> int | None:
    """How many ranks wrote the checkpoint at `path` (from its per-rank RNG entries); None if it holds none."""
    keys = _saved_keys(Path(path) / "model")
    worlds = {int(m.group(1)) for k in keys if (m := re.fullmatch(r"rng_state/shard_\d+_(\d+)", k))}
    return worlds.pop() if len(worlds) == 1 else None


def load(path: str | Path, chunks, optimizer) -> dict:
    """Restore model, optimizer and, where the checkpoint was written by as many ranks, this rank's RNG; returns
    trainer.json. Refuses partial checkpoints. (The RNG states are per rank: under another world size there is no
    rank whose state this one continues, and each rank keeps the state its start-up seeding gave it.)"""

    path = Path(path)
    for piece, what in (("optimizer/metadata.json", "optimizer state"), ("trainer.json", "trainer state")):
        if not (path / piece).is_file():
            raise CheckpointError(
                f"cannot resume from {path}: its {what} ({piece}) is missing. Resuming without it would "
                "silently restart that state; restore the file or start a fresh run (trainer.resume=off)."
            )
    if saved_world(path) == _rank_world()[1]:
        rng = load_model(path, chunks, {"rng_state": _rng_object()})["rng_state"]
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
    else:
        load_model(path, chunks)
    _load_optimizer(path / "optimizer", chunks, optimizer)
    return json.loads((path / "trainer.json").read_text())


def _optimizer_sharded_state_dict(chunks, optimizer, is_loading: bool = False) -> dict:
    optimizers_map_their_own_parameters()  # the dense and the expert optimizer: each finds its own parameters only
    return optimizer.sharded_state_dict(model_sharded_state_dict(chunks), is_loading=is_loading)


def _load_optimizer(folder: Path, chunks, optimizer) -> None:
    # heavy: megatron-core, imported on first use
    from megatron.core import dist_checkpointing

    sharded = {"optimizer": _optimizer_sharded_state_dict(chunks, optimizer, is_loading=True)}
    optimizer.load_state_dict(dist_checkpointing.load(sharded, str(folder))["optimizer"])


def save_part(folder: str | Path, chunks, optimizer) -> None:
    """Collective: one more model's weights and optimizer state (the critic) in `folder`/{model,optimizer},
    inside a checkpoint being written (checkpoint.save's `extra`)."""
    # heavy: megatron-core, imported on first use
    from megatron.core import dist_checkpointing

    folder = Path(folder)
    if _rank_world()[0] == 0:
        (folder / "model").mkdir(parents=True)
        (folder / "optimizer").mkdir()
    if dist.is_initialized():
        dist.barrier()
    model_state = model_sharded_state_dict(chunks)  # both built before this part's collective writes, as in `save`
    optimizer_state = {"optimizer": _optimizer_sharded_state_dict(chunks, optimizer)}
    writes_in_this_process()
    dist_checkpointing.save(model_state, str(folder / "model"))
    dist_checkpointing.save(optimizer_state, str(folder / "optimizer"))


def load_part(folder: str | Path, chunks, optimizer) -> None:
    """Restore what `save_part` wrote; a checkpoint without it is named with what to do."""
    folder = Path(folder)
    if not (folder / "optimizer" / "metadata.json").is_file():
        raise CheckpointError(
            f"cannot resume from {folder.parent}: it has no {folder.name} state ({folder.name}/optimizer missing; "
            f"saved by a run without the {folder.name}?). Start a fresh run (trainer.resume=off) or resume with "
            "the settings it was saved with."
        )
    load_model(folder, chunks)
    _load_optimizer(folder / "optimizer", chunks, optimizer)
