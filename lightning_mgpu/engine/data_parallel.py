"""Scatter, replicate, parallel apply, settle, gather: one data-parallel call of a module method."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import chain
from typing import Any, NamedTuple

import torch
from torch import nn

from lightning_mgpu.engine.gather import gather
from lightning_mgpu.engine.parallel_apply import ContextFactory, ParallelApply
from lightning_mgpu.engine.replicate import ReplicaCache, all_on, modules_of
from lightning_mgpu.engine.scatter import (
    LayoutMemory,
    Source,
    check_chunk_weight_count,
    check_chunk_weights,
    move_to,
    scatter_inputs,
    scatter_to_devices,
)
from lightning_mgpu.errors import ConfigurationError
from lightning_mgpu.replica_state import ReplicaGuard
from lightning_mgpu.replica_state.batchnorm import (
    ReplicaRendezvous,
    WholeBatchNorm,
    batchnorm_layers,
    check_exchangeable,
)

DeviceLike = torch.device | str | int
Call = tuple[tuple[Any, ...], dict[str, Any]]
"""The positional and keyword arguments one replica is called with."""


class Scattered(NamedTuple):
    """One call split across devices: each replica's arguments, the batch rows it received, and its device."""

    calls: list[Call]
    sizes: list[int]
    devices: list[torch.device]


class ReplicaOutputs:
    """What the replicas of one call returned, before gathering.

    Attributes:
        outputs: one output per replica, in batch order.
        sizes: the number of batch rows each replica received.
        replicas: the replica modules, so callers can read what the replicas recorded.
    """

    def __init__(self, outputs: list[Any], sizes: list[int], replicas: list[nn.Module]) -> None:
        self.outputs = outputs
        self.sizes = sizes
        self.replicas = replicas


class MGPUDataParallel(nn.Module):
    """Single-process data parallelism over any devices, the CPU and repeated devices included.

    A drop-in for ``torch.nn.DataParallel``: it takes the same arguments, in the same order, and ``forward`` splits
    every positional and keyword input by the same rows. ``torch.nn.DataParallel`` needs distinct CUDA devices; this
    wrapper runs the same algorithm with replicas whose parameters alias the originals where a device repeats, so a
    model can be checked for data-parallel problems on a laptop. Attribute access falls through to the wrapped
    module; calling the wrapper runs ``forward`` in parallel.

    Args:
        module: the module to replicate; it must live on the first device (with one device it is moved there, as
            ``torch.nn.DataParallel`` moves it).
        devices: one entry per replica, as ``torch.device``, a string, or an accelerator index as
            ``torch.nn.DataParallel`` takes them; the first is the root device that inputs are split from and
            replica 0 runs on. By default every CUDA device, or the CPU alone where there is none.
        output_device: where ``forward`` gathers its outputs; by default the root device. ``-1`` means the CPU, as
            in ``torch.nn.DataParallel``.
        dim: accepted for ``torch.nn.DataParallel``'s signature; only ``0`` is supported, because inputs are split
            and outputs gathered along the batch dimension by a contract that knows rows (see
            ``lightning_mgpu.engine.scatter``).
        sync_batchnorm: BatchNorm layers that normalise by batch statistics use the statistics of the whole batch,
            exchanged between the replicas, so they compute what one device computes (see
            ``lightning_mgpu.replica_state.batchnorm``); ``False`` normalises each chunk by its own statistics, as
            ``torch.nn.DataParallel`` does.
        device_ids: ``torch.nn.DataParallel``'s name for ``devices``, so code written for it runs unchanged; pass
            one of the two.
        chunk_weights: one relative share per device, so that a device can take fewer rows of every batch than
            the others (the root device, which also holds the gathered outputs, say): ``[1, 2, 2, 2]`` gives the
            root a seventh of each batch and the others two sevenths each. Rows are assigned by largest-remainder
            rounding (see ``lightning_mgpu.engine.scatter.weighted_chunk_sizes``), in contiguous chunks in batch
            order; a device whose share of a batch rounds to no rows runs no replica for it, as happens to the
            last devices when an even split meets a batch with fewer rows than devices. ``None`` (the default)
            splits evenly.

    """

    def __init__(
        self,
        module: nn.Module,
        devices: Sequence[DeviceLike] | None = None,
        output_device: DeviceLike | None = None,
        dim: int = 0,
        *,
        sync_batchnorm: bool = True,
        device_ids: Sequence[DeviceLike] | None = None,
        chunk_weights: Sequence[float] | None = None,
    ) -> None:
        super().__init__()
        if dim != 0:
            raise ConfigurationError(
                f"MGPUDataParallel splits inputs and gathers outputs along dim 0 only, but got dim={dim}. Make the"
                " batch the first dimension of the module's inputs and outputs (batch_first=True for RNNs and"
                f" transformer layers, or x.movedim({dim}, 0) around the module's own code), then drop dim=.",
                setting="MGPUDataParallel.dim",
            )
        self.module = module
        self.devices = _resolve_devices(devices, device_ids)
        self.output_device = self.root_device if output_device is None else _output_device(output_device)
        if len(self.devices) == 1:
            module.to(self.root_device)
        self._apply_in_threads = ParallelApply(len(self.devices))
        self._replicate = ReplicaCache()
        self.sync_batchnorm = sync_batchnorm
        self._batch_statistics = _BatchStatistics()
        if sync_batchnorm and len(self.devices) > 1:
            check_exchangeable(module, type(self).__name__)
        self._input_layouts: dict[str, LayoutMemory] = {}
        self._output_layouts: dict[str, LayoutMemory] = {}
        self.collated_methods: set[str] = set()
        """Methods whose batches torch's ``default_collate`` built, their lists read so; ``mgpu_dp`` keeps it."""
        self._chunk_weights: tuple[float, ...] | None = None
        self.chunk_weights = chunk_weights

    @property
    def chunk_weights(self) -> tuple[float, ...] | None:
        """Each device's relative share of every batch, or ``None`` for an even split; checked when set."""
        return self._chunk_weights

    @chunk_weights.setter
    def chunk_weights(self, weights: Sequence[float] | None) -> None:
        if weights is None:
            self._chunk_weights = None
            return
        checked = check_chunk_weights(weights, "chunk_weights")
        check_chunk_weight_count(checked, self.devices, "chunk_weights", "MGPUDataParallel")
        self._chunk_weights = checked

    @property
    def root_device(self) -> torch.device:
        """The device that batches are split from and replica 0 runs on."""
        return self.devices[0]

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run ``module(*inputs, **kwargs)`` on every replica's rows and gather the outputs on ``output_device``.

        The positional and keyword inputs are split as one batch (see ``lightning_mgpu.engine.scatter``), so every
        tensor among them, however deep, must have the batch's row count. As in ``torch.nn.DataParallel``, a call
        without inputs runs the module once, on the root device, and with a single device the module is called
        directly on the inputs moved to it, its output returned as it is.
        """
        if len(self.devices) == 1:
            return self._forward_on_root(inputs, kwargs)
        scattered = self.scatter(inputs, kwargs)
        replicas = self.replicate(self._modules["module"], scattered.devices)  # type: ignore[arg-type]
        outputs = self.parallel_apply(replicas, scattered.calls, scattered.devices)
        sizes = scattered.sizes if inputs or kwargs else None
        self.settle(sizes, "forward")
        return self.gather(outputs, sizes, "forward")

    def scatter(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Scattered:
        """Split ``forward``'s positional and keyword inputs as one batch (see ``lightning_mgpu.engine.scatter``).

        A call without inputs runs once, on the root device, as in ``torch.nn.DataParallel``. A plain list among
        the inputs that reads both ways is fields, as ``torch.nn.DataParallel`` reads it.
        """
        if not inputs and not kwargs:
            return Scattered([((), {})], [0], self.devices[:1])
        memory = _layouts(self._input_layouts, "forward")
        return Scattered(*scatter_inputs(inputs, kwargs, self.devices, self._chunk_weights, memory=memory))

    def scatter_batch(
        self, batch: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None, method: str = "forward"
    ) -> Scattered:
        """Split ``batch`` alone, for a method called as ``method(chunk, *args, **kwargs)`` on every replica.

        Only the batch is split; ``args`` and ``kwargs`` reach every replica whole. A plain list in the batch whose
        items read both ways (fields, or one item per sample) is read as ``method``'s earlier batches read it;
        where ``method`` is in ``collated_methods`` every list is read as torch's ``default_collate`` builds it.
        """
        memory = _layouts(self._input_layouts, method)
        source = Source.DEFAULT_COLLATE if method in self.collated_methods else None
        chunks, sizes, devices = scatter_to_devices(
            batch, self.devices, self._chunk_weights, memory=memory, source=source
        )
        shared = kwargs or {}
        return Scattered([((chunk, *args), shared) for chunk in chunks], sizes, devices)

    def replicate(self, module: nn.Module, devices: Sequence[torch.device]) -> list[nn.Module]:
        """One replica of ``module`` per device (see ``lightning_mgpu.engine.replicate``), kept between calls.

        Replica 0 works on the module's own tensors, so the module must be on the root device, as torch requires;
        replicating looks at every tensor's device anyway, and raises a ``ConfigurationError`` when one is not.
        """
        return self._replicate(module, devices, self._check_module_device)

    def parallel_apply(
        self,
        replicas: Sequence[nn.Module],
        calls: Sequence[Call],
        devices: Sequence[torch.device],
        method: str | None = None,
        context: ContextFactory | None = None,
    ) -> list[Any]:
        """Make call ``i`` on replica ``i`` in its own thread, on device ``i``, and return the outputs in order.

        ``method=None`` calls the replica itself, so its forward hooks run once per replica, as in
        ``torch.nn.DataParallel``; otherwise ``replica.<method>`` is called. ``context`` is entered in each replica
        thread around the call, as ``context()``. BatchNorm layers exchange their batch statistics here (see
        ``sync_batchnorm``). ``settle`` then puts back into the module what the replicas changed.
        """
        replicas = list(replicas)
        devices = list(devices)
        exchange = self._batch_statistics_exchange(method, replicas)
        guards = self._replicate.begin(method)
        bound = [
            _bind(
                replica if method is None else getattr(replica, method),
                args,
                kwargs,
                exchange,
                index,
                replica,
                None if guards is None else guards[index],
            )
            for index, (replica, (args, kwargs)) in enumerate(zip(replicas, calls, strict=True))
        ]
        outputs = self._apply_in_threads(bound, devices, context)
        self._replicate.settle_process(method)
        if exchange is not None:
            self._batch_statistics.record(method, exchange)
        return outputs

    def settle(self, sizes: Sequence[int] | None, method: str = "forward") -> None:
        """Put back into the module what the replicas of the last ``parallel_apply`` changed, in batch order.

        Each replica ran with copies of its own of the module's torchmetrics metrics and of the plain lists, dicts
        and sets of the model's own code (see ``lightning_mgpu.engine.replicate``): the metrics merge their copies'
        states, lists gain what every replica appended (one gathered item per append) and sets what they added;
        other changes raise ``lightning_mgpu.ReplicaStateError``. Buffers every replica changed alike are changed
        once, and other changes of them refused (``lightning_mgpu.replica_state.buffers``); BatchNorm layers keep
        replica 0's running statistics where ``sync_batchnorm`` is off, as in ``torch.nn.DataParallel``.

        Args:
            sizes: the rows each replica received (``Scattered.sizes``); without them no append can be joined.
            method: the method the replicas ran, named in errors.
        """
        self._replicate.settle(sizes, self.output_device, method, per_replica_batchnorm=not self.sync_batchnorm)
        devices = self._replicate.devices
        if devices and devices[0] != self.root_device:
            self._return_buffers_to_root()

    def resolve_logged(self, value: Any, replica: int) -> tuple[nn.Module | None, Any] | None:
        """What ``value``, logged by ``replica`` in the last call, is on one device, if a torchmetrics metric made it.

        Returns ``(metric, None)`` for a replica's copy of one of the module's metrics (the module's own metric),
        ``(None, value)`` for a tensor that calling a metric returned (one device's value of that call), and
        ``None`` for anything else.
        """
        return self._replicate.resolve(value, replica)

    def _forward_on_root(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        module = self._modules["module"]
        root = self.devices[0]
        if not all_on(modules_of(module), root):  # type: ignore[arg-type]
            self._check_module_device()
        if kwargs or not _tensors_on(inputs, root):
            inputs, kwargs = move_to((inputs, kwargs), root)
        return module(*inputs, **kwargs)  # type: ignore[misc]

    def gather(self, outputs: Sequence[Any], sizes: Sequence[int] | None = None, method: str = "forward") -> Any:
        """Gather one output per replica on ``output_device`` (see ``lightning_mgpu.engine.gather``).

        Args:
            outputs: one output per replica, in batch order, as ``parallel_apply`` returned them.
            sizes: the rows each replica received (``Scattered.sizes``), so that lists with one item per row
                are concatenated; without them only ``PerSample`` lists are.
            method: the method that returned ``outputs``; each method's outputs keep their own memory of how their
                lists were gathered in earlier steps.
        """
        return gather(outputs, self.output_device, sizes, memory=_layouts(self._output_layouts, method))

    def run(
        self,
        method: str,
        batch: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        context: ContextFactory | None = None,
    ) -> ReplicaOutputs:
        """Call ``replica.<method>(chunk, *args, **kwargs)`` on every replica in parallel: the four phases in one.

        ``scatter_batch`` splits ``batch`` alone, ``replicate`` and ``parallel_apply`` run the method (``context``
        entered in each replica thread), ``settle`` puts back what the replicas changed, and the outputs come back
        ungathered, with the rows each replica received.
        """
        scattered = self.scatter_batch(batch, args, kwargs, method)
        replicas = self.replicate(self._modules["module"], scattered.devices)  # type: ignore[arg-type]
        outputs = self.parallel_apply(replicas, scattered.calls, scattered.devices, method, context)
        self.settle(scattered.sizes, method)
        return ReplicaOutputs(outputs, scattered.sizes, replicas)

    def _return_buffers_to_root(self) -> None:
        """Move back to the root device the buffers that replica 0 kept while it ran elsewhere.

        When the weights leave the root device no rows, replica 0 runs on another device with copies of the
        module's buffers, and the module keeps those copies (BatchNorm running statistics updated from the whole
        batch, say); they belong on the root device, with the parameters.
        """
        root = self.root_device
        for submodule in modules_of(self._modules["module"]):  # type: ignore[arg-type]
            buffers = submodule._buffers
            for name, buffer in buffers.items():
                if buffer is not None and not _same_device(buffer.device, root):
                    buffers[name] = buffer.to(root)

    def _check_module_device(self) -> None:
        """Replica 0 works on the module's own tensors, so they must be on the root device, as torch requires."""
        root = self.root_device
        if all(_same_device(tensor.device, root) for tensor in chain(self.module.parameters(), self.module.buffers())):
            return
        for kind, named in (("parameter", self.module.named_parameters()), ("buffer", self.module.named_buffers())):
            for name, tensor in named:
                if not _same_device(tensor.device, root):
                    raise ConfigurationError(
                        f"MGPUDataParallel needs the module on its first device, {root}, but {kind} {name!r} is on"
                        f" {tensor.device}. Move the module there before calling the wrapper:"
                        f" module.to({str(root)!r}).",
                        setting="MGPUDataParallel.module",
                    )

    def _batch_statistics_exchange(self, method: str | None, replicas: list[nn.Module]) -> _Exchange | None:
        """The exchange of batch statistics for this call, or ``None`` where no batch-norm call needs one."""
        if not self.sync_batchnorm or len(replicas) < 2:
            return None
        module: nn.Module = self._modules["module"]  # type: ignore[assignment]
        if not self._batch_statistics.needed(self._replicate.structure, method, module):
            return None
        return _Exchange(ReplicaRendezvous(len(replicas)), len(replicas))

    def close(self) -> None:
        """Stop the replica threads."""
        self._apply_in_threads.close()

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            modules = self.__dict__.get("_modules", {})
            if "module" not in modules:
                raise
            return getattr(modules["module"], name)


def _resolve_devices(
    devices: Sequence[DeviceLike] | None, device_ids: Sequence[DeviceLike] | None
) -> list[torch.device]:
    if devices is not None and device_ids is not None:
        raise ConfigurationError(
            "MGPUDataParallel got both devices= and device_ids=, which are one argument (device_ids is"
            " torch.nn.DataParallel's name for it); pass only one.",
            setting="MGPUDataParallel.device_ids",
        )
    chosen = devices if devices is not None else device_ids
    if chosen is None:
        count = torch.cuda.device_count()
        return [torch.device("cuda", index) for index in range(count)] if count else [torch.device("cpu")]
    if not chosen:
        raise ConfigurationError(
            "MGPUDataParallel needs at least one device; pass devices=[torch.device('cpu')].",
            setting="MGPUDataParallel.devices",
        )
    return [_device(entry, chosen) for entry in chosen]


def _device(entry: DeviceLike, devices: Sequence[DeviceLike]) -> torch.device:
    if not isinstance(entry, int):
        return torch.device(entry)
    try:
        return torch.device(entry)
    except RuntimeError as error:  # no accelerator to index into
        raise ConfigurationError(
            f"MGPUDataParallel got devices {list(devices)!r}, and {entry!r} names an accelerator device by index, but"
            f" torch sees no accelerator ({error}). To run virtual replicas on the CPU, pass"
            f" devices=[torch.device('cpu')] * {len(devices)}.",
            setting="MGPUDataParallel.devices",
        ) from error


def _output_device(output_device: DeviceLike) -> torch.device:
    if isinstance(output_device, int) and output_device == -1:
        return torch.device("cpu")
    return _device(output_device, [output_device])


def _tensors_on(values: tuple[Any, ...], device: torch.device) -> bool:
    """Whether every value is a plain tensor on ``device`` exactly, so a call on one device can skip ``move_to``."""
    cpu = device.type == "cpu"
    for value in values:
        if type(value) is not torch.Tensor or (not value.is_cpu if cpu else value.device != device):
            return False
    return True


def _same_device(actual: torch.device, expected: torch.device) -> bool:
    """``cuda`` without an index names the current CUDA device, which is the one tensors created there carry."""
    if actual.type != expected.type:
        return False
    return actual.index is None or expected.index is None or actual.index == expected.index


def _layouts(memories: dict[str, LayoutMemory], method: str) -> LayoutMemory:
    memory = memories.get(method)
    if memory is None:
        memory = memories[method] = LayoutMemory()
    return memory


class _Exchange:
    """The rendezvous of one call's replicas, and how many batch-norm calls each made through it."""

    def __init__(self, rendezvous: ReplicaRendezvous, replicas: int) -> None:
        self.rendezvous = rendezvous
        self.calls = [0] * replicas


class _BatchStatistics:
    """Decides, per call, whether the replicas need the exchange of batch statistics.

    A model with a BatchNorm layer always gets it. Without one, batch-norm calls can only come from a module's own
    code (``F.batch_norm`` in training mode), so the first call of each method on a structure runs with the exchange
    to find out; later calls get it when any call did normalise, and skip the cost of watching every torch function
    when none did.
    """

    def __init__(self) -> None:
        self._structure: object = None
        self._layers = False
        self._seen: set[str | None] = set()
        self._normalised = False

    def needed(self, structure: object, method: str | None, module: nn.Module) -> bool:
        """Whether the replicas of ``module``'s ``method`` call on ``structure`` run with the exchange."""
        if structure is not self._structure:
            self._structure = structure
            self._layers = bool(batchnorm_layers(module))
            self._seen = set()
            self._normalised = False
        return self._layers or self._normalised or method not in self._seen

    def record(self, method: str | None, exchange: _Exchange) -> None:
        """What one call with the exchange showed: whether ``method`` made batch-norm calls."""
        self._seen.add(method)
        self._normalised = self._normalised or any(exchange.calls)


def _bind(
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    exchange: _Exchange | None,
    index: int,
    replica: nn.Module,
    guard: ReplicaGuard | None,
) -> Callable[[], Any]:
    def call() -> Any:
        return function(*args, **kwargs)

    if guard is not None:
        # The guard is the innermost mode, the top of the stack: a torch function it passes on reaches the BatchNorm
        # exchange with the guard set aside, so the exchange's own calls into torch do not go through it again.
        call = _guarded(call, guard)
    if exchange is None:
        return call

    rendezvous = exchange.rendezvous

    def call_with_whole_batch_statistics() -> Any:
        mode = WholeBatchNorm(rendezvous, index, replica)
        try:
            with mode:
                result = call()
        except BaseException as error:
            rendezvous.abort(error)
            raise
        finally:
            exchange.calls[index] = mode.calls
        rendezvous.finish(index)
        return result

    return call_with_whole_batch_statistics


def _guarded(call: Callable[[], Any], guard: ReplicaGuard) -> Callable[[], Any]:
    def call_in_guard() -> Any:
        with guard:
            return call()

    return call_in_guard
