"""Settings torch and Python keep once per process: a step inside the replicas must leave them as it found them.

Replicas are threads of one process, so a replica that sets the default dtype, deterministic algorithms, anomaly
detection, the float32 matmul precision or cuDNN's flags sets it for the others too, in the middle of their step,
in whatever order the threads run: a tensor another replica creates a moment earlier or later differs. A setting
the replicas left changed is put back and the step refused with ``ReplicaStateError``: the change belongs before
``fit`` or in a hook that runs once per step outside the replicas. ``warnings.catch_warnings`` blocks that the
replicas' threads interleaved can leave the process with another block's filters (each block puts back what it
found on entering); the filters and ``warnings.showwarning`` a call found are put back after it, as one device
leaves them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from lightning_mgpu.errors import ReplicaStateError


def _read_all() -> tuple[Any, ...]:
    """Every setting's value, in ``_SETTINGS``'s order, in one call: read twice a step, so kept to C calls."""
    cudnn = torch.backends.cudnn
    return (
        torch.get_default_dtype(),
        (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()),
        (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
        torch.get_float32_matmul_precision(),
        (cudnn.benchmark, cudnn.deterministic),
    )


def _set_deterministic(value: tuple[bool, bool]) -> None:
    torch.use_deterministic_algorithms(value[0], warn_only=value[1])


def _set_anomaly(value: tuple[bool, bool]) -> None:
    torch.autograd.set_detect_anomaly(value[0], check_nan=value[1])


def _set_cudnn(value: tuple[bool, bool]) -> None:
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = value


_SETTINGS: tuple[tuple[str, str, Callable[[Any], None]], ...] = (
    ("the default dtype", "torch.set_default_dtype", torch.set_default_dtype),
    ("deterministic algorithms (enabled, warn_only)", "torch.use_deterministic_algorithms", _set_deterministic),
    ("anomaly detection (enabled, check_nan)", "torch.autograd.set_detect_anomaly", _set_anomaly),
    ("the float32 matmul precision", "torch.set_float32_matmul_precision", torch.set_float32_matmul_precision),
    ("cuDNN's (benchmark, deterministic)", "torch.backends.cudnn", _set_cudnn),
)
"""Each setting, in ``_read_all``'s order: what it is, where a step sets it, how to put it back."""


class ProcessSettings:
    """The process-wide settings as a call found them, read in the calling thread before the replicas run."""

    __slots__ = ("_filters", "_showwarning", "_values")

    def __init__(self) -> None:
        self._values = _read_all()
        self._filters = warnings.filters
        self._showwarning = warnings.showwarning

    def settle(self, step: str) -> None:
        """After the call: put back what the replicas changed; refuse the step if it changed a torch setting."""
        if warnings.filters is not self._filters:
            warnings.filters = self._filters
        if warnings.showwarning is not self._showwarning:
            warnings.showwarning = self._showwarning
        now = _read_all()
        if now == self._values:
            return
        changed = []
        for (what, where, write), before, after in zip(_SETTINGS, self._values, now, strict=True):
            if after != before:
                write(before)
                changed.append((what, where, before, after))
        what, where, before, after = changed[0]
        more = f" (and {', '.join(other[0] for other in changed[1:])})" if len(changed) > 1 else ""
        raise ReplicaStateError(
            f"{step} changed {what} inside the replicas, from {before} to {after}{more}. It is one setting for"
            " the whole process, and the replicas are threads of it, so each replica's change reached the others"
            " in the middle of their step, in whatever order the threads ran. Change it before fit, or in"
            " on_train_batch_start (on_validation_batch_start, ...), which runs once per step outside the"
            f" replicas; {where} inside a step works on one device only. It is back at {before}.",
            where,
            step,
        )
