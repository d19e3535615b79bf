"""Evaluation samplers that shard a dataset across ranks without repeating samples."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from torch.utils.data import DistributedSampler


class EvenlyShardedSampler(UnrepeatedDistributedSampler):
    """Rank ``r`` of ``w`` takes samples ``r, r + w, r + 2w, ...``: every sample exactly once, none repeated.

    torch's ``DistributedSampler`` pads the last shards with copies of the first samples so every rank runs the same
    number of batches; for evaluation those copies are counted twice in epoch metrics (5 samples on 2 ranks count 6).
    """

    @classmethod
    def like(cls, sampler: DistributedSampler) -> EvenlyShardedSampler:
        """The unpadded counterpart of a ``DistributedSampler`` that Lightning made for an evaluation dataloader."""
        return cls(
            sampler.dataset,
            num_replicas=sampler.num_replicas,
            rank=sampler.rank,
            shuffle=sampler.shuffle,
            seed=sampler.seed,
        )


def is_padding_sampler(sampler: Any) -> bool:
    """Whether ``sampler`` is torch's padding ``DistributedSampler`` itself (not a subclass or a wrapper)."""
    return type(sampler) is DistributedSampler
