"""Samplers that shard a dataset across ranks without repeating samples: for evaluation, and for exact training."""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from torch.utils.data import DataLoader, DistributedSampler, Sampler

from lightning_mgpu.errors import ConfigurationError


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


class UnevenShardSampler(Sampler[int]):
    """A training sampler that shards each global step across ranks without repeating or dropping a sample.

    Per epoch it takes the global order of ``DistributedSampler`` (``randperm`` seeded with ``seed + epoch`` when
    shuffling, else ``0, 1, 2, ...``) and cuts it into global steps of ``num_replicas * batch_size`` rows, the
    global batches one device would train on with that batch size. In a full step rank ``r`` takes rows
    ``[r * batch_size, (r + 1) * batch_size)`` of the step. The last, partial step of ``R`` rows is split as evenly
    as the ranks allow: rank ``r`` takes ``R // num_replicas + (r < R % num_replicas)`` contiguous rows, in rank
    order. A rank left without a row there yields the step's first index once, a padding row, so that every rank
    runs the same number of steps; :meth:`rows` tells it that its step has no real rows.

    Args:
        dataset: the training dataset; only its length is read.
        batch_size: the dataloader's batch size, the rows of a rank in a full step.
        num_replicas: the number of ranks.
        rank: this process's rank.
        shuffle: shuffle by epoch, as ``DistributedSampler`` does.
        seed: the seed of the shuffle, to which the epoch is added.
        drop_last: drop the last, partial global step, as one device drops its last, partial batch.
    """

    def __init__(
        self,
        dataset: Sized,
        batch_size: int,
        num_replicas: int,
        rank: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"UnevenShardSampler needs batch_size >= 1, got {batch_size}.")
        if not 0 <= rank < num_replicas:
            raise ValueError(
                f"UnevenShardSampler got rank {rank}, outside the {num_replicas} ranks 0..{num_replicas - 1}."
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0

    @classmethod
    def like(
        cls, sampler: DistributedSampler, batch_size: int, drop_last: bool = False, shuffle: bool | None = None
    ) -> UnevenShardSampler:
        """The uneven counterpart of the padding ``DistributedSampler`` that Lightning made for training.

        Lightning's sampler shuffles training data even when the DataLoader was built with ``shuffle=False``;
        ``shuffle`` overrides it, so the plan can keep the order one device would train in.
        """
        return cls(
            sampler.dataset,  # type: ignore[arg-type]
            batch_size=batch_size,
            num_replicas=sampler.num_replicas,
            rank=sampler.rank,
            shuffle=sampler.shuffle if shuffle is None else shuffle,
            seed=sampler.seed,
            drop_last=drop_last,
        )

    def set_epoch(self, epoch: int) -> None:
        """Shuffle the next epoch by ``seed + epoch``."""
        self.epoch = epoch

    @property
    def step_size(self) -> int:
        """The rows of a full global step, every rank's batch together."""
        return self.num_replicas * self.batch_size

    @property
    def full_steps(self) -> int:
        """How many global steps of ``step_size`` rows an epoch has."""
        return len(self.dataset) // self.step_size

    @property
    def last_rows(self) -> int:
        """The real rows of the last, partial global step; 0 when there is none (or it is dropped)."""
        return 0 if self.drop_last else len(self.dataset) % self.step_size

    @property
    def num_steps(self) -> int:
        """How many batches every rank runs per epoch."""
        return self.full_steps + (self.last_rows > 0)

    def rows(self, step: int) -> tuple[int, int]:
        """This rank's real rows in ``step`` (0 for a padding row) and the real rows of the whole step."""
        if 0 <= step < self.full_steps:
            return self.batch_size, self.step_size
        if step == self.full_steps and self.last_rows:
            return self._last_share(self.rank)[1], self.last_rows
        raise IndexError(f"step {step} is outside the epoch's {self.num_steps} steps")

    def __len__(self) -> int:
        return self.full_steps * self.batch_size + (max(self._last_share(self.rank)[1], 1) if self.last_rows else 0)

    def __iter__(self) -> Iterator[int]:
        order = self._global_order()
        for step in range(self.full_steps):
            start = step * self.step_size + self.rank * self.batch_size
            yield from order[start : start + self.batch_size]
        if self.last_rows:
            step_start = self.full_steps * self.step_size
            offset, count = self._last_share(self.rank)
            yield from order[step_start + offset : step_start + offset + count] if count else order[step_start:][:1]

    def _last_share(self, rank: int) -> tuple[int, int]:
        """Where ``rank``'s rows start within the last step, and how many it takes."""
        base, extra = divmod(self.last_rows, self.num_replicas)
        return rank * base + min(rank, extra), base + (rank < extra)

    def _global_order(self) -> list[int]:
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            return torch.randperm(len(self.dataset), generator=generator).tolist()
        return list(range(len(self.dataset)))


def evaluation_shards(dataloader: DataLoader, sampler: DistributedSampler) -> UnevenShardSampler:
    """The shards of an evaluation DataLoader whose steps every rank runs together, for ``gather_step_end``.

    Rank ``r`` takes rows ``[r * batch_size, (r + 1) * batch_size)`` of each step of ``ranks * batch_size`` rows, in
    the DataLoader's order, so the ranks' batches gathered in rank order are one device's batch; in an uneven last
    step a rank left without a row runs a padding row, which the gather leaves out.

    Raises:
        ConfigurationError: for a DataLoader without a ``batch_size`` (its own batch sampler), whose steps cannot be
            planned.
    """
    if dataloader.batch_size is None:
        raise ConfigurationError(
            "MGPUDDPStrategy(gather_step_end=True) gathers every rank's evaluation outputs in steps of batch_size"
            " rows per rank, but this evaluation DataLoader draws its batches from"
            f" batch_sampler={type(dataloader.batch_sampler).__name__}. Build it with batch_size=... and no"
            " batch_sampler, or leave gather_step_end off.",
            setting="DataLoader.batch_sampler",
        )
    return UnevenShardSampler.like(sampler, dataloader.batch_size, shuffle=sampler.shuffle)


def evaluation_shards_of(trainer: Any, step: str, dataloader_index: int) -> UnevenShardSampler:
    """The ``evaluation_shards`` of the DataLoader whose batch the evaluation ``step`` runs now.

    Raises:
        ConfigurationError: for a DataLoader whose sampler the strategy could not replace (no distributed sampler:
            every rank would run every row, and the gathered batch would hold each row once per rank).
    """
    loaders = trainer.test_dataloaders if step == "test_step" else trainer.val_dataloaders
    loader = loaders[dataloader_index] if isinstance(loaders, (list, tuple)) else loaders
    sampler = getattr(loader, "sampler", None)
    if not isinstance(sampler, UnevenShardSampler):
        raise ConfigurationError(
            f"MGPUDDPStrategy(gather_step_end=True) gathers every rank's {step} outputs into one device's batches, so"
            f" it shards the evaluation data itself, but this DataLoader's sampler is {type(sampler).__name__}, not a"
            " DistributedSampler it can replace (Trainer(use_distributed_sampler=False), or a sampler of its own):"
            " every rank would run every row. Leave use_distributed_sampler on and the sampler to Lightning, or leave"
            " gather_step_end off.",
            setting="DataLoader.sampler",
        )
    return sampler
