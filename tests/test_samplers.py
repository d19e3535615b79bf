"""The sampler that shards a dataset over DDP ranks without repeating samples."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, TensorDataset

from lightning_mgpu.errors import ConfigurationError
from lightning_mgpu.strategies.samplers import (
    EvenlyShardedSampler,
    evaluation_shards,
    evaluation_shards_of,
    is_padding_sampler,
)


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


def _gathered_steps(rows: int, ranks: int, batch_size: int) -> list[list[int]]:
    """Each evaluation step's real rows, every rank's batch in rank order, as ``gather_step_end`` merges them."""
    data = _dataset(rows)
    shards = []
    for rank in range(ranks):
        sampler = DistributedSampler(data, num_replicas=ranks, rank=rank, shuffle=False)
        shards.append(evaluation_shards(DataLoader(data, batch_size=batch_size, sampler=sampler), sampler))
    steps: list[list[int]] = []
    for step in range(shards[0].num_steps):
        merged: list[int] = []
        for shard in shards:
            order = list(shard)
            real, _ = shard.rows(step)
            merged += order[step * batch_size : step * batch_size + real]
        steps.append(merged)
    return steps


@pytest.mark.parametrize(("rows", "ranks", "batch_size"), [(7, 3, 2), (12, 2, 3), (5, 3, 1), (4, 3, 2)])
def test_evaluation_shards_give_one_devices_batches_in_its_order(rows: int, ranks: int, batch_size: int) -> None:
    one_device = [list(range(rows))[start : start + ranks * batch_size] for start in range(0, rows, ranks * batch_size)]
    assert _gathered_steps(rows, ranks, batch_size) == one_device


def test_evaluation_shards_count_a_padding_rank_as_no_rows() -> None:
    data = _dataset(7)
    sampler = DistributedSampler(data, num_replicas=3, rank=2, shuffle=False)
    shards = evaluation_shards(DataLoader(data, batch_size=2, sampler=sampler), sampler)
    assert [shards.rows(step) for step in range(shards.num_steps)] == [(2, 6), (0, 1)]
    assert list(shards) == [4, 5, 6], "the last step's padding row is a real sample, which the gather leaves out"


def test_evaluation_shards_refuse_a_dataloader_with_its_own_batch_sampler() -> None:
    data = _dataset(6)
    sampler = DistributedSampler(data, num_replicas=2, rank=0, shuffle=False)
    loader = DataLoader(data, batch_sampler=BatchSampler(sampler, 2, drop_last=False))
    with pytest.raises(ConfigurationError, match=r"batch_sampler=BatchSampler\. Build it with batch_size=") as raised:
        evaluation_shards(loader, sampler)
    assert raised.value.setting == "DataLoader.batch_sampler"


@pytest.mark.parametrize("step", ["validation_step", "test_step"])
def test_an_evaluation_loader_the_strategy_did_not_shard_is_refused_for_the_gather(step: str) -> None:
    data = _dataset(6)
    whole = DataLoader(data, batch_size=2)  # Trainer(use_distributed_sampler=False): every rank runs every row
    trainer = SimpleNamespace(val_dataloaders=whole, test_dataloaders=[whole])
    with pytest.raises(ConfigurationError, match=r"sampler is SequentialSampler.*use_distributed_sampler") as raised:
        evaluation_shards_of(trainer, step, 0)
    assert raised.value.setting == "DataLoader.sampler"
