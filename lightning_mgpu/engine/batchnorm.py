"""BatchNorm across replicas: every replica normalises its chunk with the statistics of the whole batch.

A BatchNorm layer in training mode normalises by the mean and variance of the batch it sees. Split across replicas,
each chunk would be normalised by its own statistics, which changes every output, gradient and running statistic
compared with one device. Here the replicas of one call exchange per-channel sums (the replicas are threads of one
process, so the exchange is a hand-over of tensors within one autograd graph), and each normalises by the statistics
of the whole batch; gradients flow through the exchanged sums as they flow through one device's batch statistics.
Replica 0, which holds the module's own buffers, updates the running statistics as one device would.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Hashable, Sequence
from typing import Any

import torch
from torch import nn

from lightning_mgpu._compat import BatchNorm, check_batchnorm_input

_EMPTY = object()


class ReplicaRendezvous:
    """Hands each replica thread the values every replica contributed under the same key, within one call.

    Args:
        parties: the replicas taking part in the call.
        timeout: seconds a replica waits for the others before giving up with an error.
    """

    def __init__(self, parties: int, timeout: float = 300.0) -> None:
        self._parties = parties
        self._timeout = timeout
        self._condition = threading.Condition()
        self._values: dict[Hashable, list[Any]] = {}
        self._finished: set[int] = set()
        self._failed: BaseException | None = None

    def all_gather(self, index: int, key: Hashable, value: Any) -> list[Any]:
        """Give ``value`` as replica ``index``'s entry under ``key`` and return every replica's entry, in order."""
        with self._condition:
            values = self._values.setdefault(key, [_EMPTY] * self._parties)
            values[index] = value
            self._condition.notify_all()
            while True:
                if self._failed is not None:
                    raise RendezvousAborted(f"replica {index} stopped waiting at {key}: another replica failed")
                missing = [other for other, entry in enumerate(values) if entry is _EMPTY]
                if not missing:
                    return list(values)
                finished = [other for other in missing if other in self._finished]
                if finished:
                    raise RuntimeError(
                        f"{_describe(key)} ran in replica {index} but replica(s) {', '.join(map(str, finished))}"
                        " finished the step without running it, so the batch statistics cannot span the whole"
                        " batch. Call the layer the same number of times in every replica (not under a condition"
                        " that depends on the data), or switch the cross-replica statistics off:"
                        " MGPUDPStrategy(sync_batchnorm=False)."
                    )
                if not self._condition.wait(self._timeout):
                    raise TimeoutError(
                        f"replica {index} waited {self._timeout:.0f} s at {_describe(key)} for replica(s)"
                        f" {', '.join(map(str, missing))}."
                    )

    def finish(self, index: int) -> None:
        """Replica ``index`` returned: nothing more will come from it."""
        with self._condition:
            self._finished.add(index)
            self._condition.notify_all()

    def abort(self, error: BaseException) -> None:
        """A replica failed: wake every waiting replica so that none waits for it."""
        with self._condition:
            self._failed = error
            self._condition.notify_all()


class RendezvousAborted(RuntimeError):
    """Raised in a replica that was waiting for another replica that failed; the other's error is the one to read."""


def _describe(key: Hashable) -> str:
    if isinstance(key, tuple) and len(key) >= 2:
        return f"BatchNorm layer `{key[0] or 'the module'}` (call {key[1] + 1})"
    return str(key)


def batchnorm_paths(module: nn.Module) -> list[tuple[int, str]]:
    """The positions in ``module.modules()`` and the names of its BatchNorm layers."""
    names = {id(layer): name for name, layer in module.named_modules()}
    return [
        (position, names[id(layer)]) for position, layer in enumerate(module.modules()) if isinstance(layer, BatchNorm)
    ]


def synchronise(
    replicas: Sequence[nn.Module], layers: Sequence[tuple[int, str]], rendezvous: ReplicaRendezvous
) -> None:
    """Make the BatchNorm layers at ``layers`` of each replica normalise with the whole batch's statistics."""
    for index, replica in enumerate(replicas):
        modules = list(replica.modules())
        calls: dict[str, int] = {}
        for position, name in layers:
            layer = modules[position]
            assert isinstance(layer, BatchNorm)
            layer.__dict__["forward"] = functools.partial(_forward, layer, name, index, rendezvous, calls)


def _forward(
    layer: BatchNorm,
    name: str,
    index: int,
    rendezvous: ReplicaRendezvous,
    calls: dict[str, int],
    x: torch.Tensor,
) -> torch.Tensor:
    check_batchnorm_input(layer, x)
    uses_batch_statistics = layer.training or (layer.running_mean is None and layer.running_var is None)
    if not uses_batch_statistics:
        return type(layer).forward(layer, x)
    call = calls.get(name, 0)
    calls[name] = call + 1
    reduced = [0, *range(2, x.dim())]
    shape = [1, -1] + [1] * (x.dim() - 2)
    rows = x.numel() // max(x.shape[1], 1)
    sums = rendezvous.all_gather(index, (name, call, "sum"), (x.sum(reduced), rows))
    count = sum(rows for _, rows in sums)
    if count <= 1:
        raise ValueError(f"Expected more than 1 value per channel when training, got input size {list(x.shape)}")
    mean = sum(total.to(x.device) for total, _ in sums) / count
    centred = x - mean.reshape(shape)
    squares = rendezvous.all_gather(index, (name, call, "squares"), centred.pow(2).sum(reduced))
    variance = sum(total.to(x.device) for total in squares) / count
    output = centred * torch.rsqrt(variance + layer.eps).reshape(shape)
    if layer.weight is not None:
        output = output * layer.weight.reshape(shape)
    if layer.bias is not None:
        output = output + layer.bias.reshape(shape)
    if index == 0 and layer.training and layer.track_running_stats:
        _update_running_statistics(layer, mean.detach(), variance.detach() * (count / (count - 1)))
    return output


@torch.no_grad()
def _update_running_statistics(layer: BatchNorm, mean: torch.Tensor, unbiased_variance: torch.Tensor) -> None:
    factor = 0.0 if layer.momentum is None else layer.momentum
    if layer.num_batches_tracked is not None:
        layer.num_batches_tracked.add_(1)
        if layer.momentum is None:
            factor = 1.0 / float(layer.num_batches_tracked)
    if layer.running_mean is not None:
        layer.running_mean.mul_(1 - factor).add_(mean.to(layer.running_mean.dtype), alpha=factor)
    if layer.running_var is not None:
        layer.running_var.mul_(1 - factor).add_(unbiased_variance.to(layer.running_var.dtype), alpha=factor)
