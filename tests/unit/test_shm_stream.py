"""The shm weight-sync stream's leader end, against a worker that failed: what the sync raises is the engine call's
error, never the broken pipe of the socket that worker closed (seen in CI: the failing tensor sat in the last bucket,
and the end-of-stream message found the socket closed)."""

from __future__ import annotations

from concurrent.futures import Future
from multiprocessing import Pipe
from types import SimpleNamespace

import pytest

from moe_rl.rollout.engine import RolloutEngineError
from moe_rl.weight_sync import _ShmStream


def _stream_whose_worker_failed() -> _ShmStream:
    """A leader end whose only worker raised during the update and hung up (the engine call ended with its error)."""
    stream = object.__new__(_ShmStream)  # no engine: the connection and the call's outcome are all `finish` reads
    leader, worker = Pipe()
    worker.close()
    stream.conns = [leader]
    stream.call = Future()
    stream.call.set_exception(ValueError("There is no module or parameter named 'model.layers.0.no_such_tensor'"))
    return stream


@pytest.mark.parametrize("step", ["bucket", "finish"])
def test_a_worker_that_hung_up_fails_the_sync_with_the_engines_error(step):
    stream = _stream_whose_worker_failed()
    with pytest.raises(RolloutEngineError, match="weight sync: the engine failed during the update: .*no_such_tensor"):
        if step == "finish":
            stream.finish(tensors=3)
        else:
            stream.send(SimpleNamespace(path="/dev/shm/moe-rl-bucket", nbytes=16), manifest=[])
