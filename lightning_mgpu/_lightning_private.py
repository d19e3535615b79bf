"""The one place that calls private Lightning API, each use explained and covered by tests/test_lightning_private.py."""

from __future__ import annotations

from torch.utils.data import DataLoader, Sampler


def with_sampler(dataloader: DataLoader, sampler: Sampler) -> DataLoader:
    """A copy of ``dataloader`` that draws its indices from ``sampler``.

    A DataLoader's sampler cannot be replaced after construction, and rebuilding one faithfully (custom subclasses,
    their init arguments, batch samplers) is what Lightning's private ``_update_dataloader`` does when it injects its
    own distributed samplers. Reusing it keeps our copy exactly as faithful as Lightning's.
    """
    from lightning.pytorch.utilities.data import _update_dataloader

    return _update_dataloader(dataloader, sampler)
