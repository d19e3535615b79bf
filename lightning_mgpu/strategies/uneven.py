"""``MGPUDDPStrategy(uneven_batches=True)``: each optimizer step equal to one device's, on data the ranks do not divide.

The strategy's hooks only consult one ``UnevenTraining`` per fit, which holds all of it: the sampler that cuts each
global step of one device's rows into the ranks' shares (``UnevenShardSampler``), and for the batch that runs an
explicit ``UnevenStep`` that says what this rank's rows are. From it come the loss scale that makes DDP's average of
gradients one device's gradient, the weights of logged values, and what a padding row (a rank left without a real
row in the last step) must leave as it was.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from lightning_mgpu._compat import (
    epoch_aggregates,
    metric_states,
    restore_epoch_aggregates,
    restore_metric_states,
    set_logged_batch_size,
    training_batch,
    watch_training_data,
    with_sampler,
)
from lightning_mgpu.engine.reduce import reduce_op_name
from lightning_mgpu.namespaces import LIGHTNING, namespace_of
from lightning_mgpu.strategies.samplers import UnevenShardSampler
from lightning_mgpu.strategies.uneven_checks import (
    check_accumulation_now,
    check_uneven_training,
    lightnings_sampler,
    shuffles,
    training_loader,
)
from lightning_mgpu.sync_batchnorm import buffers_a_padding_row_changes


@dataclass
class _PaddingState:
    """What a rank's padding row would change and its step must leave as it was: buffers, metrics, epoch aggregates."""

    buffers: list[tuple[torch.Tensor, torch.Tensor]]
    """Each buffer the step may change, with its value before the step."""
    metrics: dict[str, dict[str, Any]]
    aggregates: dict[str, torch.Tensor]


@dataclass
class UnevenStep:
    """One training batch of an uneven epoch on this rank.

    Attributes:
        rows: this rank's real rows in the batch; 0 for a padding row.
        total: the real rows of the global step, on every rank together.
        batch: the batch itself, so that a value logged or reduced outside it (in a callback) is not weighted.
        padding: for a padding row, the state its step must put back; ``None`` otherwise, or once put back.
    """

    rows: int
    total: int
    batch: Any
    padding: _PaddingState | None = None


class UnevenTraining:
    """The shards of one fit, and the batch that runs now, for ``MGPUDDPStrategy(uneven_batches=True)``."""

    def __init__(self) -> None:
        self.shards: UnevenShardSampler | None = None
        self.step: UnevenStep | None = None
        self._training_data: tuple[object] | None = None
        self._stop_watching: Callable[[], None] | None = None
        self._weighting_paused = False
        self._namespace = LIGHTNING

    def setup(
        self, trainer: pl.Trainer, module: pl.LightningModule, converts_batchnorm_to_sync: bool, device: torch.device
    ) -> None:
        """Refuse what cannot be exact, and watch for the training data as the user's code built it."""
        self._namespace = namespace_of(type(trainer)) or LIGHTNING
        check_uneven_training(trainer, module, converts_batchnorm_to_sync, device)
        self._stop_watching = watch_training_data(trainer, self._see_training_data)

    def teardown(self) -> None:
        """Forget the fit's shards and batch, and stop watching its training data."""
        self.shards = self.step = self._training_data = None
        if self._stop_watching is not None:
            self._stop_watching()
            self._stop_watching = None

    def shard(self, dataloader: object) -> object:
        """The training DataLoader with an ``UnevenShardSampler`` in place of Lightning's padding sampler.

        What the plan can follow is judged on the training data as it was built (``setup`` watches Lightning's fetch
        of it); the ranks and the seed come from the ``DistributedSampler`` Lightning put in its rebuilt copy, the
        order from how the DataLoader was built: ``shuffle=True`` shuffles as that sampler does, ``shuffle=False``
        keeps the dataset's order, as one device would.
        """
        assert self._training_data is not None, "setup watches the training data source before Lightning fetches it"
        data = self._training_data[0]
        combined = self._namespace.CombinedLoader
        built = training_loader((data if isinstance(data, combined) else combined(data)).flattened)
        assert isinstance(dataloader, DataLoader), "Lightning's copy of a DataLoader is a DataLoader"
        assert built.batch_size is not None, "training_loader refuses DataLoaders without a batch_size"
        sampler = lightnings_sampler(dataloader)
        self.shards = UnevenShardSampler.like(
            sampler,
            built.batch_size,
            drop_last=dataloader.drop_last or sampler.drop_last,
            shuffle=sampler.shuffle and shuffles(built),
        )
        return with_sampler(dataloader, self.shards, self._namespace)

    def start_batch(self, trainer: pl.Trainer, batch: Any, batch_idx: int) -> None:
        """Make ``batch`` the step that runs now: its rows, the logged batch size, a padding row's state to keep."""
        if self.shards is None:
            return
        check_accumulation_now(trainer)
        self.restore_padding_buffers(trainer)  # a padding step whose loss had no backward (it returned None)
        rows, total = self.shards.rows(batch_idx)
        padding = None
        if rows == 0:
            module = trainer.lightning_module
            padding = _PaddingState(
                buffers=[(buffer, buffer.detach().clone()) for buffer in buffers_a_padding_row_changes(module)],
                metrics=metric_states(module),
                aggregates=epoch_aggregates(trainer),
            )
        self.step = UnevenStep(rows, total, batch, padding)
        set_logged_batch_size(trainer, rows)

    def running(self, trainer: pl.Trainer | None) -> UnevenStep | None:
        """The step of the training batch that runs now, or ``None`` outside one (a callback, evaluation)."""
        step = self.step
        if step is None or trainer is None or training_batch(trainer) is not step.batch:
            return None
        return step

    def runs_padding_row(self, trainer: pl.Trainer | None) -> bool:
        """Whether the training batch that runs now is this rank's padding row, whose rows count for nothing."""
        step = self.running(trainer)
        return step is not None and step.rows == 0

    def loss_scale(self, trainer: pl.Trainer | None, world_size: int) -> float | None:
        """The factor that makes DDP's average of the ranks' gradients the gradient of the step's mean loss.

        DDP divides the sum of the ranks' gradients by the number of ranks; a rank whose loss is the mean over its
        ``rows`` of a step's ``total`` rows, scaled by ``rows * world_size / total``, makes that average the gradient
        of the mean over all the step's rows. ``None`` where it is 1 (full steps) or no uneven step runs; 0 for a
        padding row.
        """
        step = self.running(trainer)
        if step is None or step.rows * world_size == step.total:
            return None
        return step.rows * world_size / step.total

    def rows_to_weight_by(self, trainer: pl.Trainer | None) -> int | None:
        """This rank's real rows, by which a value logged in the running step is weighted; ``None`` where not."""
        step = self.running(trainer)
        return None if step is None or self._weighting_paused else step.rows

    @contextlib.contextmanager
    def unweighted(self) -> Iterator[None]:
        """Reductions inside count every rank alike (Lightning's checkpoint and early-stopping votes)."""
        self._weighting_paused = True
        try:
            yield
        finally:
            self._weighting_paused = False

    def undo_padding_step(self, trainer: pl.Trainer | None) -> None:
        """After a step on a padding row, put back the metric states and epoch aggregates that row changed.

        Its buffers are put back after its backward (``restore_padding_buffers``): the backward may still need them.
        """
        padding = None if self.step is None else self.step.padding
        if padding is None or trainer is None:
            return
        restore_metric_states(trainer.lightning_module, padding.metrics)
        restore_epoch_aggregates(trainer, padding.aggregates)

    def restore_padding_buffers(self, trainer: pl.Trainer | None) -> None:
        """Put back the buffers a padding row's step changed (BatchNorm statistics, counters), and only those, once."""
        if self.step is None:
            return
        padding, self.step.padding = self.step.padding, None
        if padding is None or trainer is None:
            return
        with torch.no_grad():
            for buffer, value in padding.buffers:
                if not torch.equal(buffer, value):
                    buffer.copy_(value)

    def _see_training_data(self, data: object) -> None:
        self._training_data = (data,)


def reduce_over_real_rows(
    tensor: torch.Tensor, rows: int, group: Any | None, reduce_op: Any, reduce: Callable[..., Any]
) -> Any:
    """Reduce a value logged in a training batch as if one device had logged it over the step's real rows.

    A mean is weighted by each rank's real rows, in one all-reduce of the weighted values and the weights together;
    to a sum, maximum or minimum a rank without real rows contributes the value that changes nothing. Everything
    else goes to ``reduce`` (Lightning's) as it is.
    """
    op = reduce_op_name(reduce_op)
    if op == "mean" and dist.is_available() and dist.is_initialized():
        value = tensor if tensor.is_floating_point() else tensor.to(torch.get_default_dtype())
        payload = torch.cat([value.detach().reshape(-1) * rows, value.new_tensor([rows])])
        dist.all_reduce(payload, op=dist.ReduceOp.SUM, group=group)
        return (payload[:-1] / payload[-1]).reshape(value.shape)
    if rows == 0 and op in ("sum", "max", "min"):
        tensor = _identity(tensor, op)
    return reduce(tensor, group=group, reduce_op=reduce_op)


def _identity(tensor: torch.Tensor, op: str) -> torch.Tensor:
    """What a rank without real rows contributes to a sum, maximum or minimum: a value that changes nothing."""
    if op == "sum":
        return torch.zeros_like(tensor)
    if tensor.is_floating_point():
        return torch.full_like(tensor, float("-inf") if op == "max" else float("inf"))
    limits = torch.iinfo(tensor.dtype)
    return torch.full_like(tensor, limits.min if op == "max" else limits.max)
