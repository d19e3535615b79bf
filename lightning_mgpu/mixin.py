"""``MGPUMixin``: one LightningModule that runs unchanged on one device, under ``ddp``, ``mgpu_dp`` and ``mgpu_ddp``."""

from __future__ import annotations

import contextvars
import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_mgpu.helpers import to_device_of
from lightning_mgpu.step.hooks import STEP_END_HOOKS, step_calls_step_end


class MGPUMixin:
    """Put first among a LightningModule's bases: ``class Net(MGPUMixin, L.LightningModule)``.

    - The ``*_step_end`` hooks run under every strategy: the ``mgpu_*`` strategies call them (after gathering, under
      ``mgpu_dp``); under Lightning's own strategies the mixin calls them right after each step the loop calls. A
      step called from another step (``super().training_step(...)``, ``test_step`` returning
      ``self.validation_step(...)``) returns its own output, as in Lightning 1.x.
    - ``self.replica_index`` and ``self.num_replicas`` read 0 and 1 outside ``mgpu_dp``'s replicas.
    - ``self.to_device_of(obj, related)`` moves data to the device of the tensor or module it goes with.
    - ``mgpu_*`` strategies check the model for multi-GPU traps at the start of ``fit``.
    """

    replica_index: int = 0
    num_replicas: int = 1

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for step in STEP_END_HOOKS:
            method = getattr(cls, step, None)  # inherited defaults too, so a lone predict_step_end still runs
            if callable(method) and method not in _STEP_THEN_STEP_END:
                setattr(cls, step, _calling_step_end(step, method))

    def to_device_of(self, obj: Any, related: torch.Tensor | nn.Module | torch.device | str) -> Any:
        """Move ``obj`` (a tensor or nested collection) to the device of ``related``; see ``to_device_of``."""
        return to_device_of(obj, related)


def _calling_step_end(step: str, method: Callable[..., Any]) -> Callable[..., Any]:
    hook = STEP_END_HOOKS[step]

    @functools.wraps(method)
    def step_then_step_end(self: Any, *args: Any, **kwargs: Any) -> Any:
        # A step called from a step (a subclass's calling super()'s, a test_step returning self.validation_step(...))
        # is a plain call, as in Lightning 1.x; only the step the loop calls runs its hook, and only when no strategy
        # or doctor does it instead.
        if _INSIDE_A_STEP.get():
            return method(self, *args, **kwargs)
        token = _INSIDE_A_STEP.set(True)
        try:
            output = method(self, *args, **kwargs)
        finally:
            _INSIDE_A_STEP.reset(token)
        if not step_calls_step_end():
            return output
        step_end = getattr(self, hook, None)
        return step_end(output) if callable(step_end) else output

    _STEP_THEN_STEP_END.add(step_then_step_end)
    return step_then_step_end


_INSIDE_A_STEP: contextvars.ContextVar[bool] = contextvars.ContextVar("lightning_mgpu_inside_a_step", default=False)
"""Whether a step ``_calling_step_end`` made is running in this thread (each replica's thread has its own)."""
_STEP_THEN_STEP_END: weakref.WeakSet[Callable[..., Any]] = weakref.WeakSet()
"""The steps ``_calling_step_end`` made, so a subclass does not wrap a step it inherits already wrapped."""
