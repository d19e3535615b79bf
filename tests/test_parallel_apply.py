"""Replica threads: ordering, thread-local torch state, failures."""

from __future__ import annotations

import threading

import pytest
import torch

from lightning_mgpu.engine import ParallelApply

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
            context=lambda index, device: torch.autocast("cpu", dtype=torch.bfloat16),
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
