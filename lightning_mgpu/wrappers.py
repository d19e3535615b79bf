"""Wrappers (DataParallel, DDP, torch.compile) hide the model's own attributes; ``unwrap`` finds the model again."""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DataParallel as TorchDataParallel
from torch.nn.parallel import DistributedDataParallel

from lightning_mgpu.engine import DataParallel


def unwrap(model: nn.Module) -> nn.Module:
    """The innermost module inside any stack of DataParallel, DDP, lightning_mgpu and ``torch.compile`` wrappers.

    Reach attributes through the result (``unwrap(model).encoder``) but call ``forward`` through the wrapper, or the
    other devices are not used.
    """
    while True:
        if isinstance(model, (TorchDataParallel, DistributedDataParallel, DataParallel)):
            model = model.module
        elif _is_compiled(model):
            # torch.compile's OptimizedModule keeps the original module as the private ``_orig_mod``; it has no
            # public accessor. The only use; tests/test_mixin.py covers it.
            model = model._orig_mod  # type: ignore[assignment]
        else:
            return model


def _is_compiled(model: nn.Module) -> bool:
    return type(model).__name__ == "OptimizedModule" and isinstance(getattr(model, "_orig_mod", None), nn.Module)
