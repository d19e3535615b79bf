"""lightning_mgpu: multi-GPU strategies for Lightning 2.x (``mgpu_dp``, ``mgpu_ddp``) with the ``*_step_end`` hooks."""

from lightning_mgpu.engine import DataParallel
from lightning_mgpu.errors import BatchSplitError, ConfigurationError, GatherError
from lightning_mgpu.launch import add_local_rank_argument, parse_local_rank
from lightning_mgpu.registry import register_all
from lightning_mgpu.strategies import DataParallelStrategy, DDPStrategy

__version__ = "0.1.0"

register_all()

__all__ = [
    "BatchSplitError",
    "ConfigurationError",
    "DataParallel",
    "DDPStrategy",
    "DataParallelStrategy",
    "GatherError",
    "__version__",
    "add_local_rank_argument",
    "parse_local_rank",
]
