"""What ``MGPUDDPStrategy(uneven_batches=True)`` cannot make equal to one device, refused before the first step.

Each check reads only what every rank has alike: the Trainer's settings and callbacks, the LightningModule, and the
training data as the user's code built it. So every rank raises the same ``ConfigurationError`` at the same point
(while the strategy sets up, or while Lightning sets up the training DataLoader) and none is left waiting for the
others in a collective.

The training DataLoader is judged as it was built, not as the strategy receives it: by then Lightning has rebuilt
it around its ``DistributedSampler``, which drops a sampler of one's own without a word and can turn a plain
``BatchSampler`` into ``batch_size=1``.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler

from lightning_mgpu._compat import BatchNorm
from lightning_mgpu.errors import ConfigurationError
from lightning_mgpu.namespaces import LIGHTNING, namespace_of
from lightning_mgpu.strategies.samplers import is_padding_sampler

_OWNER = "MGPUDDPStrategy(uneven_batches=True)"
_OR_OFF = "or leave uneven_batches off"


def check_uneven_training(
    trainer: pl.Trainer, module: pl.LightningModule, converts_batchnorm_to_sync: bool, device: torch.device
) -> None:
    """Refuse, while the strategy sets up, what weighting each rank's loss cannot make equal to one device.

    Args:
        trainer: the Trainer about to fit.
        module: the LightningModule it fits.
        converts_batchnorm_to_sync: whether ``Trainer(sync_batchnorm=True)`` will turn BatchNorm into SyncBatchNorm.
        device: this rank's device.
    """
    check_accumulation(trainer)
    if not module.automatic_optimization:
        raise ConfigurationError(
            f"{_OWNER} weights each rank's loss inside Lightning's automatic optimization, but"
            f" {type(module).__name__} sets automatic_optimization = False, where the strategy cannot tell which"
            f" backward is the step's loss. Use automatic optimization, {_OR_OFF}.",
            setting="LightningModule.automatic_optimization",
        )
    if "dataloader_iter" in inspect.signature(module.training_step).parameters:
        raise ConfigurationError(
            f"{_OWNER} needs to know which batch each step trains on, but {type(module).__name__}.training_step"
            f" takes dataloader_iter and fetches batches itself. Take (batch, batch_idx), {_OR_OFF}.",
            setting="LightningModule.training_step",
        )
    check_synced_batchnorm(module, converts_batchnorm_to_sync, device)


def check_synced_batchnorm(module: pl.LightningModule, converts_batchnorm_to_sync: bool, device: torch.device) -> None:
    """Refuse SyncBatchNorm layers whose statistics would take in a padding row: torch's own.

    ``Trainer(sync_batchnorm=True)`` on CPU processes converts BatchNorm layers (torch's SyncBatchNorm too) into
    ``MGPUSyncBatchNorm``, whose statistics leave a padding row out; on GPUs into torch's, which count every row.
    """
    if converts_batchnorm_to_sync and device.type == "cpu":
        return
    synced = BatchNorm if converts_batchnorm_to_sync else torch.nn.SyncBatchNorm
    names = [name for name, layer in module.named_modules() if isinstance(layer, synced)]
    if not names:
        return
    if converts_batchnorm_to_sync:
        raise ConfigurationError(
            f"{_OWNER} cannot train torch's SyncBatchNorm on {device.type} ({', '.join(names)}): its statistics span"
            " every rank and would include the padding row of a rank left without real rows (the strategy leaves"
            " that row out of the statistics on CPU processes only). Drop Trainer(sync_batchnorm=True) and use"
            f" GroupNorm or LayerNorm, {_OR_OFF}.",
            setting="Trainer.sync_batchnorm",
        )
    raise ConfigurationError(
        f"{_OWNER} cannot train torch's SyncBatchNorm layers ({', '.join(names)}): their statistics span every rank"
        " and would include the padding row of a rank left without real rows. Build them as BatchNorm layers and"
        f" pass Trainer(sync_batchnorm=True) on CPU processes, which leaves that row out, or use GroupNorm or"
        f" LayerNorm, {_OR_OFF}.",
        setting="MGPUDDPStrategy.uneven_batches",
    )


def check_accumulation(trainer: pl.Trainer) -> None:
    """Refuse gradient accumulation: ``Trainer(accumulate_grad_batches=...)`` or a ``GradientAccumulationScheduler``.

    The last, smaller step of an epoch would be accumulated with full ones at equal weight. A schedule that is 1 in
    every epoch accumulates nothing and passes.
    """
    why = "the last, smaller step of an epoch would be accumulated with full ones at equal weight"
    larger = f"a batch_size that many times larger, {_OR_OFF}"
    if trainer.accumulate_grad_batches > 1:
        raise ConfigurationError(
            f"{_OWNER} cannot be combined with Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}):"
            f" {why}. Use accumulate_grad_batches=1 with {larger}.",
            setting="Trainer.accumulate_grad_batches",
        )
    scheduler = (namespace_of(type(trainer)) or LIGHTNING).GradientAccumulationScheduler
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, scheduler) and callback.going_to_accumulate_grad_batches():
            schedule = dict(sorted(callback.scheduling.items()))
            first = min(epoch for epoch, factor in schedule.items() if factor > 1)
            raise ConfigurationError(
                f"{_OWNER} cannot be combined with {type(callback).__name__}({schedule}), which accumulates"
                f" {schedule[first]} batches per step from epoch {first}: {why}. Remove the callback and use"
                f" {larger}.",
                setting="Trainer.callbacks",
            )


def check_accumulation_now(trainer: pl.Trainer) -> None:
    """Refuse accumulation switched on after setup, by a callback that sets ``trainer.accumulate_grad_batches``."""
    if trainer.accumulate_grad_batches > 1:
        raise ConfigurationError(
            f"{_OWNER} cannot accumulate gradients, but trainer.accumulate_grad_batches became"
            f" {trainer.accumulate_grad_batches} at epoch {trainer.current_epoch} (a callback set it): the last,"
            " smaller step of an epoch would be accumulated with full ones at equal weight. Leave"
            f" accumulate_grad_batches at 1 and use a batch_size that many times larger, {_OR_OFF}.",
            setting="Trainer.accumulate_grad_batches",
        )


def training_loader(loaders: Sequence[object]) -> DataLoader:
    """The one training DataLoader, as the user's code built it, once the plan can follow it; else refuse.

    The plan needs one DataLoader over a map-style dataset, batched by ``batch_size``, whose order is the one that
    ``shuffle=True`` or ``shuffle=False`` gives. ``SequentialSampler`` and ``RandomSampler`` over the DataLoader's
    own dataset, with no settings of their own, are exactly what those build, so they pass as such.

    Args:
        loaders: the training data flattened into its iterables, as the training data source returned it.
    """
    if len(loaders) != 1:
        kinds = ", ".join(type(loader).__name__ for loader in loaders)
        raise ConfigurationError(
            f"{_OWNER} plans every step from one training DataLoader, but the training data holds {len(loaders)}"
            f" ({kinds}), whose batches no plan can make one device's. Train on one DataLoader (torch's"
            f" ConcatDataset joins datasets), {_OR_OFF}.",
            setting="Trainer.fit.train_dataloaders",
        )
    loader = loaders[0]
    if not isinstance(loader, DataLoader):
        raise ConfigurationError(
            f"{_OWNER} plans each rank's rows from a DataLoader's dataset and batch_size, but the training data is"
            f" a {type(loader).__name__}. Give DataLoader(dataset, batch_size=..., shuffle=...), {_OR_OFF}.",
            setting="Trainer.fit.train_dataloaders",
        )
    if isinstance(loader.dataset, IterableDataset):
        raise ConfigurationError(
            f"{_OWNER} plans each rank's rows from the indices of the training dataset, but"
            f" {type(loader.dataset).__name__} is an IterableDataset, which yields its samples itself and has no"
            f" indices. Use a map-style Dataset (with __len__ and __getitem__), {_OR_OFF}.",
            setting="DataLoader.dataset",
        )
    if loader.batch_size is None:
        given = (
            f"draws its batches from batch_sampler={type(loader.batch_sampler).__name__}, which decides every batch"
            " itself (and which Lightning, rebuilding the DataLoader around its DistributedSampler, can drop for"
            " batch_size=1)"
            if loader.batch_sampler is not None
            else "has batch_size=None, so every sample is a step of its own"
        )
        raise ConfigurationError(
            f"{_OWNER} needs the training DataLoader's batch_size to plan each rank's rows, but the DataLoader"
            f" {given}. Give the DataLoader batch_size=... and shuffle=... instead, {_OR_OFF}.",
            setting="DataLoader.batch_size",
        )
    own = _own_sampler(loader)
    if own is not None:
        raise ConfigurationError(
            f"{_OWNER} shards the training data itself, in the order that shuffle=True or shuffle=False gives, but"
            f" the training DataLoader has sampler={own}, whose order the plan cannot follow and would drop without"
            f" a word. Give the DataLoader shuffle=True or shuffle=False instead of a sampler, {_OR_OFF}.",
            setting="DataLoader.sampler",
        )
    return loader


def shuffles(loader: DataLoader) -> bool:
    """Whether a DataLoader that :func:`training_loader` accepted was built to shuffle (``shuffle=True``)."""
    return isinstance(loader.sampler, RandomSampler)


def lightnings_sampler(dataloader: DataLoader) -> DistributedSampler:
    """The ``DistributedSampler`` Lightning put in the training DataLoader, the plan's ranks and seed; else refuse."""
    sampler = dataloader.sampler
    if not is_padding_sampler(sampler):
        raise ConfigurationError(
            f"{_OWNER} takes the ranks and the seed of its plan from the DistributedSampler that Lightning puts in"
            f" the training DataLoader, but Lightning put none there (the sampler is {type(sampler).__name__}):"
            " Trainer(use_distributed_sampler=False) keeps it out. Keep use_distributed_sampler=True (the"
            f" default), {_OR_OFF}.",
            setting="Trainer.use_distributed_sampler",
        )
    assert isinstance(sampler, DistributedSampler)
    return sampler


def _own_sampler(loader: DataLoader) -> str | None:
    """The DataLoader's sampler, described, unless it is the one ``shuffle=`` builds (or one just like it)."""
    sampler = loader.sampler
    if type(sampler) is SequentialSampler:
        if sampler.data_source is loader.dataset:
            return None
        return "SequentialSampler over another data source than the DataLoader's dataset"
    if type(sampler) is RandomSampler:
        rows = len(loader.dataset)  # type: ignore[arg-type]
        settings = [
            name
            for name, own in (
                ("data source", sampler.data_source is not loader.dataset),
                ("replacement=True", sampler.replacement),
                (f"num_samples={sampler.num_samples}", sampler.num_samples != rows),
                ("generator", sampler.generator is not loader.generator),
            )
            if own
        ]
        return f"RandomSampler with its own {', '.join(settings)}" if settings else None
    return type(sampler).__name__
