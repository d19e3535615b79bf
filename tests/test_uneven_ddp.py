"""``MGPUDDPStrategy(uneven_batches=True)``: every training sample once per epoch, every step equal to one device's."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

from lightning_mgpu.resume import ResumableSampler
from lightning_mgpu.strategies.samplers import UnevenShardSampler


def _dataset(rows: int) -> TensorDataset:
    return TensorDataset(torch.arange(float(rows)))


def _global_order(rows: int, shuffle: bool, seed: int, epoch: int) -> list[int]:
    """The rule the sampler promises, written out independently: DistributedSampler's permutation."""
    if not shuffle:
        return list(range(rows))
    return torch.randperm(rows, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def _shards(rows: int, batch: int, ranks: int, **options: object) -> list[UnevenShardSampler]:
    return [UnevenShardSampler(_dataset(rows), batch, num_replicas=ranks, rank=r, **options) for r in range(ranks)]


def _batches(sampler: UnevenShardSampler) -> list[list[int]]:
    indices = list(sampler)
    return [indices[start : start + sampler.batch_size] for start in range(0, len(indices), sampler.batch_size)]


@pytest.mark.parametrize(("rows", "batch", "ranks"), [(10, 4, 3), (13, 2, 3), (7, 2, 2), (12, 2, 3), (2, 4, 3)])
@pytest.mark.parametrize("shuffle", [False, True])
def test_every_sample_once_in_the_global_steps_of_one_device(rows: int, batch: int, ranks: int, shuffle: bool) -> None:
    for epoch in (0, 1):
        samplers = _shards(rows, batch, ranks, shuffle=shuffle, seed=5)
        for sampler in samplers:
            sampler.set_epoch(epoch)
        per_rank = [_batches(sampler) for sampler in samplers]
        assert len({len(batches) for batches in per_rank}) == 1, "every rank runs the same number of steps"
        assert [len(list(sampler)) for sampler in samplers] == [len(sampler) for sampler in samplers]

        order = _global_order(rows, shuffle, seed=5, epoch=epoch)
        step_size = ranks * batch
        global_steps = [order[start : start + step_size] for start in range(0, rows, step_size)]
        assert len(per_rank[0]) == len(global_steps)
        for step, expected in enumerate(global_steps):
            real = [per_rank[r][step][: samplers[r].rows(step)[0]] for r in range(ranks)]
            assert sum(real, []) == expected, f"step {step}: the ranks' real rows, in rank order, are the global batch"
            assert [sampler.rows(step)[1] for sampler in samplers] == [len(expected)] * ranks
            for r in range(ranks):
                mine, _ = samplers[r].rows(step)
                if mine == 0:
                    assert per_rank[r][step] == [expected[0]], "an empty rank yields one padding row, the step's first"
                else:
                    assert len(per_rank[r][step]) == mine, "only a rank without rows gets a padding row"


def test_the_last_step_is_split_as_evenly_as_possible() -> None:
    assert [s.rows(0) for s in _shards(10, 4, 3)] == [(4, 10), (3, 10), (3, 10)]
    assert [s.rows(2) for s in _shards(13, 2, 3)] == [(1, 1), (0, 1), (0, 1)]
    assert [s.rows(1) for s in _shards(14, 2, 3)] == [(2, 6), (2, 6), (2, 6)]
    assert [s.rows(2) for s in _shards(14, 2, 3)] == [(1, 2), (1, 2), (0, 2)]
    assert [list(s) for s in _shards(10, 4, 3, shuffle=False)] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    with pytest.raises(IndexError, match="outside the epoch's 3 steps"):
        _shards(13, 2, 3)[0].rows(3)


def test_drop_last_drops_the_partial_global_step_only() -> None:
    samplers = _shards(13, 2, 3, shuffle=False, drop_last=True)
    assert [list(s) for s in samplers] == [[0, 1, 6, 7], [2, 3, 8, 9], [4, 5, 10, 11]]
    assert [len(s) for s in samplers] == [4, 4, 4]
    assert samplers[0].num_steps == 2


def test_like_copies_lightnings_sampler_and_differs_from_its_padding() -> None:
    data = _dataset(13)
    padded = [DistributedSampler(data, num_replicas=3, rank=r, shuffle=True, seed=11) for r in range(3)]
    assert sorted(sum((list(s) for s in padded), [])) != list(range(13)), "DistributedSampler repeats samples"
    uneven = [UnevenShardSampler.like(s, batch_size=2) for s in padded]
    assert [(u.num_replicas, u.rank, u.shuffle, u.seed, u.batch_size) for u in uneven] == [
        (3, r, True, 11, 2) for r in range(3)
    ]
    real = [index for u in uneven for step, batch in enumerate(_batches(u)) for index in batch[: u.rows(step)[0]]]
    assert sorted(real) == list(range(13))


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="batch_size >= 1, got 0"):
        UnevenShardSampler(_dataset(4), 0, num_replicas=2, rank=0)
    with pytest.raises(ValueError, match="rank 2, outside the 2 ranks 0..1"):
        UnevenShardSampler(_dataset(4), 1, num_replicas=2, rank=2)


def test_a_resumed_epoch_skips_whole_batches_of_this_rank() -> None:
    """Exact resume skips ``skip_batches * batch_size`` indices: right, because only the last step is partial."""
    for rank in range(3):
        sampler = UnevenShardSampler(_dataset(13), 2, num_replicas=3, rank=rank, seed=3)
        sampler.set_epoch(1)
        whole = _batches(sampler)
        resumable = ResumableSampler(sampler)
        resumable.set_epoch(1)
        resumable.resume(None, skip=2 * sampler.batch_size)
        assert list(resumable) == sum(whole[2:], [])
