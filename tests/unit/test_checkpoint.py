"""Checkpoints at world 1: exact round trip of model + Adam state + RNG, refusal of partial
checkpoints, and the HF export compared with transformers."""

from __future__ import annotations

import json
import shutil
import traceback

import pytest
import torch

from moe_rl.actor.config import ParallelConfig
from moe_rl.actor.model import ModelOptions, build_model, load_hf_config
from moe_rl.actor.optimizer import build_optimizer
from moe_rl.actor.weights import load_hf_weights
from moe_rl.tools.export_hf import export
from moe_rl.trainer import checkpoint
from tests.reference import hf_forward, load_hf, untied_batch
from tests.unit.test_actor_world1 import _megatron_logits_and_topk


def _actor_and_adam(path, dtype: str = "float32"):
    chunks, conv = build_model(load_hf_config(path), ParallelConfig(), ModelOptions(dtype=dtype))
    load_hf_weights(chunks, conv, path)
    return chunks, build_optimizer(chunks, lr=1e-2, weight_decay=0.01, grad_clip=1.0)


def _adam_step(chunks, opt, seed):
    g = torch.Generator().manual_seed(seed)
    for p in chunks[0].parameters():
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
    ok, norm, _ = opt.step()
    assert ok and norm > 1.0  # clipped by megatron's joint norm


def _params(chunks):
    return {n: p.detach().clone() for n, p in chunks[0].named_parameters()}


@pytest.fixture
def trained(tiny_models, tmp_path, world1):
    """A world-1 actor after two Adam steps and its checkpoint at step 2."""
    chunks, opt = _actor_and_adam(tiny_models["qwen3_moe"])
    _adam_step(chunks, opt, 0)
    _adam_step(chunks, opt, 1)
    state = {"data_position": 17, "wandb_run_id": None, "model_path": str(tiny_models["qwen3_moe"])}
    path = checkpoint.save(tmp_path / "ckpt", 2, chunks, opt, state)
    return chunks, opt, path


def test_round_trip_continues_training_exactly(trained, tiny_models):
    chunks, opt, path = trained
    assert checkpoint.latest(path.parent) == path
    rng_after_save = torch.rand(3)
    torch.manual_seed(999)  # scramble the RNG: load must restore it

    fresh, fresh_opt = _actor_and_adam(tiny_models["qwen3_moe"])
    state = checkpoint.load(path, fresh, fresh_opt)
    assert state["step"] == 2 and state["data_position"] == 17
    assert torch.equal(torch.rand(3), rng_after_save)
    for name, p in _params(chunks).items():
        assert torch.equal(p, dict(fresh[0].named_parameters())[name]), name
    # One more step from the restored Adam moments equals the uninterrupted step (bit-exact).
    _adam_step(chunks, opt, 2)
    _adam_step(fresh, fresh_opt, 2)
    for name, p in _params(chunks).items():
        assert torch.equal(p, dict(fresh[0].named_parameters())[name]), name
    for sub in fresh_opt.chained_optimizers:
        assert {float(s["step"]) for s in sub.optimizer.state.values()} == {3.0}


def test_a_bf16_round_trip_keeps_the_fp32_master_weights(tiny_models, tmp_path, world1):
    """bf16 parameters train through fp32 master weights (megatron's Float16OptimizerWithFloat16Params): the
    checkpoint holds the masters, so a resumed run takes the next step from them, bit for bit, not from the bf16
    weights they round to."""
    chunks, opt = _actor_and_adam(tiny_models["qwen3_moe"], "bfloat16")
    _adam_step(chunks, opt, 0)
    _adam_step(chunks, opt, 1)
    masters = [m for part in opt.chained_optimizers for group in part.fp32_from_float16_groups for m in group]
    assert masters and all(m.dtype == torch.float32 for m in masters)
    assert any(not torch.equal(m, m.bfloat16().float()) for m in masters)  # more than the bf16 weights say
    path = checkpoint.save(tmp_path / "ckpt", 2, chunks, opt, {"data_position": 0, "wandb_run_id": None})

    fresh, fresh_opt = _actor_and_adam(tiny_models["qwen3_moe"], "bfloat16")
    checkpoint.load(path, fresh, fresh_opt)
    loaded = [m for part in fresh_opt.chained_optimizers for group in part.fp32_from_float16_groups for m in group]
    assert all(torch.equal(a, b) for a, b in zip(masters, loaded, strict=True))
    _adam_step(chunks, opt, 2)
    _adam_step(fresh, fresh_opt, 2)
    for name, p in _params(chunks).items():
        assert torch.equal(p, dict(fresh[0].named_parameters())[name]), name


@pytest.mark.parametrize(
    "remove, message",
    [("optimizer", "optimizer state"), ("trainer.json", "trainer state")],
)
def test_partial_checkpoint_is_refused(trained, tiny_models, remove, message):
    _, _, path = trained
    target = path / remove
    shutil.rmtree(target) if target.is_dir() else target.unlink()
    fresh, fresh_opt = _actor_and_adam(tiny_models["qwen3_moe"])
    with pytest.raises(checkpoint.CheckpointError, match=message):
        checkpoint.load(path, fresh, fresh_opt)


def test_latest_marker_naming_a_missing_folder(trained):
    _, _, path = trained
    shutil.rmtree(path)
    with pytest.raises(checkpoint.CheckpointError, match="does not exist"):
        checkpoint.latest(path.parent)


def test_exported_folder_loads_in_transformers_with_the_actors_logits(trained, tmp_path):
    chunks, _, path = trained
    out = export(path.parent, tmp_path / "hf")  # the checkpoints root: resolves `latest`
    assert json.loads((out / "moe_rl_export.json").read_text())["checkpoint"] == str(path)
    hf = load_hf(str(out))
    cfg = hf.config
    # no token near a routing tie: the actor's and HF's fp32 rounding may break one differently
    ids, mask, hf_logits, _, _ = untied_batch(hf, cfg.vocab_size, 3, 12, int(torch.randint(0, 10**6, ())))
    mc_logits, _ = _megatron_logits_and_topk(chunks, ids, mask)
    valid = mask.bool()
    diff = (hf_logits[valid] - mc_logits[..., : cfg.vocab_size][valid]).abs().max().item()
    assert diff < 1e-4, diff
    # The export is the trained actor, not the initial weights.
    init = load_hf(str(json.loads((path / "trainer.json").read_text())["model_path"]))
    init_logits, _ = hf_forward(init, ids, mask)
    assert (init_logits[valid] - hf_logits[valid]).abs().max().item() > 1e-2


def test_export_without_model_reference(trained, tmp_path):
    _, _, path = trained
    (path / "trainer.json").unlink()
    with pytest.raises(FileNotFoundError, match="--model"):
        export(path, tmp_path / "hf")
    with pytest.raises(FileNotFoundError, match="neither a checkpoint"):
        export(tmp_path / "nowhere", tmp_path / "hf")


def _clipped_step(chunks, opt, seed: int, dtype: torch.dtype) -> tuple[dict, float]:
    """One optimizer step on random gradients (in `dtype`) large enough to be clipped; returns them and the factor
    clipping by their joint norm scales them by (megatron's norm checked against it)."""
    g = torch.Generator().manual_seed(seed)
    grads = {n: (3 * torch.randn(p.shape, generator=g)).to(dtype) for n, p in chunks[0].named_parameters()}
    for n, p in chunks[0].named_parameters():
        p.grad = grads[n].clone()
    ok, norm, _ = opt.step()
    total = torch.sqrt(sum(x.double().pow(2).sum() for x in grads.values())).item()
    assert ok and norm == pytest.approx(total, rel=1e-5)
    return grads, min(1.0, 1.0 / (total + 1e-6))


def test_megatron_optimizer_equals_clip_then_adamw(tiny_models, world1):
    """The chained megatron optimizer (dense + expert) = global-norm clipping then torch AdamW."""
    chunks, opt = _actor_and_adam(tiny_models["qwen3_moe"])
    assert len(opt.chained_optimizers) == 2  # experts by name, even at EP=1 (optimizer.is_expert)
    ref = {n: p.detach().clone().requires_grad_() for n, p in chunks[0].named_parameters()}
    adam = torch.optim.AdamW(list(ref.values()), lr=1e-2, weight_decay=0.01)
    for seed in range(2):
        grads, clip = _clipped_step(chunks, opt, seed, torch.float32)
        for n, p in ref.items():
            p.grad = grads[n] * clip
        adam.step()
        for n, p in chunks[0].named_parameters():
            torch.testing.assert_close(p.detach(), ref[n].detach(), rtol=1e-5, atol=1e-6)


def test_bf16_parameters_step_through_fp32_master_weights(tiny_models, world1):
    """bf16 parameters: clipping and AdamW run on fp32 masters (torch AdamW on fp32 copies here, from the bf16
    gradients upcast), and each bf16 weight is its master rounded. Steps of 1e-4, below half a bf16 step for most
    weights, add up instead of being rounded away one by one, as they are by AdamW on the bf16 weights in place."""
    chunks, _ = _actor_and_adam(tiny_models["qwen3_moe"], "bfloat16")
    opt = build_optimizer(chunks, lr=1e-4, weight_decay=0.01, grad_clip=1.0)
    start = _params(chunks)
    ref = {n: p.detach().float().clone().requires_grad_() for n, p in chunks[0].named_parameters()}
    adam = torch.optim.AdamW(list(ref.values()), lr=1e-4, weight_decay=0.01)
    in_place = {n: p.detach().clone().requires_grad_() for n, p in chunks[0].named_parameters()}
    bf16_adam = torch.optim.AdamW(list(in_place.values()), lr=1e-4, weight_decay=0.01)
    for seed in range(6):
        grads, clip = _clipped_step(chunks, opt, seed, torch.bfloat16)
        for n, p in ref.items():
            p.grad = grads[n].float() * clip
            in_place[n].grad = (grads[n].float() * clip).bfloat16()
        adam.step()
        bf16_adam.step()
    for n, p in chunks[0].named_parameters():
        torch.testing.assert_close(p.main_param, ref[n].detach(), rtol=1e-5, atol=1e-7)
        assert torch.equal(p.detach(), p.main_param.bfloat16()), n
    moved = sum(int((p.detach() != start[n]).sum()) for n, p in chunks[0].named_parameters())
    moved_in_place = sum(int((p.detach() != start[n]).sum()) for n, p in in_place.items())
    assert moved > 1.5 * moved_in_place, (moved, moved_in_place)


@pytest.mark.parametrize(
    ("every", "saved"), [(10, [10, 20, 30]), (7, [7, 14, 21, 28, 30]), (0, [30]), (-1, []), (30, [30]), (45, [30])]
)
def test_checkpoint_every_saves_at_these_steps(every, saved):
    """trainer.checkpoint_every: every N steps and the last; 0 the last only; -1 never (a 30-step run)."""
    assert [s for s in range(1, 31) if checkpoint.save_due(s, 30, every)] == saved


def test_a_signal_stop_says_whether_it_saved_and_why_not():
    """The warning both loops print when a stop signal ends the run (the fault tests look for the first form)."""
    assert checkpoint.signal_stop_warning(None) == "stopped by a signal after saving a checkpoint"
    assert checkpoint.signal_stop_warning("trainer.checkpoint_every=-1") == (
        "stopped by a signal (no checkpoint: trainer.checkpoint_every=-1)"
    )


def test_keep_deletes_older_checkpoints(trained, tmp_path):
    chunks, opt, path = trained  # step 2 under tmp_path/ckpt
    state = {"data_position": 0, "wandb_run_id": None, "model_path": ""}
    for step in (3, 4):
        checkpoint.save(path.parent, step, chunks, opt, state, keep=2)
    assert sorted(p.name for p in path.parent.glob("step_*")) == ["step_000003", "step_000004"]
    assert checkpoint.latest(path.parent).name == "step_000004"


def test_a_save_starts_no_process_and_reads_no_earlier_save_s_results(trained, monkeypatch):
    """megatron's writer forks a process per file and reports through a process-global queue, by default a spawned
    Manager's (a process that imports torch, and whose death broke every later save). moe-rl's synchronous saves
    write the files and keep the results in this process, in a new queue each time: a save starts no process, and
    what an earlier save left in the queue (one cut short between its put and its get) is never taken for this
    save's results."""
    import os
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    def no_fork():
        raise AssertionError("a checkpoint save forked a process")

    chunks, opt, path = trained
    state = {"data_position": 0, "wandb_run_id": None, "model_path": ""}
    filesystem_async._results_queue = queue.Queue()
    filesystem_async._results_queue.put({0: []})  # a result no save of this checkpoint wrote
    monkeypatch.setattr(os, "fork", no_fork)
    saved = checkpoint.save(path.parent, 3, chunks, opt, state)
    monkeypatch.undo()
    assert filesystem_async._results_queue.empty()
    assert checkpoint.problems(saved) == []
    assert checkpoint.load(saved, chunks, opt)["step"] == 3


def test_the_optimizers_find_their_parameters_without_formatting_the_others(trained, monkeypatch):
    """megatron's mapping from an optimizer's parameters to the model's sharded tensors formats every model tensor the
    optimizer does not hold (a debug f-string): the dense and the expert optimizer printed each other's parameters on
    every save and load. Each now sees its own parameters only: the same mapping, and no parameter is formatted."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.optimizer import optimizer as megatron_optimizer

    chunks, opt, path = trained
    patched = megatron_optimizer.get_param_id_to_sharded_param_map
    assert getattr(patched, "own_parameters_only", False)  # installed by the fixture's save

    def entries(mapping) -> list:
        monkeypatch.setattr(megatron_optimizer, "get_param_id_to_sharded_param_map", mapping)
        sharded = opt.sharded_state_dict(checkpoint.model_sharded_state_dict(chunks))
        return sorted((v.key, id(v.data)) for v in nested_values(sharded) if hasattr(v, "key"))

    assert len(opt.chained_optimizers) == 2  # dense and expert: each holds parameters the other does not
    assert entries(patched.__wrapped__) == entries(patched)  # megatron's own mapping, given the whole model
    formatted = []
    monkeypatch.setattr(torch.nn.Parameter, "__repr__", lambda p: formatted.append(p.shape) or "Parameter")
    monkeypatch.setattr(megatron_optimizer, "get_param_id_to_sharded_param_map", patched.__wrapped__)
    opt.sharded_state_dict(checkpoint.model_sharded_state_dict(chunks))
    assert formatted  # megatron's: the other optimizer's parameters, in full
    formatted.clear()
    monkeypatch.setattr(megatron_optimizer, "get_param_id_to_sharded_param_map", patched)
    state = {"data_position": 0, "wandb_run_id": None, "model_path": ""}
    saved = checkpoint.save(path.parent, 3, chunks, opt, state)
    assert checkpoint.load(saved, chunks, opt)["step"] == 3 and formatted == []


def _two_checkpoints(trained):
    chunks, opt, path = trained  # step 2
    state = {"data_position": 0, "wandb_run_id": None, "model_path": ""}
    newer = checkpoint.save(path.parent, 3, chunks, opt, state)
    return path, newer


def _largest_model_file(path):
    return max((f for f in (path / "model").iterdir() if f.is_file()), key=lambda f: f.stat().st_size)


def test_manifest_lists_every_file_and_a_good_checkpoint_passes(trained):
    _, _, path = trained
    files = json.loads((path / checkpoint.MANIFEST).read_text())["files"]
    on_disk = {str(f.relative_to(path)) for f in path.rglob("*") if f.is_file() and f.name != checkpoint.MANIFEST}
    assert set(files) == on_disk and "trainer.json" in files and any(n.startswith("optimizer/") for n in files)
    assert checkpoint.problems(path) == []
    assert checkpoint.resolve_resume(path.parent, "auto") == (path, [])


def test_truncated_model_file_names_the_file_and_the_older_checkpoint(trained):
    older, newer = _two_checkpoints(trained)
    victim = _largest_model_file(newer)
    size = victim.stat().st_size
    with victim.open("r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.resolve_resume(newer.parent, "auto")
    text = str(err.value)
    assert f"{victim} has {size // 2} bytes, the manifest says {size}" in text
    assert f"trainer.resume={older}" in text
    path, notes = checkpoint.resolve_resume(newer.parent, "auto_skip_damaged")
    assert path == older and "RESUMING FROM THE OLDER CHECKPOINT" in notes[0] and victim.name in notes[0]
    with pytest.raises(checkpoint.CheckpointError, match="truncated"):
        checkpoint.resolve_resume(newer.parent, str(newer))  # an explicit path is verified too


def test_a_flipped_byte_fails_the_checksum(trained):
    _, newer = _two_checkpoints(trained)
    victim = _largest_model_file(newer)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    found = checkpoint.problems(newer)
    assert len(found) == 1 and found[0].startswith(f"{victim} does not match its checksum") and "corrupted" in found[0]


def test_missing_latest_target_points_to_the_older_checkpoint(trained):
    older, newer = _two_checkpoints(trained)
    shutil.rmtree(newer)
    with pytest.raises(checkpoint.CheckpointError, match=f"{newer} does not exist.*trainer.resume={older}"):
        checkpoint.resolve_resume(older.parent, "auto")
    assert checkpoint.resolve_resume(older.parent, "auto_skip_damaged")[0] == older
    shutil.rmtree(older)
    with pytest.raises(checkpoint.CheckpointError, match="No older checkpoint passes the check"):
        checkpoint.resolve_resume(older.parent, "auto_skip_damaged")


def test_a_save_that_fails_midway_never_becomes_latest(trained, monkeypatch, capsys, caplog):
    from megatron.core import dist_checkpointing

    chunks, opt, path = trained
    real_save = dist_checkpointing.save

    def save_model_then_fail(state, folder, *a, **k):
        if folder.endswith("optimizer"):
            raise OSError("disk full (injected)")
        return real_save(state, folder, *a, **k)

    monkeypatch.setattr(dist_checkpointing, "save", save_model_then_fail)
    state = {"data_position": 0, "wandb_run_id": None, "model_path": ""}
    with pytest.raises(checkpoint.CheckpointSaveError) as failed:
        checkpoint.save(path.parent, 3, chunks, opt, state)
    message = str(failed.value)
    assert f"checkpoint step 3: saving to {path.parent} failed (rank 0: OSError: disk full (injected))" in message
    # said by the failing rank at once, before the ranks compare notes (a collective that may go wrong)
    assert "[moe-rl] checkpoint step 3: rank 0: OSError: disk full (injected)" in capsys.readouterr().out
    # with the traceback (a warning: the console shows it), down to the frame that raised
    (logged,) = [r for r in caplog.records if r.getMessage() == "checkpoint step 3: rank 0: traceback"]
    assert logged.levelname == "WARNING" and logged.exc_info[2] is not None
    assert "save_model_then_fail" in "".join(traceback.format_exception(*logged.exc_info))
    assert "MiB free of" in message and f"{path.name}, " in message and "stays the one `latest` names" in message
    assert not (path.parent / ".step_000003.partial").exists()  # the half-written save is removed
    assert not (path.parent / "step_000003").exists()
    assert checkpoint.resolve_resume(path.parent, "auto") == (path, [])  # latest still names step 2


def test_a_file_that_cannot_be_written_fails_the_save_naming_the_error(trained, monkeypatch):
    """The files are written in this process (compat.megatron_checkpoint.writes_in_this_process): an error writing
    one reaches the save's caller as megatron's forked writers reported it, and the half-written save is removed."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device (injected)")

    chunks, opt, path = trained
    monkeypatch.setattr(filesystem_async, "_write_item", disk_full)
    state = {"data_position": 0, "wandb_run_id": None, "model_path": ""}
    with pytest.raises(checkpoint.CheckpointSaveError, match=r"No space left on device \(injected\)"):
        checkpoint.save(path.parent, 3, chunks, opt, state)
    assert not (path.parent / ".step_000003.partial").exists() and not (path.parent / "step_000003").exists()
    monkeypatch.undo()
    assert checkpoint.problems(checkpoint.save(path.parent, 3, chunks, opt, state)) == []  # the next save is whole


def test_a_rank_that_cannot_build_its_state_fails_the_save_before_any_collective_write(trained, monkeypatch):
    """What a rank saves is built (model, then optimizer) before megatron's collective writes start, and the ranks
    compare notes in between: a rank that failed while building the optimizer's state after the model's write had
    left the others inside the optimizer write's collectives (seen: "the ranks' collectives fell out of step")."""
    from megatron.core import dist_checkpointing

    chunks, opt, path = trained
    writes = []
    real_save = dist_checkpointing.save
    monkeypatch.setattr(dist_checkpointing, "save", lambda state, folder, *a, **k: writes.append(folder))

    def fails(*a, **k):
        raise RuntimeError("injected")

    monkeypatch.setattr(checkpoint, "_optimizer_sharded_state_dict", fails)
    state = {"data_position": 0, "wandb_run_id": None, "model_path": ""}
    with pytest.raises(checkpoint.CheckpointSaveError, match=r"rank 0: RuntimeError: injected"):
        checkpoint.save(path.parent, 3, chunks, opt, state)
    assert writes == [] and not (path.parent / ".step_000003.partial").exists()
    monkeypatch.undo()
    assert real_save is dist_checkpointing.save
    saved = checkpoint.save(path.parent, 3, chunks, opt, state)  # the next save is whole
    assert checkpoint.problems(saved) == [] and checkpoint.load(saved, chunks, opt)["step"] == 3


def test_a_first_save_cut_short_starts_fresh_and_says_so(tmp_path):
    root = tmp_path / "checkpoints"
    assert checkpoint.resolve_resume(root, "auto") == (None, [])  # nothing there: fresh, silently
    (root / ".step_000002.partial" / "model").mkdir(parents=True)  # killed during its first save
    path, notes = checkpoint.resolve_resume(root, "auto")
    assert path is None and len(notes) == 1, notes
    assert ".step_000002.partial" in notes[0] and "no complete checkpoint" in notes[0] and "starting fresh" in notes[0]


def test_resaving_the_latest_step_keeps_it_until_the_new_one_is_complete(trained, monkeypatch):
    """After resuming an older checkpoint, a step is saved again on top of an existing folder
    (maybe the one `latest` names): a failed re-save must leave that folder whole."""
    from megatron.core import dist_checkpointing

    chunks, opt, path = trained  # step 2, named by latest
    manifest = (path / checkpoint.MANIFEST).read_text()
    monkeypatch.setattr(dist_checkpointing, "save", lambda *a, **k: (_ for _ in ()).throw(OSError("injected")))
    state = {"data_position": 0, "wandb_run_id": None, "model_path": ""}
    with pytest.raises(checkpoint.CheckpointSaveError, match="OSError: injected"):
        checkpoint.save(path.parent, 2, chunks, opt, state)
    assert (path / checkpoint.MANIFEST).read_text() == manifest and checkpoint.problems(path) == []
    monkeypatch.undo()
    assert checkpoint.save(path.parent, 2, chunks, opt, state) == path  # a successful re-save replaces it
    assert checkpoint.problems(path) == [] and not list(path.parent.glob(".step_*"))
