"""The private Lightning API this package relies on, so a Lightning upgrade that breaks it fails here first."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_mgpu._lightning_private import with_sampler
from lightning_mgpu.strategies.samplers import EvenlyShardedSampler, is_padding_sampler


class TaggedLoader(DataLoader):
    def __init__(self, dataset: TensorDataset, tag: str, **kwargs: object) -> None:
        super().__init__(dataset, **kwargs)
        self.tag = tag


def _dataset(rows: int = 5) -> TensorDataset:
    return TensorDataset(torch.arange(float(rows)))


def test_with_sampler_rebuilds_the_loader_around_the_new_sampler() -> None:
    data = _dataset()
    original = TaggedLoader(data, "mine", batch_size=2, sampler=DistributedSampler(data, num_replicas=2, rank=1))
    rebuilt = with_sampler(original, EvenlyShardedSampler(data, num_replicas=2, rank=1, shuffle=False))
    assert isinstance(rebuilt, TaggedLoader)
    assert rebuilt.tag == "mine"
    assert rebuilt.batch_size == 2
    assert [batch[0].tolist() for batch in rebuilt] == [[1.0, 3.0]]


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


def test_metric_states_round_trip_with_their_update_count() -> None:
    import torchmetrics

    from lightning_mgpu._lightning_private import metric_states, restore_metric_states

    holder = torch.nn.Module()
    holder.mean = torchmetrics.MeanMetric()
    holder.cat = torchmetrics.CatMetric()
    for value in (1.0, 2.0, 6.0):
        holder.mean.update(value)
        holder.cat.update(torch.tensor([value]))
    saved = metric_states(holder)
    fresh = torch.nn.Module()
    fresh.mean = torchmetrics.MeanMetric()
    fresh.cat = torchmetrics.CatMetric()
    restore_metric_states(fresh, saved)
    assert fresh.mean.update_count == 3
    assert fresh.mean.compute().item() == 3.0
    assert fresh.cat.compute().tolist() == [1.0, 2.0, 6.0]
