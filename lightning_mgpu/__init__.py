"""lightning_mgpu: multi-GPU strategies for Lightning 2.x (``mgpu_dp``), with the ``*_step_end`` hooks of 1.x."""

from lightning_mgpu.engine import DataParallel
from lightning_mgpu.errors import BatchSplitError, ConfigurationError, GatherError
from lightning_mgpu.registry import register_all
from lightning_mgpu.strategies import DataParallelStrategy

__version__ = "0.1.0"

register_all()

__all__ = [
    "BatchSplitError",
    "ConfigurationError",
    "DataParallel",
    "DataParallelStrategy",
    "GatherError",
    "__version__",
]
