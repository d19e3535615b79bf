"""``Trainer(sync_batchnorm=True)`` under ``mgpu_ddp`` on CPU processes: BatchNorm statistics over every rank's rows.

torch's ``SyncBatchNorm`` syncs only GPU (and XPU, HPU, PrivateUse1) tensors: from torch 2.6 to 2.14 its forward raises
"SyncBatchNorm expected input tensor to be on GPU" for a CPU tensor in training, and ``DistributedDataParallel``
refuses to wrap a CPU module that holds one ("SyncBatchNorm layers only work with GPU modules"), subclasses included.
So on CPU processes ``mgpu_ddp`` hands Lightning ``SyncBatchNormLayers`` in place of its ``TorchSyncBatchNorm``,
which converts BatchNorm layers into ``MGPUSyncBatchNorm``, a BatchNorm layer of its own class (same parameters,
buffers and state dict keys) whose forward in training all-reduces each rank's statistics over the process group,
and at the end of ``fit`` puts the model's own layers back, holding the trained tensors. On GPUs it is Lightning's
conversion into torch's ``SyncBatchNorm``, unchanged.

The forward gives torch's batch-norm kernel the statistics of every rank's rows; the backward all-reduces each rank's
per-channel sums of the gradient and of the gradient times the normalised input, as torch's ``SyncBatchNorm`` does
with NCCL, and corrects each rank's input gradient by them. Running statistics move by the statistics of every rank's
rows (the variance unbiased with their count), on every rank alike.

A rank whose rows must not count (``MGPUDDPStrategy(uneven_batches=True)``'s padding row, under ``rows_not_counted``)
still takes part in both all-reduces, with a count of 0: its rows are normalised by the others' statistics and leave
them, and the gradient of every other row, as they were.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.function import once_differentiable

from lightning_mgpu import _compat
from lightning_mgpu._compat import BatchNorm
from lightning_mgpu.replica_state.batchnorm import statistics_gradient

_rows_counted = contextvars.ContextVar("lightning_mgpu_rows_counted", default=True)


@contextlib.contextmanager
def rows_not_counted(active: bool = True) -> Iterator[None]:
    """Inside (when ``active``), this rank's rows enter no ``MGPUSyncBatchNorm`` statistics: a padding row's step."""
    token = _rows_counted.set(not active and _rows_counted.get())
    try:
        yield
    finally:
        _rows_counted.reset(token)


class MGPUSyncBatchNorm(BatchNorm):
    """A BatchNorm layer whose statistics in training span the ranks of its process group, on any device.

    Args:
        num_features, eps, momentum, affine, track_running_stats: as torch's ``SyncBatchNorm`` takes them.
        process_group: the ranks to span; the default process group when ``None``.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Any = None,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:  # noqa: A002 - torch's name
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - torch's name
        """BatchNorm's forward, except in training under a process group of several ranks."""
        group = self.process_group if self.process_group is not None else _world()
        if not (self.training and group is not None and group.size() > 1):
            return super().forward(input)
        self._check_input_dim(input)
        if input.numel() and input.shape[1] == 0:
            raise ValueError("MGPUSyncBatchNorm number of input channels should be non-zero")
        factor = 0.0 if self.momentum is None else self.momentum
        tracked = self.track_running_stats
        if tracked:
            assert self.num_batches_tracked is not None, "a BatchNorm that tracks running statistics counts batches"
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # a cumulative average, as torch's
                factor = 1.0 / float(self.num_batches_tracked)
        computed = input.float() if input.dtype in (torch.float16, torch.bfloat16) else input
        weight = None if self.weight is None else self.weight.to(computed.dtype)
        bias = None if self.bias is None else self.bias.to(computed.dtype)
        output = _AcrossRanks.apply(
            computed,
            weight,
            bias,
            self.running_mean if tracked else None,
            self.running_var if tracked else None,
            (self.eps, factor, group, _rows_counted.get()),
        )
        return output if output.dtype == input.dtype else output.to(input.dtype)


def _world() -> Any:
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


class _AcrossRanks(torch.autograd.Function):
    """Batch norm by the statistics of every rank's rows: one all-reduce in the forward, one in the backward."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        settings: tuple[float, float, Any, bool],
    ) -> torch.Tensor:
        eps, factor, group, counted = settings
        mean, variance, total = _statistics(x, counted, group)
        if total <= 1:
            raise ValueError(
                f"Expected more than 1 value per channel when training, got {total} over every rank"
                f" (input size {list(x.shape)} on this one)"
            )
        output = torch.batch_norm(x, weight, bias, mean, variance, False, 0.0, eps, True)
        if running_mean is not None and running_var is not None:
            unbiased = variance * (total / (total - 1))
            _compat.move_averages_(
                [running_mean, running_var],
                [mean.to(running_mean.dtype), unbiased.to(running_var.dtype)],
                factor,
            )
        ctx.eps, ctx.group, ctx.counted, ctx.total = eps, group, counted, total
        ctx.save_for_backward(x, weight, mean, variance)
        return output

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, mean, variance = ctx.saved_tensors
        held, grad_weight, grad_bias = _compat.batch_norm_backward_parts(grad, x, weight, mean, variance, ctx.eps)
        channels = mean.numel()
        wanted = ctx.needs_input_grad
        grad_x = None
        # Only the input's gradient needs the other ranks' sums. Whether it is wanted is the graph's, alike on every
        # rank, so a layer on an input without gradient (a first layer on the data) skips the all-reduce everywhere.
        if wanted[0]:
            sums = torch.cat([grad_weight, grad_bias]) if ctx.counted else grad_weight.new_zeros(2 * channels)
            dist.all_reduce(sums, group=ctx.group)
            grad_x = held
            if ctx.counted:
                slope, offset = statistics_gradient(
                    weight, variance, ctx.eps, sums[:channels], sums[channels:], ctx.total
                )
                shape = [1, -1] + [1] * (x.dim() - 2)
                centred = x - mean.view(shape)
                grad_x = torch.addcmul(held, centred, slope.view(shape)).add_(offset.view(shape))
        return (
            grad_x,
            grad_weight if wanted[1] else None,
            grad_bias if wanted[2] else None,
            None,
            None,
            None,
        )


def _statistics(x: torch.Tensor, counted: bool, group: Any) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The per-channel mean and biased variance of every rank's rows, in ``x``'s dtype, and their count.

    Each rank puts its own count, mean and sum of squared deviations in its slot of one tensor, and one all-reduce
    gives every rank every slot; the slots combine as Chan's parallel variance does, so the variance is taken about
    each rank's own mean and never as a difference of large sums. All of it in float64, as torch's CPU kernel
    accumulates a float32 batch's statistics: in float32 the outputs drifted from one device's by 5e-7 where float64
    matched them bit for bit (a measurement on 2 ranks of 8 rows, 8 channels, 8x8).
    """
    channels = x.shape[1]
    reduced = [0, *range(2, x.dim())]
    rows = x.numel() // channels if counted else 0
    slots = torch.zeros(group.size(), 2 * channels + 1, dtype=torch.float64, device=x.device)
    if rows:
        mine = slots[group.rank()]
        variance, mean = torch.var_mean(x.detach().double(), reduced, correction=0)
        mine[:channels] = mean
        mine[channels:-1] = variance * rows
        mine[-1] = rows
    dist.all_reduce(slots, group=group)
    counts = slots[:, -1:]
    total = int(counts.sum().item())
    if total == 0:
        return x.new_zeros(channels), x.new_ones(channels), 0
    means = slots[:, :channels]
    mean = (means * counts).sum(0) / total
    squares = slots[:, channels:-1].sum(0) + (counts * (means - mean).pow(2)).sum(0)
    return mean.to(x.dtype), (squares / total).to(x.dtype), total


class SyncBatchNormLayers:
    """Lightning's ``TorchSyncBatchNorm`` for ``mgpu_ddp``: on CPU processes into ``MGPUSyncBatchNorm`` and back.

    Lightning calls ``apply`` while the strategy sets up for ``fit`` and ``revert`` when it tears down. On any other
    device both are Lightning's own (torch's ``SyncBatchNorm``, and back to a plain BatchNorm layer).

    Args:
        lightnings: the ``TorchSyncBatchNorm`` the Trainer built.
        device: this rank's device.
    """

    def __init__(self, lightnings: Any, device: torch.device) -> None:
        self.lightnings = lightnings
        self.device = device
        self._originals: dict[MGPUSyncBatchNorm, nn.Module] = {}

    def apply(self, model: nn.Module) -> nn.Module:
        """Every BatchNorm layer of ``model`` synced over the ranks: ``MGPUSyncBatchNorm`` on CPU, else torch's."""
        if self.device.type != "cpu":
            converted: nn.Module = self.lightnings.apply(model)
            return converted
        return self._convert(model)

    def revert(self, model: nn.Module) -> nn.Module:
        """On CPU, the model's own BatchNorm layers back in place, holding the trained parameters and statistics."""
        if self.device.type != "cpu":
            reverted: nn.Module = self.lightnings.revert(model)
            return reverted
        model = self._revert(model)
        self._originals.clear()
        return model

    def _convert(self, module: nn.Module) -> nn.Module:
        converted = module
        if isinstance(module, BatchNorm) and not isinstance(module, MGPUSyncBatchNorm):
            layer = MGPUSyncBatchNorm(
                module.num_features,
                module.eps,
                module.momentum,
                module.affine,
                module.track_running_stats,
                getattr(module, "process_group", None),
            )
            _hand_over(module, layer)
            self._originals[layer] = module
            converted = layer
        for name, child in module.named_children():
            converted.add_module(name, self._convert(child))
        return converted

    def _revert(self, module: nn.Module) -> nn.Module:
        reverted = module
        if isinstance(module, MGPUSyncBatchNorm) and module in self._originals:
            reverted = self._originals[module]
            _hand_over(module, reverted)
        for name, child in module.named_children():
            reverted.add_module(name, self._revert(child))
        return reverted


def _hand_over(source: nn.Module, target: nn.Module) -> None:
    """Give ``target`` the parameters, buffers and mode of ``source``, as torch's ``convert_sync_batchnorm`` does."""
    with torch.no_grad():
        for name, parameter in source.named_parameters(recurse=False):
            setattr(target, name, parameter)
    for name, buffer in source.named_buffers(recurse=False):
        setattr(target, name, buffer)
    target.training = source.training
    if hasattr(source, "qconfig"):
        target.qconfig = source.qconfig


SYNCED_BATCHNORM = (nn.SyncBatchNorm, MGPUSyncBatchNorm)
"""The BatchNorm layers whose statistics span the ranks."""


def buffers_a_padding_row_changes(module: nn.Module) -> list[torch.Tensor]:
    """The buffers of ``module`` a padding row's step may change: all but ``MGPUSyncBatchNorm``'s.

    Those move by the statistics of the ranks' real rows, on every rank alike, padding row or not.
    """
    synced = {
        id(buffer) for layer in module.modules() if isinstance(layer, MGPUSyncBatchNorm) for buffer in layer.buffers()
    }
    return [buffer for buffer in module.buffers() if id(buffer) not in synced]
