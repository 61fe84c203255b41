"""Weight sync: the actor's updated weights into the rollout engines, once per step, streamed.

`WeightSync` walks one plan every rank shares (`actor.weights.export_plan`: every distinct HF
tensor and the rank that contributes it), bucket by bucket (`rollout.weight_sync_bucket_mb`):
the owner's TP/ETP group gathers a parameter's shards, the owner converts it to HF tensors and
puts each into every engine leader's bucket buffer (under shm, straight into the mapped buffer
of a leader on its host; otherwise gloo point-to-point), and the engine loads the bucket; then
the next one. No rank ever holds the whole model: an owner holds one parameter, a leader one
bucket.

Transports (last hop, leader -> its engine's worker process, `rollout.weight_transport`):
  shm       the bucket buffer is a file in /dev/shm that the worker maps (no serialisation) — CPU default;
            one engine call per sync: the buckets are announced on a socket per worker (`_ShmStream`), and
            the engine loads a bucket while the trainer writes the next;
  rpc       the bucket as a safetensors blob through vLLM's collective_rpc;
  cuda_ipc  (GPU, colocated) the bucket buffer is on the leader's device; the worker rebuilds it from its
            CUDA IPC handle as vLLM's IPCWeightTransferEngine does.
Engines on GPUs of their own (an NCCL broadcast to their workers) are not built.
The engine side (`WeightReceiver`) uses vLLM's layerwise reload, then re-runs each layer's
post-load processing.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import socket
import tempfile
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Client
from typing import NoReturn

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import reduce_tensor

from moe_rl.actor.weights import ExportProducer, export_plan
from moe_rl.common import progress
from moe_rl.common.distributed import all_gather_objects, buckets, tensor_nbytes
from moe_rl.rollout.config import DEVICE_TRANSPORTS, WeightTransport
from moe_rl.rollout.engine import RolloutEngineError
from moe_rl.rollout.weight_receiver import bucket_tensors, map_shared

TRANSPORTS = tuple(t.value for t in WeightTransport)


class WeightSync:
    """actor -> engines, after every update and after a resume (the trainer has none without engines:
    from_dump). Collective: every rank calls it; `engine` is the RolloutEngine on engine leaders, None
    elsewhere; `leaders`: every engine leader's global rank."""

    def __init__(self, actor, engine, leaders: list[int], bucket_mb: int, transport: str = "shm"):
        _check_transport(transport)
        if engine is not None:  # before any training step (begin checks again on every sync)
            engine.rpc("moe_rl_check_weight_update")
        # a LoRA actor (actor.lora) changes only the linears it adapts: only those are sent, merged
        self.changed_only = bool(getattr(actor, "lora", None))
        if engine is not None and self.changed_only:
            engine.rpc("moe_rl_expect_partial_updates")
        self.actor, self.engine, self.leaders = actor, engine, sorted(leaders)
        self.bucket_bytes, self.transport = bucket_mb * 2**20, transport
        self._plan = None

    def __call__(self) -> dict[str, float]:
        t0 = time.perf_counter()
        me = dist.get_rank() if dist.is_initialized() else 0
        if self._plan is None:  # shapes never change: planned once (two small all_gather_objects)
            plan = export_plan(self.actor.chunks, self.actor.conv, changed_only=self.changed_only)
            self._plan = list(buckets(plan, self.bucket_bytes, lambda e: e.nbytes))
            hosts = all_gather_objects(socket.gethostname())
            # shm: an owner on a leader's host writes straight into the leader's bucket buffer
            shm = self.transport == "shm"
            self._same_host = lambda a, b: a == b or (shm and hosts[a] == hosts[b])
        produce = ExportProducer(self.actor.chunks, self.actor.conv)
        lead = self.engine is not None
        size = max(sum(e.nbytes for e in b) for b in self._plan)
        failed: Exception | None = None  # a leader whose engine failed keeps streaming, then raises

        def engine_call(fn, *args):
            nonlocal failed
            if lead and failed is None:
                try:
                    return fn(*args)
                except Exception as e:  # the stream's collectives must still complete on every rank
                    failed = e

        engine_call(self.engine and self.engine.wake_up, "weights")  # rollout.sleep_while_training (GPU)
        stats = {"bytes": 0, "tensors": 0, "buckets": 0}
        device = _buffer_device(self.transport)
        with _BucketBuffer(size if lead else 0, device) as buf, contextlib.ExitStack() as streaming:
            paths = dict(enumerate(all_gather_objects(buf.path if lead else None)))
            peers = {r: map_shared(paths[r], size) for r in self.leaders if r != me and self._same_host(r, me)}
            update = engine_call(lambda: streaming.enter_context(_EngineUpdate(self.engine, self.transport)))
            for bucket in self._plan:
                made: dict[str, torch.Tensor] = {}
                for entry in bucket:
                    made |= produce(entry) or {}
                manifest, offset = self._deliver_bucket(bucket, made, buf, peers, me, device)
                del made
                _barrier()  # every write of this bucket has landed
                engine_call(lambda: update.load(buf, manifest))  # noqa: B023 (called here, at once)
                _barrier()  # the engines hold this bucket: its buffers may be overwritten
                stats["bytes"] += offset
                stats["tensors"] += len(manifest)
                stats["buckets"] += 1
                progress.mark()
            stats |= engine_call(lambda: update.finish(stats["tensors"])) or {}
        engine_call(self.engine and self.engine.reset_prefix_cache)  # (multi-turn) no KV of the old weights
        if failed is not None:
            raise failed
        return {**stats, "seconds": time.perf_counter() - t0}

    def _deliver_bucket(
        self, bucket: list, made: dict[str, torch.Tensor], buf: _BucketBuffer, peers: dict, me: int, device: str
    ) -> tuple[list, int]:
        """Every tensor of `bucket` into every leader's bucket buffer (`made`: the HF tensors this rank owns; `peers`:
        the mapped buffers of same-host leaders) -> (the bucket's manifest, its bytes)."""
        manifest, offset = [], 0
        for entry in bucket:
            for name, shape, dtype in entry.tensors:
                n = tensor_nbytes(shape, dtype)
                for leader in self.leaders:
                    if me == leader:
                        dst = buf.view(offset, n)
                    elif me == entry.owner and leader in peers:
                        dst = peers[leader][offset : offset + n]
                    else:
                        dst = None
                    local = self._same_host(entry.owner, leader)
                    _deliver(made.get(name), entry.owner, leader, me, dst, local, device)
                manifest.append((name, dtype, shape, offset))
                offset += n
        return manifest, offset


def sync_metrics(stats: dict[str, float]) -> dict[str, float]:
    """The step's `weight_sync/*` metrics from a `WeightSync()` result (the same keys on every rank, so that they
    reduce as maxima): bytes of HF tensors each engine received, the sync's wall seconds and the buckets they went
    in. `weight_sync/gb_per_s` is formed from the reduced values (the slowest rank's seconds) by the trainer."""
    return {
        "weight_sync/bytes": float(stats["bytes"]),
        "weight_sync/seconds": stats["seconds"],
        "weight_sync/buckets": float(stats["buckets"]),
    }


class _ShmStream:
    """The leader's end of the shm transport's bucket stream: the whole update is one engine call
    (`moe_rl_load_shm_stream`: begin, every bucket, finish) instead of one per bucket, as verl streams its IPC
    buckets over ZMQ. Each engine worker listens on a Unix socket in a private directory; the leader sends each
    bucket's manifest (its tensors' offsets in the shared buffer), the worker copies the bucket out,
    acknowledges, and loads it while the trainer writes the next one. A call per bucket cost a round trip
    through vLLM's engine core and kept its message queues spinning (3x slower, docs/performance.md). A worker
    that dies closes its socket: the leader's wait ends with the engine call's error."""

    def __init__(self, engine):
        self.dir = tempfile.mkdtemp(prefix="moe-rl-sync-")  # 0700: only this user reaches the sockets
        address, key = os.path.join(self.dir, "worker"), os.urandom(32)
        self.pool = ThreadPoolExecutor(max_workers=1)
        self.call = self.pool.submit(engine.rpc, "moe_rl_load_shm_stream", address, key)
        self.conns = []
        try:
            for rank in range(engine.cfg.tensor_parallel_size):
                self.conns.append(self._connect(f"{address}.{rank}", key))
        except BaseException:
            self.__exit__()
            raise

    def _connect(self, address: str, key: bytes):
        while True:  # the worker's listener appears once the engine call reached it
            try:
                return Client(address, family="AF_UNIX", authkey=key)
            except (FileNotFoundError, ConnectionRefusedError):
                if self.call.done():  # the engine call failed before listening (a refused update)
                    self._engine_failed()
                time.sleep(0.001)

    def send(self, buf: _BucketBuffer, manifest: list) -> None:
        """Hand every worker one bucket; returns when all of them copied it out of the buffer."""
        for conn in self.conns:
            self._send(conn, (buf.path, buf.nbytes, manifest))
        for conn in self.conns:
            while not conn.poll(0.5):
                if self.call.done():  # the engine call ended early (a worker failed or died)
                    self._engine_failed()
            try:
                taken = conn.recv()
            except (EOFError, OSError):  # the worker hung up (a reset connection raises OSError)
                self._engine_failed()
            if taken != len(manifest):
                raise RolloutEngineError(f"weight sync: an engine worker took {taken} of {len(manifest)} tensors")

    def _send(self, conn, message) -> None:
        """A message to a worker; one that failed and closed its socket (the update's error is the engine call's)
        makes the send raise that error instead of a broken pipe."""
        try:
            conn.send(message)
        except OSError:  # BrokenPipeError, ConnectionResetError: the worker hung up
            self._engine_failed()

    def _engine_failed(self) -> NoReturn:
        """Raise the engine call's error (it ended, or a worker hung up), with what was going on."""
        try:
            self.call.result()
        except RolloutEngineError:
            raise
        except Exception as e:
            raise RolloutEngineError(f"weight sync: the engine failed during the update: {e}") from e
        raise RolloutEngineError("weight sync: the engine stopped reading buckets before the last one")

    def finish(self, tensors: int) -> dict[str, float]:
        """End the stream, after checking the workers loaded `tensors`; the seconds they spent in vLLM's load
        (`engine_load_seconds`, repack included) and in the CPU experts' repack alone (max over workers)."""
        for conn in self.conns:
            self._send(conn, None)
        if self.call.exception() is not None:
            self._engine_failed()
        answers = self.call.result()
        if any(a["tensors"] != tensors for a in answers):
            raise RolloutEngineError(
                f"weight sync: engine workers loaded {[a['tensors'] for a in answers]} of {tensors} tensors"
            )
        return {
            "engine_load_seconds": max(a["load_seconds"] for a in answers),
            "engine_repack_seconds": max(a["repack_seconds"] for a in answers),
        }

    def __enter__(self) -> _ShmStream:
        return self

    def __exit__(self, *exc) -> None:
        for conn in self.conns:  # a worker still reading sees the end of its stream (EOFError)
            conn.close()
        self.pool.shutdown(wait=False)
        shutil.rmtree(self.dir, ignore_errors=True)


class _EngineUpdate:
    """One engine's side of a weight update over its transport: shm streams every bucket through one engine call
    (`_ShmStream`); rpc and cuda_ipc begin, load each bucket with a call of its own, and finish."""

    def __init__(self, engine, transport: str):
        self.engine, self.transport, self.stream = engine, transport, None

    def __enter__(self) -> _EngineUpdate:
        if self.transport == "shm":
            self.stream = _ShmStream(self.engine)
        else:
            self.engine.rpc("moe_rl_begin_weight_update")
        return self

    def load(self, buf: _BucketBuffer, manifest: list) -> None:
        """The engine takes one bucket; returns when the buffer may be overwritten."""
        if self.stream is not None:
            self.stream.send(buf, manifest)
        else:
            _load_bucket(self.engine, self.transport, buf, manifest)

    def finish(self, tensors: int) -> dict[str, float]:
        """End the update (the workers loaded `tensors`); shm: the engine's load and repack seconds."""
        if self.stream is not None:
            return self.stream.finish(tensors)
        self.engine.rpc("moe_rl_finish_weight_update")
        return {}

    def __exit__(self, *exc) -> None:
        if self.stream is not None:
            self.stream.__exit__(*exc)


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _check_transport(transport: str) -> str:
    if transport not in TRANSPORTS:
        raise ValueError(f"rollout.weight_transport={transport!r}: choose one of {TRANSPORTS}")
    if transport in DEVICE_TRANSPORTS and not torch.cuda.is_available():
        raise ValueError(f"rollout.weight_transport={transport} needs CUDA; use shm on CPU")
    return transport


def _buffer_device(transport: str) -> str:
    return "cuda" if transport in DEVICE_TRANSPORTS else "cpu"


def _load_bucket(engine, transport: str, buf: _BucketBuffer, manifest: list) -> None:
    """The engine loads one packed bucket (the last hop)."""
    if transport == "cuda_ipc":
        torch.cuda.current_stream(buf.data.device).synchronize()  # the bucket's writes have landed
        _, args = reduce_tensor(buf.data)
        uuid = str(torch.cuda.get_device_properties(buf.data.device).uuid)
        # pickled: vLLM's rpc encoder (msgpack) refuses the handle's storage class and dtype, as in its own
        # IPCWeightTransferEngine (weight_transfer/ipc_engine.py)
        loaded = engine.rpc("moe_rl_load_cuda_ipc", pickle.dumps({uuid: args}), manifest)
    else:
        # heavy: safetensors, imported on first use
        from safetensors.torch import save

        loaded = engine.rpc("moe_rl_load_weights", save(dict(buf.tensors(manifest))))
    if any(n != len(manifest) for n in loaded):
        raise RolloutEngineError(f"weight sync: engine loaded {loaded} of {len(manifest)} tensors")


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _raw(t: torch.Tensor, device: str = "cpu") -> torch.Tensor:
    """A tensor's bytes (what travels), on the bucket buffer's device."""
    return t.detach().to(device).contiguous().view(-1).view(torch.uint8)


def _deliver(
    t: torch.Tensor | None, owner: int, leader: int, me: int, dst: torch.Tensor | None, local: bool, device: str
) -> None:
    """One HF tensor from its owner into a leader's bucket buffer (`dst`: its bytes there, as this rank
    sees them). `local`: the owner writes into the leader's mapped buffer itself; else the process group
    (gloo, or NCCL for a device buffer) carries it."""
    if me == owner:
        raw = _raw(t, device)
        if me == leader or local:
            dst.copy_(raw)
        else:
            dist.send(raw, dst=leader)
    elif me == leader and not local:
        dist.recv(dst, src=owner)


class _BucketBuffer:
    """A leader's bucket buffer: a file in /dev/shm (a temp dir where there is none) mapped here and,
    by the shm transport, in the engine's worker process; removed on exit. `device="cuda"` (cuda_ipc, nccl):
    device memory instead, shared by IPC handle or broadcast."""

    def __init__(self, nbytes: int, device: str = "cpu"):
        self.nbytes, self.device, self.path, self.data = nbytes, device, "", None

    def __enter__(self) -> _BucketBuffer:
        if self.nbytes and self.device != "cpu":
            self.data = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        elif self.nbytes:
            root = "/dev/shm" if os.path.isdir("/dev/shm") else None
            fd, self.path = tempfile.mkstemp(prefix="moe-rl-weights-", dir=root)
            os.ftruncate(fd, self.nbytes)
            os.close(fd)
            self.data = map_shared(self.path, self.nbytes)
        return self

    def __exit__(self, *exc) -> None:
        self.data = None
        if self.path:
            os.unlink(self.path)

    def view(self, offset: int, n: int) -> torch.Tensor:
        return self.data[offset : offset + n]

    def tensors(self, manifest: list) -> Iterator[tuple[str, torch.Tensor]]:
        yield from bucket_tensors(self.data, manifest)


def push_weights(engine, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
    """Load whole HF-named tensors (a checkpoint's, one rank's export) into one RolloutEngine in buckets of
    <= rollout.weight_sync_bucket_mb over rollout.weight_transport, as WeightSync's leaders do; returns bytes,
    tensors, buckets, seconds."""
    transport = _check_transport(engine.cfg.weight_transport)
    device = _buffer_device(transport)
    t0 = time.perf_counter()
    stats = {"bytes": 0, "tensors": 0, "buckets": 0}
    with _EngineUpdate(engine, transport) as update:
        for bucket in buckets(named_tensors, engine.cfg.weight_sync_bucket_mb * 2**20, lambda kv: _tensor_bytes(kv[1])):
            manifest, offset = [], 0
            for name, t in bucket:
                manifest.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset))
                offset += _tensor_bytes(t)
            with _BucketBuffer(offset, device) as buf:
                for (_, t), (_, _, _, off) in zip(bucket, manifest, strict=True):
                    buf.view(off, _tensor_bytes(t)).copy_(_raw(t, device))
                update.load(buf, manifest)
            stats["bytes"] += offset
            stats["tensors"] += len(bucket)
            stats["buckets"] += 1
        stats |= update.finish(stats["tensors"])
    return {**stats, "seconds": time.perf_counter() - t0}
