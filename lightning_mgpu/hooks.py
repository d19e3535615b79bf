"""The ``*_step_end`` hooks that Lightning 2.0 removed: where the loss and batch-wise reductions belong."""

from __future__ import annotations

from typing import Any

from torch import nn

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
