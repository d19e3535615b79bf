"""The lightning_mgpu strategies, one per file."""

from lightning_mgpu.strategies.ddp import MGPUDDPStrategy
from lightning_mgpu.strategies.dp import MGPUDPStrategy

__all__ = ["MGPUDDPStrategy", "MGPUDPStrategy"]
