"""The lightning_mgpu strategies, one per file."""

from lightning_mgpu.strategies.ddp import DDPStrategy
from lightning_mgpu.strategies.dp import DataParallelStrategy

__all__ = ["DDPStrategy", "DataParallelStrategy"]
