"""lightning_mgpu: multi-GPU strategies for Lightning 2.x (``mgpu_dp``, ``mgpu_ddp``) with the ``*_step_end`` hooks."""

from lightning_mgpu.engine import DataParallel
from lightning_mgpu.engine.scatter import Fields, PerSample
from lightning_mgpu.errors import BatchSplitError, ConfigurationError, GatherError, ModelCheckError
from lightning_mgpu.launch import add_local_rank_argument, parse_local_rank
from lightning_mgpu.mixin import MGPUMixin
from lightning_mgpu.model_checks import Finding, check_model
from lightning_mgpu.params import register_parameters
from lightning_mgpu.placement import to_device_of
from lightning_mgpu.registry import register_all
from lightning_mgpu.strategies import DataParallelStrategy, DDPStrategy
from lightning_mgpu.wrappers import unwrap

__version__ = "0.1.0"

register_all()

__all__ = [
    "BatchSplitError",
    "ConfigurationError",
    "DataParallel",
    "DDPStrategy",
    "DataParallelStrategy",
    "Fields",
    "Finding",
    "GatherError",
    "MGPUMixin",
    "ModelCheckError",
    "PerSample",
    "__version__",
    "add_local_rank_argument",
    "check_model",
    "parse_local_rank",
    "register_parameters",
    "to_device_of",
    "unwrap",
]
