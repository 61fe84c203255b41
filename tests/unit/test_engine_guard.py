"""RolloutEngine.guard turns vLLM's ways of saying "the engine is going away" into RolloutEngineError, the one
error the trainer turns into a checkpoint under a stop signal."""

from __future__ import annotations

import inspect

import pytest

from moe_rl.rollout.engine import SHUTTING_DOWN, RolloutEngine, RolloutEngineError


def test_vllm_rejects_calls_during_its_shutdown_with_the_message_we_match():
    from vllm.v1.engine.core import EngineCoreProc

    assert f'"{SHUTTING_DOWN}"' in inspect.getsource(EngineCoreProc._reject_utility_in_shutdown)


def test_a_call_rejected_during_shutdown_is_an_engine_error_and_the_engine_counts_as_gone():
    eng = RolloutEngine.__new__(RolloutEngine)  # no engine: guard needs only its liveness and processes
    eng._alive, eng._procs = True, []

    def rejected():
        raise Exception(SHUTTING_DOWN)  # what vLLM's client raises for the rejected call

    with pytest.raises(RolloutEngineError, match="route capture: the vLLM engine is shutting down"):
        eng.guard("route capture", rejected)
    with pytest.raises(RolloutEngineError, match="was shut down"):
        eng.guard("route capture", lambda: None)


def test_other_errors_pass_through_unchanged():
    eng = RolloutEngine.__new__(RolloutEngine)
    eng._alive, eng._procs = True, []

    def broken():
        raise ValueError("a bad request")

    with pytest.raises(ValueError, match="a bad request"):
        eng.guard("generate", broken)
    assert eng._alive
