"""The sampler that shards a dataset over DDP ranks without repeating samples."""

from __future__ import annotations

import torch
from torch.utils.data import DistributedSampler, TensorDataset

from lightning_mgpu.strategies.samplers import EvenlyShardedSampler, is_padding_sampler


def _dataset(rows: int = 5) -> TensorDataset:
    return TensorDataset(torch.arange(float(rows)))


def test_evenly_sharded_sampler_repeats_nothing() -> None:
    data = _dataset()
    shards = [list(EvenlyShardedSampler(data, num_replicas=2, rank=rank, shuffle=False)) for rank in (0, 1)]
    assert shards == [[0, 2, 4], [1, 3]]
    padded = [list(DistributedSampler(data, num_replicas=2, rank=rank, shuffle=False)) for rank in (0, 1)]
    assert sorted(padded[0] + padded[1]) == [0, 0, 1, 2, 3, 4], "torch's sampler repeats sample 0"


def test_like_copies_the_shard_settings() -> None:
    data = _dataset(7)
    padded = DistributedSampler(data, num_replicas=3, rank=2, shuffle=True, seed=11)
    unpadded = EvenlyShardedSampler.like(padded)
    assert (unpadded.num_replicas, unpadded.rank, unpadded.shuffle, unpadded.seed) == (3, 2, True, 11)
    assert is_padding_sampler(padded)
    assert not is_padding_sampler(unpadded)
