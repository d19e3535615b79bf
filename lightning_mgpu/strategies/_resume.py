"""Exact resume from a mid-epoch checkpoint: the same sample order, the rest of the epoch, the same random streams.

Lightning restarts an interrupted epoch from its first batch (the loop only counts how many batches remain), and
does not save the random number generators, so a resumed run trains on other samples than the run it continues.
The ``mgpu_*`` strategies wrap the training sampler in ``ResumableSampler``, store its epoch seed and the RNG states
in the checkpoint, and on resume skip the batches already trained on and restore the RNG states.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import RandomSampler, Sampler

STATE_KEY = "lightning_mgpu"


class ResumableSampler(Sampler[int]):
    """Yields what ``sampler`` yields, remembering what its order depends on, so a resumed epoch can repeat it.

    ``RandomSampler`` draws a fresh seed from the global RNG at every epoch; this wrapper draws it the same way (so
    the order equals the unwrapped sampler's) and keeps it. Deterministic samplers (sequential, distributed) need
    nothing kept.
    """

    def __init__(self, sampler: Sampler[int]) -> None:
        self.sampler = sampler
        self.epoch_seed: int | None = None
        self._resume_seed: int | None = None
        self._skip = 0

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]

    def set_epoch(self, epoch: int) -> None:
        """Forwarded to samplers that shuffle by epoch (``DistributedSampler``)."""
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def resume(self, seed: int | None, skip: int) -> None:
        """Make the next epoch repeat the order of ``seed`` and start after its first ``skip`` indices."""
        self._resume_seed = seed
        self._skip = skip

    def __iter__(self) -> Iterator[int]:
        skip, self._skip = self._skip, 0
        seed, self._resume_seed = self._resume_seed, None
        indices = self._seeded_iter(seed) if self._draws_seed() else iter(self.sampler)
        return itertools.islice(indices, skip, None) if skip else indices

    def _draws_seed(self) -> bool:
        return isinstance(self.sampler, RandomSampler) and self.sampler.generator is None

    def _seeded_iter(self, seed: int | None) -> Iterator[int]:
        sampler = self.sampler
        assert isinstance(sampler, RandomSampler)
        if seed is None:
            seed = int(torch.empty((), dtype=torch.int64).random_().item())  # exactly as RandomSampler draws it
        self.epoch_seed = seed
        sampler.generator = torch.Generator().manual_seed(seed)
        try:
            indices = iter(sampler)
            first = next(indices, None)  # RandomSampler reads its generator here
        finally:
            sampler.generator = None
        if first is None:
            return iter(())
        return _chain(first, indices)


def _chain(first: int, rest: Iterator[int]) -> Iterator[int]:
    yield first
    yield from rest


def rng_states() -> dict[str, Any]:
    """The global random number generators' states (torch, CUDA, numpy, Python)."""
    kind, keys, position, has_gauss, cached = np.random.get_state(legacy=True)
    keys_tensor = torch.from_numpy(np.asarray(keys, dtype=np.int64))
    states: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        # Plain types and tensors only, so the checkpoint loads with torch.load(weights_only=True).
        "numpy": [kind, keys_tensor, int(position), int(has_gauss), float(cached)],
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore what ``rng_states`` returned."""
    torch.set_rng_state(states["torch"])
    kind, keys, position, has_gauss, cached = states["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, cached))
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
