"""The ``*_step_end`` hooks that Lightning 2.0 removed: where the loss and batch-wise reductions belong."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

CALLER_RUNS_STEP_END = "_mgpu_caller_runs_step_end"

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


def claim_step_end(module: nn.Module) -> None:
    """From now on the caller (a strategy) runs ``module``'s ``*_step_end`` hooks, not ``MGPUMixin``."""
    module.__dict__[CALLER_RUNS_STEP_END] = True


def release_step_end(module: nn.Module) -> None:
    """Hand the ``*_step_end`` hooks back to ``MGPUMixin``, for any other strategy that runs the module later."""
    module.__dict__.pop(CALLER_RUNS_STEP_END, None)


@contextmanager
def caller_runs_step_end(module: nn.Module) -> Iterator[None]:
    """Within this context, whoever calls ``module``'s steps calls the ``*_step_end`` hooks (strategy or doctor).

    ``MGPUMixin`` calls the hooks itself after each step otherwise, which is what runs them under Lightning's own
    strategies.
    """
    previous = module.__dict__.get(CALLER_RUNS_STEP_END, False)
    claim_step_end(module)
    try:
        yield
    finally:
        module.__dict__[CALLER_RUNS_STEP_END] = previous


def find_loss(output: Any) -> tuple[str | None, Any]:
    """Where Lightning finds the loss in a training step's output, and the loss: ``(None, None)`` if it has none."""
    if isinstance(output, torch.Tensor):
        return "output", output
    if isinstance(output, Mapping) and "loss" in output:
        return "output['loss']", output["loss"]
    return None, None
