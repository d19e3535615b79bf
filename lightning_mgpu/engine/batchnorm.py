"""BatchNorm across replicas: every batch-norm call that normalises by batch statistics uses the whole batch's.

A batch-norm call in training mode normalises by the mean and variance of the batch it sees. Split across replicas,
each chunk would be normalised by its own statistics, which changes every output, gradient and running statistic
compared with one device. Each replica thread therefore runs under ``WholeBatchNorm``, a torch function mode that sees
every call of torch's batch-norm function (``F.batch_norm``, ``torch.batch_norm``) however it is reached: from a
BatchNorm layer's own forward, from a subclass's forward through ``super().forward()`` (timm's ``BatchNormAct2d``
normalises, then drops and activates), or from a module's own code. No method of any module is replaced, so every
layer's forward runs as written and only the normalisation inside it spans the whole batch.

The replicas of one call exchange per-channel sums (the replicas are threads of one process, so the exchange is a
hand-over of tensors within one autograd graph), and each normalises by the statistics of the whole batch; gradients
flow through the exchanged sums as they flow through one device's batch statistics. Running statistics handed to the
call are updated as torch's function updates them, so replica 0, which holds the module's own buffers, keeps them as
one device would.

A module compiled with ``fullgraph=True`` cannot leave its graph for the exchange; ``check_exchangeable`` names its
BatchNorm layers before any replica runs.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Hashable, Sequence
from itertools import chain
from typing import Any, NamedTuple, TypeVar

import torch
import torch.nn.functional as F  # noqa: N812 - torch's own spelling
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_mgpu import _compat
from lightning_mgpu._compat import BatchNorm
from lightning_mgpu.errors import ConfigurationError

_EMPTY = object()
T = TypeVar("T")

_BatchNormKey = tuple[str | None, int]
"""A batch-norm call of one replica: the layer whose tensors it got (``None`` for none), and its call count there."""


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
        self._combined: dict[Hashable, Any] = {}
        self._finished: set[int] = set()
        self._failed: BaseException | None = None

    def all_gather(self, index: int, key: Hashable, value: Any, what: str) -> list[Any]:
        """Give ``value`` as replica ``index``'s entry under ``key`` and return every replica's entry, in order.

        ``what`` describes the key for the errors: a replica that finished without contributing, or a timeout.
        """
        return self.combine(index, key, value, what, list)

    def combine(self, index: int, key: Hashable, value: Any, what: str, combine: Callable[[list[Any]], T]) -> T:
        """Like ``all_gather``, but return ``combine(every replica's entry)``, computed once for all of them.

        The last replica to arrive computes it while the others wait, so work that every replica needs alike is
        done once, and no replica competes with another for the interpreter while it is done.
        """
        with self._condition:
            values = self._values.setdefault(key, [_EMPTY] * self._parties)
            values[index] = value
            if _EMPTY not in values:
                self._combined[key] = combine(values)
            self._condition.notify_all()
            while True:
                if self._failed is not None:
                    raise RendezvousAborted(f"replica {index} stopped waiting at {what}: another replica failed")
                if key in self._combined:
                    return self._combined[key]  # type: ignore[no-any-return]
                missing = [other for other, entry in enumerate(values) if entry is _EMPTY]
                finished = [other for other in missing if other in self._finished]
                if finished:
                    raise RuntimeError(
                        f"{what} ran in replica {index} but replica(s) {', '.join(map(str, finished))}"
                        " finished the step without running it, so the batch statistics cannot span the whole"
                        " batch. Call the layer the same number of times in every replica (not under a condition"
                        " that depends on the data), or switch the cross-replica statistics off:"
                        " MGPUDPStrategy(sync_batchnorm=False)."
                    )
                if not self._condition.wait(self._timeout):
                    raise TimeoutError(
                        f"replica {index} waited {self._timeout:.0f} s at {what} for replica(s)"
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


class WholeBatchNorm(TorchFunctionMode):
    """In replica ``index``'s thread, normalise every batch-norm call in training mode by the whole batch.

    Calls are matched across replicas by the layer whose parameters or running statistics they receive and by how
    often that layer ran before in the call, so replicas whose layers run in the same order per layer exchange the
    right statistics; a call that gets no tensor of a layer is matched by its order among such calls.

    Args:
        rendezvous: where the replicas of this call exchange their sums.
        index: this replica's position among them.
        replica: this replica's module, whose tensors name the layer of each call.
    """

    def __init__(self, rendezvous: ReplicaRendezvous, index: int, replica: nn.Module) -> None:
        super().__init__()
        self.rendezvous = rendezvous
        self.index = index
        self.replica = replica
        self.calls = 0
        """How many calls used batch statistics, so a caller can tell whether the module makes any."""
        self._per_layer: dict[str | None, int] = {}
        self._layers: dict[int, str] | None = None

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """Route batch-norm calls that use batch statistics through the exchange; run everything else as it is."""
        kwargs = kwargs or {}
        if func is F.batch_norm or func is torch.batch_norm:
            return self._batch_norm(func, args, kwargs)
        return func(*args, **kwargs)

    @torch.compiler.disable
    def _batch_norm(self, func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        # Inside a compiled module the exchange runs between graphs: waiting for other threads is not traceable.
        call = _BatchNormCall.parse(func, args, kwargs)
        return func(*args, **kwargs) if call is None else self._normalise(call)

    def _normalise(self, call: _BatchNormCall) -> torch.Tensor:
        self.calls += 1
        layer = self._layer_of(call.weight, call.running_mean, call.bias, call.running_var)
        count = self._per_layer.get(layer, 0) + 1
        self._per_layer[layer] = count
        key: _BatchNormKey = (layer, count)
        x = call.input
        computed = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        rows = x.numel() // max(x.shape[1], 1)
        # Each torch call made in a replica's thread while the others run lets the interpreter pass between the
        # threads and back, which costs more than these small ops compute. So each replica makes one call, its
        # chunk's fused mean and variance, and the last replica to arrive normalises every chunk while the others
        # wait: the whole batch's statistics combined once, one autograd node per chunk.
        statistics = torch.var_mean(computed, [0, *range(2, x.dim())], correction=0) if rows else None
        chunk = _Chunk(call, computed, statistics, rows, _current_stream(x))
        outputs = self.rendezvous.combine(self.index, key, chunk, _describe(key), _normalise_every_chunk)
        output = outputs[self.index]
        return output if output.dtype == x.dtype else output.to(x.dtype)

    def _layer_of(self, *tensors: torch.Tensor | None) -> str | None:
        """The path of the module that owns the first of ``tensors`` it owns; ``None`` when it owns none."""
        if self._layers is None:
            self._layers = {
                id(tensor): path
                for path, module in self.replica.named_modules()
                for _, tensor in chain(module.named_parameters(recurse=False), module.named_buffers(recurse=False))
            }
        for tensor in tensors:
            if tensor is not None:
                path = self._layers.get(id(tensor))
                if path is not None:
                    return path
        return None


class _BatchNormCall:
    """The arguments of a call of ``F.batch_norm`` or ``torch.batch_norm`` that normalises by batch statistics."""

    __slots__ = ("bias", "eps", "input", "momentum", "running_mean", "running_var", "weight")

    _FUNCTIONAL = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")
    _FUNCTIONAL_DEFAULTS: dict[str, Any] = {
        "weight": None,
        "bias": None,
        "training": False,
        "momentum": 0.1,
        "eps": 1e-5,
    }
    _TORCH = ("input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps", "cudnn_enabled")

    def __init__(self, arguments: dict[str, Any]) -> None:
        self.input: torch.Tensor = arguments["input"]
        self.running_mean: torch.Tensor | None = arguments["running_mean"]
        self.running_var: torch.Tensor | None = arguments["running_var"]
        self.weight: torch.Tensor | None = arguments["weight"]
        self.bias: torch.Tensor | None = arguments["bias"]
        self.momentum: float | None = arguments["momentum"]
        self.eps: float = arguments["eps"]

    @classmethod
    def parse(cls, func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> _BatchNormCall | None:
        """The call's arguments when it normalises a tensor by its batch statistics; ``None`` for anything else.

        Calls in evaluation mode, and calls torch would refuse (missing arguments, an input without channels), are
        left to torch, which computes or refuses them as it would on one device.
        """
        order = cls._FUNCTIONAL if func is F.batch_norm else cls._TORCH
        defaults = cls._FUNCTIONAL_DEFAULTS if func is F.batch_norm else {}
        if len(args) > len(order) or any(name not in order for name in kwargs):
            return None
        arguments = {**defaults, **dict(zip(order, args, strict=False)), **kwargs}
        if any(name not in arguments for name in order if name != "cudnn_enabled"):
            return None
        x = arguments["input"]
        if not arguments["training"] or not isinstance(x, torch.Tensor) or x.dim() < 2:
            return None
        return cls(arguments)


class _Chunk(NamedTuple):
    """What one replica brings to a batch-norm call's exchange."""

    call: _BatchNormCall
    input: torch.Tensor
    """The call's input, in float32 where it came in half precision."""
    statistics: tuple[torch.Tensor, torch.Tensor] | None
    """``torch.var_mean`` of the input per channel (variance, mean); ``None`` for a chunk without rows."""
    rows: int
    stream: Any
    """The CUDA stream the replica's thread runs on, for its chunk's ops; ``None`` off CUDA."""


def _normalise_every_chunk(chunks: list[_Chunk]) -> list[torch.Tensor]:
    """Every chunk normalised by the whole batch's per-channel mean and variance, in one thread.

    Each chunk's variance is about its own mean, and the spread of the means is added by their rows (Chan et al.'s
    pairwise combination), so no two large sums are subtracted: as exact as one device's two passes. Gradients
    reach every chunk's input through its ``torch.var_mean``. Running statistics handed to each chunk's call are
    updated as torch's function updates them.

    Raises:
        ValueError: torch's own refusal, for the whole batch: one value per channel has no variance.
    """
    total = sum(chunk.rows for chunk in chunks)
    if total <= 1:
        shape = list(next(chunk for chunk in chunks if chunk.rows).input.shape) if any(c.rows for c in chunks) else []
        raise ValueError(f"Expected more than 1 value per channel when training, got input size {shape}")
    counted = [chunk for chunk in chunks if chunk.statistics is not None]
    device = counted[0].input.device
    variances = torch.stack([chunk.statistics[0].to(device) for chunk in counted])  # type: ignore[index]
    means = torch.stack([chunk.statistics[1].to(device) for chunk in counted])  # type: ignore[index]
    weights = torch.tensor([chunk.rows / total for chunk in counted], dtype=means.dtype, device=device)
    mean = weights @ means
    variance = weights @ (variances + (means - mean).pow(2))
    unbiased = variance.detach() * (total / (total - 1))
    outputs = []
    for chunk in chunks:
        call = chunk.call
        with torch.cuda.stream(chunk.stream) if chunk.stream is not None else contextlib.nullcontext():
            here = chunk.input.device
            weight, bias = (None if t is None else t.to(chunk.input.dtype) for t in (call.weight, call.bias))
            outputs.append(
                _Normalisation.apply(chunk.input, weight, bias, mean.to(here), variance.to(here), call.eps)
            )
            if call.running_mean is not None or call.running_var is not None:
                _update_running_statistics(call, mean.detach().to(here), unbiased.to(here))
    return outputs


def _current_stream(x: torch.Tensor) -> Any:
    return torch.cuda.current_stream(x.device) if x.is_cuda else None


class _Normalisation(torch.autograd.Function):
    """``(x - mean) / sqrt(variance + eps) * weight + bias`` per channel, as one autograd node.

    The same arithmetic as separate ops would make six nodes per chunk and layer, each a call into torch from the
    replica's thread. ``mean`` and ``variance`` are the whole batch's and get their gradients too. The backward is
    written in differentiable ops of the saved inputs, so second derivatives (a gradient penalty) are exact as well.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        mean: torch.Tensor,
        variance: torch.Tensor,
        eps: float,
    ) -> torch.Tensor:
        ctx.eps = eps
        ctx.save_for_backward(x, weight, mean, variance)
        shape = _channels(x)
        output = (x - mean.reshape(shape)) * torch.rsqrt(variance + eps).reshape(shape)
        if weight is not None:
            output = output * weight.reshape(shape)
        return output if bias is None else output + bias.reshape(shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, weight, mean, variance = ctx.saved_tensors
        shape, reduced = _channels(x), [0, *range(2, x.dim())]
        inverse_std = torch.rsqrt(variance + ctx.eps)
        scale = inverse_std if weight is None else weight * inverse_std
        grad_sum = grad.sum(reduced)
        grad_centred_sum = (grad * (x - mean.reshape(shape))).sum(reduced)
        wanted = ctx.needs_input_grad
        return (
            grad * scale.reshape(shape) if wanted[0] else None,
            grad_centred_sum * inverse_std if wanted[1] else None,
            grad_sum if wanted[2] else None,
            -grad_sum * scale if wanted[3] else None,
            -0.5 * grad_centred_sum * scale * inverse_std.pow(2) if wanted[4] else None,
            None,
        )


def _channels(x: torch.Tensor) -> list[int]:
    """The shape that broadcasts a per-channel vector over ``x`` (channels in dim 1)."""
    return [1, -1] + [1] * (x.dim() - 2)


@torch.no_grad()
def _update_running_statistics(call: _BatchNormCall, mean: torch.Tensor, unbiased_variance: torch.Tensor) -> None:
    factor = 0.0 if call.momentum is None else call.momentum
    if call.running_mean is not None:
        call.running_mean.mul_(1 - factor).add_(mean.to(call.running_mean.dtype), alpha=factor)
    if call.running_var is not None:
        call.running_var.mul_(1 - factor).add_(unbiased_variance.to(call.running_var.dtype), alpha=factor)


def _describe(key: _BatchNormKey) -> str:
    layer, count = key
    if layer is None:
        return f"batch-norm call {count} without a layer's parameters or statistics"
    return f"BatchNorm layer `{layer or 'the module'}` (call {count})"


def batchnorm_layers(module: nn.Module) -> list[str]:
    """The paths of ``module``'s BatchNorm layers (``BatchNorm1d/2d/3d``, ``SyncBatchNorm`` and their subclasses)."""
    return [name for name, layer in module.named_modules() if isinstance(layer, BatchNorm)]


def check_exchangeable(module: nn.Module, owner: str) -> None:
    """Refuse BatchNorm layers that cannot take part in the exchange, naming them, before any replica runs.

    A module compiled with ``fullgraph=True`` must run as one graph, and the exchange with the other replicas cannot
    be part of a graph: its BatchNorm layers would stop the first step with an error from deep inside the compiler.
    """
    refused = sorted(
        {
            ".".join(part for part in (prefix, name) if part) or "the module"
            for prefix, compiled in module.named_modules()
            if _compat.compiled_with_fullgraph(compiled)
            for name in batchnorm_layers(compiled)
        }
    )
    if refused:
        raise ConfigurationError(
            f"{owner} normalises BatchNorm layers by the whole batch's statistics, exchanged between the replicas"
            f" during the forward, but {', '.join(f'`{path}`' for path in refused)} run(s) inside a module compiled"
            " with fullgraph=True, which cannot pause for the exchange. Compile without fullgraph=True (the"
            " exchange then runs between graphs), or normalise each chunk by its own statistics with"
            " sync_batchnorm=False (which changes the results).",
            setting="torch.compile.fullgraph",
        )
