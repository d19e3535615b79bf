"""lightning_mgpu: multi-GPU strategies for Lightning 2.x (``mgpu_dp``, ``mgpu_ddp``) with the ``*_step_end`` hooks."""

from __future__ import annotations

import warnings
from typing import Any

from lightning_mgpu.checks import allow_plain_tensors, check_model
from lightning_mgpu.engine import MGPUDataParallel
from lightning_mgpu.engine.scatter import Fields, PerSample
from lightning_mgpu.errors import (
    BatchSplitError,
    ConfigurationError,
    EpochRestartWarning,
    Finding,
    GatherError,
    ModelCheckError,
    ReplicaStateError,
)
from lightning_mgpu.helpers import add_local_rank_argument, parse_local_rank, register_parameters, to_device_of, unwrap
from lightning_mgpu.mixin import MGPUMixin
from lightning_mgpu.strategies import MGPUDDPStrategy, MGPUDPStrategy, register_all

__version__ = "0.2.0"

register_all()

_DEPRECATED_NAMES = {
    "DataParallel": MGPUDataParallel,
    "DataParallelStrategy": MGPUDPStrategy,
    "DDPStrategy": MGPUDDPStrategy,
}
"""The 0.1 names, which shadowed torch's, Fabric's and Lightning's classes; kept through 0.2, removed in 0.3."""


def __getattr__(name: str) -> Any:
    """Resolve a 0.1 name to its class, with a warning naming the new one (``import`` and YAML class paths alike)."""
    if name in _DEPRECATED_NAMES:
        new = _DEPRECATED_NAMES[name]
        warnings.warn(
            f"lightning_mgpu.{name} is now lightning_mgpu.{new.__name__}; the old name, which shadows a torch or"
            f" Lightning class of the same name, will be removed in lightning_mgpu 0.3.",
            DeprecationWarning,
            stacklevel=2,
        )
        return new
    raise AttributeError(f"module 'lightning_mgpu' has no attribute {name!r}")


__all__ = [
    "BatchSplitError",
    "ConfigurationError",
    "EpochRestartWarning",
    "Fields",
    "Finding",
    "GatherError",
    "MGPUDDPStrategy",
    "MGPUDPStrategy",
    "MGPUDataParallel",
    "MGPUMixin",
    "ModelCheckError",
    "PerSample",
    "ReplicaStateError",
    "__version__",
    "add_local_rank_argument",
    "allow_plain_tensors",
    "check_model",
    "parse_local_rank",
    "register_parameters",
    "to_device_of",
    "unwrap",
]
