"""BatchNorm across replicas: every batch-norm call that normalises by batch statistics uses the whole batch's.

A batch-norm call in training mode normalises by the mean and variance of the batch it sees. Split across replicas,
each chunk would be normalised by its own statistics, which changes every output, gradient and running statistic
compared with one device. Each replica thread therefore runs under ``WholeBatchNorm``, a torch function mode that sees
every call of torch's batch-norm function (``F.batch_norm``, ``torch.batch_norm``) however it is reached: from a
BatchNorm layer's own forward, from a subclass's forward through ``super().forward()`` (timm's ``BatchNormAct2d``
normalises, then drops and activates), or from a module's own code. No method of any module is replaced, so every
layer's forward runs as written and only the normalisation inside it spans the whole batch.

The replicas of one call meet once per batch-norm call (they are threads of one process, so a meeting is a
hand-over of tensors within one autograd graph), and the last to arrive does the work of every chunk while the
others wait: the whole batch's mean, then its variance about that mean (two passes, as one device computes them),
then each chunk normalised by torch's own batch-norm kernel with those statistics given, all chunks as one autograd
node whose backward is one device's batch-norm gradient over the whole batch (torch's batch-norm backward for fixed
statistics per chunk, corrected by the whole batch's sums). So gradients flow through the statistics as on one
device, and a layer costs few calls into torch: on small layers each call, several microseconds of Python, costs more
than the per-channel ops compute. Running statistics handed to the call are updated as torch's function updates them,
so replica 0, which holds the module's own buffers, keeps them as one device would.

A module compiled with ``fullgraph=True`` cannot leave its graph for the exchange; ``check_exchangeable`` names its
BatchNorm layers before any replica runs.
"""

from __future__ import annotations

import contextlib
import functools
import operator
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
_T = TypeVar("_T")

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

    def combine(self, index: int, key: Hashable, value: Any, what: str, combine: Callable[[list[Any]], _T]) -> _T:
        """Give ``value`` as replica ``index``'s entry under ``key``; return ``combine(every replica's entry)``.

        The last replica to arrive computes it, once, while the others wait. ``what`` describes the key for the
        errors: a replica that finished without contributing, or a timeout.
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
                    return self._combined[key]
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
        # The last replica to arrive does the work of every chunk, while the others wait: the whole batch's mean,
        # then its variance about that mean (two passes, as one device computes them), then each chunk's
        # normalisation, all chunks as one autograd node.
        chunk = _Chunk(call, computed, _current_stream(x))
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
    stream: Any
    """The CUDA stream the replica's thread runs on, for its chunk's ops; ``None`` off CUDA."""


def _normalise_every_chunk(chunks: list[_Chunk]) -> list[torch.Tensor]:
    """Every chunk normalised by the whole batch's mean and variance: one autograd node for all of them.

    Raises:
        ValueError: torch's own refusal, for the whole batch: one value per channel has no variance.
    """
    inputs = [chunk.input for chunk in chunks]
    total = sum(x.numel() // max(x.shape[1], 1) for x in inputs)
    if total <= 1:
        shape = [sum(x.shape[0] for x in inputs), *inputs[0].shape[1:]]
        raise ValueError(f"Expected more than 1 value per channel when training, got input size {shape}")
    with torch.no_grad():
        mean, variance = _whole_batch_statistics(inputs, total, [chunk.stream for chunk in chunks])
    calls = [chunk.call for chunk in chunks]
    dtype = inputs[0].dtype
    weights = [None if call.weight is None else _as(call.weight, dtype) for call in calls]
    biases = [None if call.bias is None else _as(call.bias, dtype) for call in calls]
    return list(_WholeBatchNorm.apply(chunks, (mean, variance, total), *inputs, *weights, *biases))


def _whole_batch_statistics(
    inputs: Sequence[torch.Tensor], total: int, streams: Sequence[Any] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch's per-channel mean and biased variance in differentiable ops: two passes, as one device.

    ``streams``: each chunk's CUDA stream (``None`` entries off CUDA), where its reductions run.
    """
    reduced = [0, *range(2, inputs[0].dim())]
    device = inputs[0].device
    chunk_streams = streams if streams is not None else [None] * len(inputs)
    sums = []
    for x, stream in zip(inputs, chunk_streams, strict=True):
        with _on_stream(stream):
            sums.append(_to(x.sum(reduced), device))
    mean = _total(sums) / total
    squares = []
    for x, stream in zip(inputs, chunk_streams, strict=True):
        with _on_stream(stream):
            squares.append(_to((x - _to(mean, x.device).view(_channels(x))).pow(2).sum(reduced), device))
    return mean, _total(squares) / total


def _total(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The sum of ``parts`` in one call into torch per addition (``sum`` would first add them to 0)."""
    return functools.reduce(operator.add, parts)


class _WholeBatchNorm(torch.autograd.Function):
    """Every chunk of one batch-norm call, normalised by the whole batch's statistics, as one autograd node.

    The forward is torch's own batch-norm kernel given the whole batch's mean and variance, run for every chunk in
    one thread; the backward is one device's batch-norm gradient over the whole batch, each chunk's share on its own
    device. Inputs: every chunk's input, then every replica's
    weight and bias (``None`` without), so each replica's parameters get their chunk's gradient.
    """

    @staticmethod
    def forward(
        ctx: Any,
        chunks: list[_Chunk],
        statistics: tuple[torch.Tensor, torch.Tensor, int],
        *tensors: torch.Tensor | None,
    ) -> tuple[torch.Tensor, ...]:
        count = len(chunks)
        inputs = [chunk.input for chunk in chunks]  # the same tensors as tensors[:count], which autograd tracks
        weights, biases = tensors[count : 2 * count], tensors[2 * count :]
        mean, variance, total = statistics
        eps = chunks[0].call.eps
        outputs = []
        for chunk, x, weight, bias in zip(chunks, inputs, weights, biases, strict=True):
            with _on_stream(chunk.stream):
                here = x.device
                # torch's own kernel with the whole batch's statistics given: one call per chunk.
                outputs.append(
                    torch.batch_norm(x, weight, bias, _to(mean, here), _to(variance, here), False, 0.0, eps, True)
                )
        if any(chunk.call.running_mean is not None or chunk.call.running_var is not None for chunk in chunks):
            _update_running_statistics(chunks, mean, variance, total)
        ctx.eps, ctx.count, ctx.total = eps, count, total
        ctx.weighted, ctx.biased = [w is not None for w in weights], [b is not None for b in biases]
        ctx.save_for_backward(*inputs, *weights, mean, variance)
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        count = ctx.count
        saved = ctx.saved_tensors
        inputs, weights = saved[:count], saved[count : 2 * count]
        mean, variance = saved[2 * count], saved[2 * count + 1]
        total = ctx.total
        wanted = ctx.needs_input_grad[2:]
        if not torch.is_grad_enabled():
            return (None, None, *_fused_backward(ctx, grads, inputs, weights, mean, variance, wanted))
        # A second derivative: the statistics as functions of every chunk's input, in differentiable ops.
        mean, variance = _whole_batch_statistics(inputs, total)
        inverse_std = torch.rsqrt(variance + ctx.eps)
        shape = _channels(inputs[0])
        reduced = [0, *range(2, inputs[0].dim())]
        root = mean.device
        grad_sums = [grad.sum(reduced) for grad in grads]
        centred_sums = [
            (grad * (x - mean.to(x.device).view(shape))).sum(reduced) for grad, x in zip(grads, inputs, strict=True)
        ]
        mean_grad = _total([_to(part, root) for part in grad_sums]) / total
        mean_centred = _total([_to(part, root) for part in centred_sums]) * inverse_std.pow(2) / total
        scale = inverse_std if weights[0] is None else weights[0] * inverse_std
        grad_inputs, grad_weights, grad_biases = [], [], []
        for index, (grad, x) in enumerate(zip(grads, inputs, strict=True)):
            here = x.device
            centred = x - mean.to(here).view(shape)
            grad_x = (grad - mean_grad.to(here).view(shape) - centred * mean_centred.to(here).view(shape)) * scale.to(
                here
            ).view(shape)
            grad_inputs.append(grad_x if wanted[index] else None)
            grad_weights.append(
                centred_sums[index] * inverse_std.to(here) if ctx.weighted[index] and wanted[count + index] else None
            )
            grad_biases.append(grad_sums[index] if ctx.biased[index] and wanted[2 * count + index] else None)
        return (None, None, *grad_inputs, *grad_weights, *grad_biases)


def _fused_backward(
    ctx: Any,
    grads: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor | None],
    mean: torch.Tensor,
    variance: torch.Tensor,
    wanted: Sequence[bool],
) -> list[torch.Tensor | None]:
    """``_WholeBatchNorm``'s gradients in few calls into torch: one device's batch-norm gradient over every chunk.

    torch's batch-norm backward with the whole batch's statistics given gives, per chunk in one call, the gradient
    with the statistics held fixed and the chunk's sums of the gradient and of the gradient times the normalised
    input; the whole batch's sums then correct each chunk's input gradient for the statistics' dependence on it.
    """
    count, total = len(inputs), ctx.total
    root = mean.device
    shape = _channels(inputs[0])
    parts = [
        _compat.batch_norm_backward_parts(grad, x, weight, _to(mean, x.device), _to(variance, x.device), ctx.eps)
        for grad, x, weight in zip(grads, inputs, weights, strict=True)
    ]
    slope, offset = statistics_gradient(
        weights[0],
        variance,
        ctx.eps,
        _total([_to(grad_weight, root) for _, grad_weight, _ in parts]),
        _total([_to(grad_bias, root) for _, _, grad_bias in parts]),
        total,
    )
    grad_inputs, grad_weights, grad_biases = [], [], []
    for index, (x, (held, grad_weight, grad_bias)) in enumerate(zip(inputs, parts, strict=True)):
        here = x.device
        centred = x - _to(mean, here).view(shape)
        grad_inputs.append(
            torch.addcmul(held, centred, _to(slope, here).view(shape)).add_(_to(offset, here).view(shape))
            if wanted[index]
            else None
        )
        grad_weights.append(grad_weight if ctx.weighted[index] and wanted[count + index] else None)
        grad_biases.append(grad_bias if ctx.biased[index] and wanted[2 * count + index] else None)
    return [*grad_inputs, *grad_weights, *grad_biases]


def statistics_gradient(
    weight: torch.Tensor | None,
    variance: torch.Tensor,
    eps: float,
    grad_weight_sum: torch.Tensor,
    grad_bias_sum: torch.Tensor,
    total: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the batch statistics add to an input's batch-norm gradient: a slope on ``x - mean`` and an offset.

    One device's input gradient is ``scale * (grad - mean(grad) - x_hat * mean(grad * x_hat))``, with ``scale`` the
    weight times the inverse standard deviation; torch's backward for fixed statistics gives ``scale * grad``, and the
    rest is linear in ``x``, per channel, from the sums over all ``total`` values of ``grad * x_hat``
    (``grad_weight_sum``) and of ``grad`` (``grad_bias_sum``).
    """
    inverse_std = torch.rsqrt(variance + eps)
    scale = inverse_std if weight is None else weight * inverse_std
    per_row = scale / -total
    return per_row * inverse_std * grad_weight_sum, per_row * grad_bias_sum


def _to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``, without a call into torch where it is there already."""
    return tensor if tensor.device == device else tensor.to(device)


def _as(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` in ``dtype``, without a call into torch where it is in it already."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


def _on_stream(stream: Any) -> Any:
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _current_stream(x: torch.Tensor) -> Any:
    return torch.cuda.current_stream(x.device) if x.is_cuda else None


def _channels(x: torch.Tensor) -> list[int]:
    """The shape that broadcasts a per-channel vector over ``x`` (channels in dim 1)."""
    return [1, -1] + [1] * (x.dim() - 2)


@torch.no_grad()
def _update_running_statistics(
    chunks: Sequence[_Chunk], mean: torch.Tensor, variance: torch.Tensor, total: int
) -> None:
    """Every chunk's running statistics, as torch's batch norm updates them, in few calls into torch.

    The chunks that share a stream (every chunk off CUDA) and a momentum are updated together, on that stream.
    """
    groups: dict[tuple[int, float], list[_Chunk]] = {}
    for chunk in chunks:
        factor = 0.0 if chunk.call.momentum is None else chunk.call.momentum
        groups.setdefault((id(chunk.stream), factor), []).append(chunk)
    unbiased = variance * (total / (total - 1))
    for (_, factor), group in groups.items():
        with _on_stream(group[0].stream):
            running, new = [], []
            for call in (chunk.call for chunk in group):
                for tensor, value in ((call.running_mean, mean), (call.running_var, unbiased)):
                    if tensor is not None:
                        running.append(tensor)
                        new.append(_as(_to(value, tensor.device), tensor.dtype))
            if running:
                _compat.move_averages_(running, new, factor)


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
