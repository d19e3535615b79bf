"""Exact resume from a mid-epoch checkpoint: the same sample order, the rest of the epoch, the same random streams.

Lightning restarts an interrupted epoch from its first batch unless the DataLoader keeps its own position (its
``state_dict``/``load_state_dict`` protocol), and does not save the random number generators, so a resumed run trains
on other samples than the run it continues. The ``mgpu_*`` strategies store the RNG states and the epoch's logged
aggregates in the checkpoint. A plain DataLoader's sampler they wrap in ``ResumableSampler``, whose epoch seed they
store and which skips the batches already trained on. A stateful DataLoader keeps its position by Lightning's
protocol; the strategies only make sure its saved state reaches it (Lightning drops it when ``configure_optimizers``
reads ``trainer.estimated_stepping_batches``, which sets the data up before the checkpoint's loops are loaded). An
``IterableDataset`` yields its samples itself, with no sampler to wrap: a plain DataLoader over one restarts the
epoch from the dataset's first batch, as on one device, and a warning says so.

The training DataLoader stays the one given wherever no order needs recording: a ``SequentialSampler``'s
order needs no seed, so its loader is re-created only to resume mid-epoch. A DataLoader that cannot be re-created
(an ``__init__`` argument not kept as an attribute) trains unchanged, as on one device; a mid-epoch checkpoint then
restarts its epoch on resume, as Lightning does, and one warning says so when such a checkpoint is saved or resumed.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, Sampler, SequentialSampler

from lightning_mgpu._compat import (
    batches_done_in_epoch,
    last_batch_started,
    metric_states,
    restore_metric_states,
    restore_training_results,
    saved_dataloader_states,
    training_results_state,
    with_sampler,
)
from lightning_mgpu.errors import EpochRestartWarning

STATE_KEY = "lightning_mgpu"
_NOT_RESUMABLE_WARNING = (
    "You're resuming from a checkpoint that ended before the epoch ended and your dataloader is not"
)
"""Lightning's warning for a mid-epoch resume of a DataLoader without a ``state_dict``: untrue once its sampler is
wrapped in ``ResumableSampler`` and told where to resume, so it is filtered out then."""


class ResumableSampler(Sampler[int]):
    """Yields what ``sampler`` yields, remembering what its order depends on, so a resumed epoch can repeat it.

    ``RandomSampler`` draws a fresh seed from the global RNG at every epoch; this wrapper draws it the same way (so
    the order equals the unwrapped sampler's) and keeps it. A sampler with a generator of its own (torch's samplers
    take ``generator=``) has that generator's state kept; any other sampler, the global RNG's state just before its
    first index is drawn (``SubsetRandomSampler`` and ``WeightedRandomSampler`` draw their whole order there), which
    a resumed epoch replays on a fork of the RNG. Deterministic samplers (sequential, distributed) are unaffected by
    either.
    """

    def __init__(self, sampler: Sampler[int]) -> None:
        self.sampler = sampler
        self.epoch_seed: int | None = None
        self.epoch_rng: torch.Tensor | None = None
        """The state of the generator the epoch's order was drawn from, where it is not ``epoch_seed``'s."""
        self._resume_seed: int | None = None
        self._resume_rng: torch.Tensor | None = None
        self._skip = 0

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]

    def set_epoch(self, epoch: int) -> None:
        """Forwarded to samplers that shuffle by epoch (``DistributedSampler``)."""
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def resume(self, seed: int | None, skip: int, rng: torch.Tensor | None = None) -> None:
        """Make the next epoch repeat the order of ``seed`` (or ``rng``) and start after its first ``skip`` indices."""
        self._resume_seed = seed
        self._resume_rng = rng
        self._skip = skip

    def __iter__(self) -> Iterator[int]:
        skip, self._skip = self._skip, 0
        seed, self._resume_seed = self._resume_seed, None
        rng, self._resume_rng = self._resume_rng, None
        indices = self._seeded_iter(seed) if self.draws_seed() else self._replayable_iter(rng)
        return itertools.islice(indices, skip, None) if skip else indices

    def _replayable_iter(self, rng: torch.Tensor | None) -> Iterator[int]:
        """The sampler's indices, its generator's state (or the global RNG's) kept first, or set to ``rng``."""
        generator = getattr(self.sampler, "generator", None)
        own = generator if isinstance(generator, torch.Generator) else None
        if rng is not None and own is not None:
            own.set_state(rng)
        self.epoch_rng = own.get_state() if own is not None else rng if rng is not None else torch.get_rng_state()
        with contextlib.ExitStack() as stack:
            if rng is not None and own is None:  # replayed on a fork: the global RNG is as the checkpoint left it
                stack.enter_context(torch.random.fork_rng(devices=[]))
                torch.set_rng_state(rng)
            indices = iter(self.sampler)
            first = next(indices, None)  # where torch's samplers draw their order
        if first is None:
            return iter(())
        return _chain(first, indices)

    def draws_seed(self) -> bool:
        """Whether the order depends on a seed drawn from the global RNG, which a resume must be told."""
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


def _without_order(pending: dict[str, Any], sampler: ResumableSampler) -> bool:
    """Whether a mid-epoch checkpoint holds nothing that tells ``sampler``'s order in its epoch.

    A RandomSampler's order needs its seed, any other's the generator state it was drawn from, unless it is a
    ``SequentialSampler``; checkpoints written before generator states were kept are trusted as they were then.
    """
    if sampler.draws_seed():
        return pending["sampler_seed"] is None
    if "sampler_rng" not in pending:
        return False
    return pending["sampler_rng"] is None and type(sampler.sampler) is not SequentialSampler


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


def keeps_its_position(dataloader: object) -> bool:
    """Whether ``dataloader`` checkpoints its own position by Lightning's ``state_dict``/``load_state_dict`` protocol.

    Such a loader (torchdata's ``StatefulDataLoader``, say) resumes by itself; skipping its batches again here would
    skip them twice.
    """
    return callable(getattr(dataloader, "state_dict", None)) and callable(getattr(dataloader, "load_state_dict", None))


class ExactResume:
    """Strategy hooks that save and restore what exact resume needs; a base of both ``mgpu_*`` strategies."""

    _resumable: ResumableSampler | None = None
    _not_recreated: EpochRestartWarning | None = None
    _kept: DataLoader | None = None
    """A training DataLoader left as given although it could need re-creating to resume a mid-epoch checkpoint."""
    _warned_restart = False
    _restarted_after = 0
    """Batches of the running epoch that Lightning's loop counts as done and the sampler never yielded."""
    _resume_state: dict[str, Any] | None = None
    _at_first_batch: dict[str, Any] | None = None
    _loader_states: list[Any] | None = None
    _hiding: tuple[Any, ...] | None = None
    """The warning filter that hides Lightning's not-resumable warning while a resumed epoch starts, until its first
    batch (or the end of the run)."""

    def process_dataloader(self, dataloader: object) -> object:
        """Make the training DataLoader resume a mid-epoch checkpoint on exactly the remaining samples."""
        dataloader = super().process_dataloader(dataloader)  # type: ignore[misc]
        if not (isinstance(dataloader, DataLoader) and self._stage() == RunningStage.TRAINING):
            return dataloader
        self._resumable = self._not_recreated = self._kept = None
        self._restarted_after = 0
        if keeps_its_position(dataloader):
            if self._loader_states:
                dataloader.load_state_dict(self._loader_states.pop(0))  # type: ignore[attr-defined]
                self._continue_epoch()
            return dataloader
        dataset = dataloader.dataset
        if isinstance(dataset, IterableDataset):
            self._restart_epoch(lambda done: UserWarning(_restart_warning(dataset, done)))
            return dataloader
        sampler = dataloader.sampler
        if isinstance(sampler, ResumableSampler) or dataloader.batch_size is None or not isinstance(sampler, Sampler):
            return dataloader
        pending = self._resume_state if self._resume_state and self._resume_state["skip_batches"] else None
        if pending is None and type(sampler) is SequentialSampler:
            self._kept = dataloader  # its order needs no seed, and nothing is to be skipped
            return dataloader
        try:
            wrapped = with_sampler(dataloader, ResumableSampler(sampler), self._namespace)  # type: ignore[attr-defined]
        except Exception as error:  # noqa: BLE001 - whatever stops Lightning re-creating it, the loader trains as given
            self._not_recreated = warning = _not_recreated(dataloader, str(error))
            self._restart_epoch(lambda _: warning)
            return dataloader
        assert isinstance(wrapped.sampler, ResumableSampler)
        self._resumable = wrapped.sampler
        if pending is not None and _without_order(pending, wrapped.sampler):
            self._restarted_after = pending["skip_batches"]  # the loop counts them, the sampler has not yielded them
            self._restart_epoch(lambda done: _no_seed_warning(dataloader, done))  # its order is not known
            return wrapped
        pending = self._continue_epoch()
        if pending is not None:
            skip = pending.get("sampler_skip", pending["skip_batches"]) * dataloader.batch_size
            wrapped.sampler.resume(pending["sampler_seed"], skip=skip, rng=pending.get("sampler_rng"))
            self._hide_not_resumable_warning()
        return wrapped

    def _hide_not_resumable_warning(self) -> None:
        """Hide Lightning's not-resumable warning for the epoch this resume starts, where it is untrue or said better.

        Lightning warns as its epoch loop starts; the filter is taken out again at the epoch's first batch
        (``on_train_batch_start``) or at the end of the run, so the process's filters are left as they were. A filter
        of your own that already hid the warning stays yours.
        """
        if self._hiding is not None:
            return
        found = list(warnings.filters)
        warnings.filterwarnings("ignore", message=_NOT_RESUMABLE_WARNING)
        added = warnings.filters[0]
        if added not in found:
            self._hiding = added

    def _show_not_resumable_warning(self) -> None:
        hiding, self._hiding = self._hiding, None
        filters = warnings.filters
        if hiding is not None and isinstance(filters, list):
            with contextlib.suppress(ValueError):  # already gone: warnings.resetwarnings() or a filter list replaced
                filters.remove(hiding)

    def teardown(self) -> None:
        """Take out the warning filter of a resume whose epoch never reached a batch."""
        self._show_not_resumable_warning()
        super().teardown()  # type: ignore[misc]

    def _check_recreatable(self) -> None:
        """Before a mid-epoch checkpoint is kept: warn if resuming it will restart its epoch.

        A loader left as given is re-created the way a resume would re-create it, and the copy dropped.
        """
        kept, self._kept = self._kept, None
        if kept is not None:
            try:
                resumable = ResumableSampler(kept.sampler)  # type: ignore[arg-type]
                with_sampler(kept, resumable, self._namespace)  # type: ignore[attr-defined]
            except Exception as error:  # noqa: BLE001 - as in process_dataloader
                self._not_recreated = _not_recreated(kept, str(error))
        if self._not_recreated is not None:
            self._warn_restart(self._not_recreated)

    def _continue_epoch(self) -> dict[str, Any] | None:
        """The saved state of an epoch the training data now resumes mid-way; its first batch restores the rest."""
        pending, self._resume_state = self._resume_state, None
        if pending is None or not pending["skip_batches"]:
            return None
        self._at_first_batch = pending
        return pending

    def _restart_epoch(self, warning: Callable[[int], Warning]) -> None:
        """Resume an epoch as Lightning does, from the loader's first batch, saying once what that costs.

        ``warning`` says it, given the number of batches done. As on one device, the epoch's logged aggregates and
        metric states start afresh too.
        """
        pending, self._resume_state = self._resume_state, None
        if pending is None or not pending["skip_batches"]:
            return
        self._hide_not_resumable_warning()  # ``warning`` says it, with the fix
        self._warn_restart(warning(pending["skip_batches"]))

    def _warn_restart(self, warning: Warning) -> None:
        """Warn once a run, on rank 0: every reason an epoch restarts on resume has the same fix."""
        if not self._warned_restart and self.global_rank == 0:  # type: ignore[attr-defined]
            warnings.warn(warning, stacklevel=3)
        self._warned_restart = True

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Add what exact resume needs, per rank: the epoch's sample order and progress, RNG states, epoch metrics.

        The epoch metrics are the logged values and the accumulated state of torchmetrics objects. Lightning calls
        this on every rank, so the ranks can pool their states here; rank 0 writes them.
        """
        skip_batches = self._batches_done_mid_epoch()
        if skip_batches:
            self._check_recreatable()
        trainer = self._trainer()
        mid_epoch = trainer if skip_batches and trainer is not None else None
        state = {
            "sampler_seed": self._resumable.epoch_seed if self._resumable is not None else None,
            "sampler_rng": self._resumable.epoch_rng if self._resumable is not None else None,
            "skip_batches": skip_batches,
            "sampler_skip": skip_batches - self._restarted_after if skip_batches else 0,
            "rng": rng_states(),
            "results": training_results_state(mid_epoch) if mid_epoch else [],
            "metrics": metric_states(mid_epoch.lightning_module) if mid_epoch else {},
        }
        checkpoint[STATE_KEY] = {"ranks": _gather_objects(state)}
        super().save_checkpoint(checkpoint, filepath, storage_options)  # type: ignore[misc]

    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """When resuming a fit, restore this rank's RNG states now and keep the rest for the training dataloader.

        A stateful DataLoader's saved state is handed to it when it is set up, as Lightning does; handing the same
        state again is harmless, and it is what Lightning omits when the data was set up before the checkpoint's
        loops were loaded.
        """
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)  # type: ignore[misc]
        if self._fn() != TrainerFn.FITTING:
            return checkpoint
        self._loader_states = list(saved_dataloader_states(checkpoint))
        ranks = checkpoint.get(STATE_KEY, {}).get("ranks")
        if ranks:
            rank = self.global_rank if len(ranks) == self.world_size else 0  # type: ignore[attr-defined]
            state = ranks[rank]
            set_rng_states(state["rng"])
            self._resume_state = state
        return checkpoint

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Mid-epoch resume: put the RNG and the epoch's logged aggregates back to where the interrupted run was.

        Creating the resumed epoch's data iterator drew from the RNG once more than that run had at this point.
        """
        super().on_train_batch_start(batch, batch_idx)  # type: ignore[misc]
        self._show_not_resumable_warning()
        if batch_idx == 0:
            self._restarted_after = 0
        state, self._at_first_batch = self._at_first_batch, None
        trainer = self._trainer()
        if state is not None and trainer is not None:
            set_rng_states(state["rng"])
            restore_training_results(trainer, state["results"])
            restore_metric_states(trainer.lightning_module, state.get("metrics", {}))

    def _batches_done_mid_epoch(self) -> int:
        trainer = self._trainer()
        if trainer is None or trainer.state.fn != TrainerFn.FITTING:
            return 0
        done = batches_done_in_epoch(trainer)  # this counts the batch whose on_train_batch_end saves
        return 0 if done >= trainer.num_training_batches or last_batch_started(trainer) else done

    def _trainer(self) -> pl.Trainer | None:
        module = self.lightning_module  # type: ignore[attr-defined]
        try:
            return module.trainer if module is not None else None
        except RuntimeError:  # not attached to a Trainer
            return None

    def _fn(self) -> TrainerFn | None:
        trainer = self._trainer()
        return trainer.state.fn if trainer is not None else None

    def _stage(self) -> RunningStage | None:
        trainer = self._trainer()
        return trainer.state.stage if trainer is not None else None


def _not_recreated(dataloader: DataLoader, cause: str) -> EpochRestartWarning:
    """What a mid-epoch checkpoint costs when ``dataloader`` trains unchanged, for ``cause``."""
    name = type(dataloader).__name__
    return EpochRestartWarning(
        f"The training DataLoader {name} is not re-created around a sampler that records its epoch's order ({cause}),"
        " so it trains as given, as on one device, and a run resumed from a mid-epoch checkpoint restarts that"
        " epoch from the loader's first batch (in a new order if it shuffles), as Lightning does, instead of"
        " continuing it. To resume exactly,"
        f" keep every __init__ argument of {name} as an attribute of the same name, or give it Lightning's"
        " state_dict/load_state_dict protocol (torchdata's StatefulDataLoader), or resume from an end-of-epoch"
        " checkpoint.",
        loader=name,
        cause=cause,
    )


def _no_seed_warning(dataloader: DataLoader, done: int) -> EpochRestartWarning:
    name = type(dataloader).__name__
    cause = "the checkpoint holds nothing that tells its epoch's order (a seed or a generator's state)"
    batches = _batches(done)
    return EpochRestartWarning(
        f"Resuming mid-epoch, after {batches} of the epoch, from a checkpoint saved while the training DataLoader"
        f" {name} could not be re-created around a sampler that records its epoch's order: {cause}, so the epoch"
        " restarts from its first batch in a new order, as Lightning does. This run's checkpoints hold the order"
        " again, so a run resumed from one of them continues exactly.",
        loader=name,
        cause=cause,
    )


def _restart_warning(dataset: IterableDataset, done: int) -> str:
    name = type(dataset).__name__
    ignored = (
        f" Lightning checkpoints a DataLoader's state, not its dataset's: {name}.state_dict is not saved."
        if keeps_its_position(dataset)
        else ""
    )
    batches = _batches(done)
    return (
        f"Resuming mid-epoch, after {batches} of the epoch, with a training DataLoader over the IterableDataset"
        f" {name}, whose position is not in the checkpoint: the epoch starts again from the dataset's first batch,"
        f" so the {batches} already done are trained on again (as on one device).{ignored} To resume after them,"
        " give the DataLoader Lightning's state_dict/load_state_dict protocol (torchdata's StatefulDataLoader saves the"
        " dataset's own state_dict), or resume from an end-of-epoch checkpoint."
    )


def _batches(count: int) -> str:
    return "1 batch" if count == 1 else f"{count} batches"


def _gather_objects(state: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's ``state``, in rank order (just this one outside a process group)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [state]
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, state)
    return gathered
