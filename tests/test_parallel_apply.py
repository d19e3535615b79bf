"""Replica threads: ordering, thread-local torch state, failures, threads that die."""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import pytest
import torch

from lightning_mgpu.engine import ParallelApply, parallel_apply
from lightning_mgpu.engine.parallel_apply import ReplicaThreadDied

CPU3 = [torch.device("cpu")] * 3


def test_results_come_back_in_order_from_distinct_threads() -> None:
    apply = ParallelApply(3)
    try:
        names = apply([lambda: threading.current_thread().name] * 3, CPU3)
        again = apply([lambda: threading.current_thread().name] * 3, CPU3)
    finally:
        apply.close()
    assert names == ["mgpu-replica-0", "mgpu-replica-1", "mgpu-replica-2"]
    assert again == names, "replica i always runs on thread i"


def test_a_single_call_runs_in_the_calling_thread_like_torchs_parallel_apply() -> None:
    apply = ParallelApply(2)
    try:
        assert apply([lambda: threading.current_thread().name], CPU3[:1]) == [threading.current_thread().name]
        with pytest.raises(KeyError) as caught:
            apply([lambda: {}["missing"]], CPU3[:1])
    finally:
        apply.close()
    assert caught.value.__notes__ == ["lightning_mgpu: raised in replica 0 of 1 on cpu."]


@pytest.mark.parametrize("replicas", [1, 2])
def test_tensors_made_without_a_device_land_on_the_replicas_device(replicas: int) -> None:
    apply = ParallelApply(2)
    try:
        with torch.device("meta"):
            devices = apply([lambda: torch.empty(1).device] * replicas, CPU3[:replicas])
    finally:
        apply.close()
    assert devices == [torch.device("cpu")] * replicas


def test_grad_and_inference_mode_follow_the_caller() -> None:
    apply = ParallelApply(2)
    try:
        with torch.no_grad():
            no_grad = apply([torch.is_grad_enabled] * 2, CPU3[:2])
        with torch.inference_mode():
            inference = apply([torch.is_inference_mode_enabled] * 2, CPU3[:2])
        grad = apply([torch.is_grad_enabled] * 2, CPU3[:2])
    finally:
        apply.close()
    assert (no_grad, inference, grad) == ([False, False], [True, True], [True, True])


_SETTING: contextvars.ContextVar[str] = contextvars.ContextVar("setting", default="unset")


@pytest.mark.parametrize("replicas", [1, 3])
def test_context_variables_read_in_replicas_as_in_the_caller(replicas: int) -> None:
    """As on one device, a replica reads the caller's context variables; what a replica thread sets stays in it."""

    def read_then_set() -> str:
        seen = _SETTING.get()
        _SETTING.set(f"set in {threading.current_thread().name}")
        return seen

    apply = ParallelApply(3)
    token = _SETTING.set("the caller's")
    try:
        seen = apply([read_then_set] * replicas, CPU3[:replicas])
        again = apply([_SETTING.get] * 3, CPU3)
    finally:
        _SETTING.reset(token)
        apply.close()
    assert seen == ["the caller's"] * replicas
    if replicas > 1:  # threads each run in a copy of the caller's context
        assert again == ["the caller's"] * 3


def test_the_callers_autocast_reaches_every_replica() -> None:
    apply = ParallelApply(2)
    weight = torch.randn(3, 3)

    def matmul() -> torch.dtype:
        return (torch.ones(2, 3) @ weight).dtype

    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            inside = apply([matmul] * 2, CPU3[:2])
        outside = apply([matmul] * 2, CPU3[:2])
    finally:
        apply.close()
    assert inside == [torch.bfloat16, torch.bfloat16]
    assert outside == [torch.float32, torch.float32]


def test_context_is_entered_per_replica() -> None:
    apply = ParallelApply(2)
    try:
        dtypes = apply(
            [lambda: (torch.ones(2, 2) @ torch.ones(2, 2)).dtype] * 2,
            CPU3[:2],
            context=lambda: torch.autocast("cpu", dtype=torch.bfloat16),
        )
    finally:
        apply.close()
    assert dtypes == [torch.bfloat16, torch.bfloat16]


def test_the_lowest_failing_replica_is_reraised_with_a_note() -> None:
    def fail(message: str):
        def call() -> None:
            raise KeyError(message)

        return call

    apply = ParallelApply(3)
    try:
        with pytest.raises(KeyError, match="second") as caught:
            apply([lambda: 1, fail("second"), fail("third")], CPU3)
        assert caught.value.__notes__ == [
            "lightning_mgpu: raised in replica 1 of 3 on cpu (1 other replica(s) failed too)."
        ]
        assert apply([lambda: 5] * 3, CPU3) == [5, 5, 5], "the threads survive a failure"
    finally:
        apply.close()


def test_close_stops_the_threads() -> None:
    apply = ParallelApply(2)
    apply([lambda: None] * 2, CPU3[:2])
    apply.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("mgpu-replica")]


# --- threads that die ---------------------------------------------------------------------------------------------


def _ended(apply: Callable[[], Any]) -> tuple[BaseException, float]:
    started = time.perf_counter()
    with pytest.raises(ReplicaThreadDied) as caught:
        apply()
    return caught.value, time.perf_counter() - started


@pytest.mark.timeout(30)
def test_a_replica_thread_killed_by_a_base_exception_fails_the_call_and_is_replaced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run = parallel_apply._Job.run

    def run_or_die(job: parallel_apply._Job) -> None:
        if job.index == 1:
            raise SystemExit("killed outside the replica's call")  # escapes the thread's loop, not the call
        run(job)

    apply = ParallelApply(3)
    try:
        apply([lambda: None] * 3, CPU3)  # the threads are up
        monkeypatch.setattr(parallel_apply._Job, "run", run_or_die)
        error, seconds = _ended(lambda: apply([lambda: 1] * 3, CPU3))
        assert "thread of replica 1 (mgpu-replica-1) died of SystemExit" in str(error)
        assert isinstance(error.__cause__, SystemExit)
        assert error.__notes__ == ["lightning_mgpu: raised in replica 1 of 3 on cpu."]
        assert seconds < 5
        monkeypatch.undo()
        assert apply([threading.current_thread] * 3, CPU3)[1].name == "mgpu-replica-1", "a new thread took over"
        assert apply([lambda: 7] * 3, CPU3) == [7, 7, 7]
    finally:
        apply.close()


@pytest.mark.timeout(30)
def test_a_thread_that_dies_without_reporting_it_is_noticed_within_the_liveness_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def interrupt(job: parallel_apply._Job) -> None:
        raise KeyboardInterrupt

    def die_silently(worker: parallel_apply._Worker, error: BaseException, job: object) -> None:
        raise error  # the thread's own handler fails too: only the caller's liveness check can tell

    monkeypatch.setattr(parallel_apply, "_LIVENESS_CHECK_S", 0.05)
    monkeypatch.setattr(parallel_apply._Worker, "_die", die_silently)
    monkeypatch.setattr(parallel_apply._Job, "run", interrupt)
    monkeypatch.setattr(threading, "excepthook", lambda args: None)
    apply = ParallelApply(2)
    try:
        error, seconds = _ended(lambda: apply([lambda: None] * 2, CPU3[:2]))
    finally:
        monkeypatch.undo()
        apply.close()
    assert "thread of replica 0 (mgpu-replica-0) died" in str(error)
    assert seconds < 5


@pytest.mark.timeout(30)
def test_a_profile_hook_that_raises_in_a_replica_thread_does_not_hang_the_caller(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Python 3.12's cProfile raised ``Another profiling tool is already active`` from a per-thread hook."""

    def hook(frame: FrameType, event: str, arg: Any) -> None:
        if threading.current_thread().name == "mgpu-replica-1":
            raise ValueError("Another profiling tool is already active")

    monkeypatch.setattr(parallel_apply, "_LIVENESS_CHECK_S", 0.05)
    monkeypatch.setattr(threading, "excepthook", lambda args: None)
    apply = ParallelApply(2)
    threading.setprofile(hook)
    try:
        error, seconds = _ended(lambda: apply([lambda: None] * 2, CPU3[:2]))
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
    try:
        assert "thread of replica 1 (mgpu-replica-1) died" in str(error)
        assert seconds < 5
        assert apply([lambda: 3] * 2, CPU3[:2]) == [3, 3]
    finally:
        apply.close()
