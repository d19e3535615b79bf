"""The ``*_step_end`` hooks that Lightning 2.0 removed: where the loss and batch-wise reductions belong."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from torch import nn

_CALLER_RUNS_STEP_END: ContextVar[bool] = ContextVar("lightning_mgpu_caller_runs_step_end", default=False)

STEP_END_HOOKS = {
    "training_step": "training_step_end",
    "validation_step": "validation_step_end",
    "test_step": "test_step_end",
    "predict_step": "predict_step_end",
}


def has_step_end(module: nn.Module, step: str) -> bool:
    """Whether ``module`` defines the ``*_step_end`` hook of ``step``."""
    return callable(getattr(module, STEP_END_HOOKS[step], None))


def call_step_end(module: nn.Module, step: str, output: Any) -> Any:
    """Give ``output`` to the module's ``*_step_end`` hook for ``step`` and return what it returns.

    Modules without the hook get ``output`` back unchanged.
    """
    if not has_step_end(module, step):
        return output
    return getattr(module, STEP_END_HOOKS[step])(output)


@contextmanager
def caller_runs_step_end() -> Iterator[None]:
    """Within this context, whoever calls a step also calls its ``*_step_end`` hook (a strategy, the doctor).

    ``MGPUMixin``'s steps call their hook themselves outside it, which is what runs the hooks under Lightning's own
    strategies. The context reaches ``mgpu_dp``'s replica threads, which run in a copy of their caller's context.
    """
    token = _CALLER_RUNS_STEP_END.set(True)
    try:
        yield
    finally:
        _CALLER_RUNS_STEP_END.reset(token)


def step_calls_step_end() -> bool:
    """Whether a step that ``MGPUMixin`` wrapped calls its own ``*_step_end`` hook here (no caller does)."""
    return not _CALLER_RUNS_STEP_END.get()


def find_loss(output: Any) -> tuple[str | None, Any]:
    """Where Lightning finds the loss in a training step's output, and the loss: ``(None, None)`` if it has none."""
    if isinstance(output, torch.Tensor):
        return "output", output
    if isinstance(output, Mapping) and "loss" in output:
        return "output['loss']", output["loss"]
    return None, None
