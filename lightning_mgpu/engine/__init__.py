"""The data-parallel engine: scatter, replicate, parallel apply, gather. It imports nothing from Lightning."""

from lightning_mgpu.engine.data_parallel import MGPUDataParallel, ReplicaOutputs, Scattered
from lightning_mgpu.engine.gather import gather
from lightning_mgpu.engine.parallel_apply import ParallelApply
from lightning_mgpu.engine.reduce import weighted_mean
from lightning_mgpu.engine.replicate import replicate
from lightning_mgpu.engine.scatter import chunk_sizes, scatter

__all__ = [
    "MGPUDataParallel",
    "ParallelApply",
    "ReplicaOutputs",
    "Scattered",
    "chunk_sizes",
    "gather",
    "replicate",
    "scatter",
    "weighted_mean",
]
