"""Scatter, replicate, parallel apply, gather: one data-parallel call of a module method."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from lightning_mgpu.engine.batchnorm import ReplicaRendezvous, batchnorm_paths, synchronise
from lightning_mgpu.engine.gather import gather
from lightning_mgpu.engine.parallel_apply import ContextFactory, ParallelApply
from lightning_mgpu.engine.replicate import ReplicaCache, keep_reassigned_buffers
from lightning_mgpu.engine.scatter import LayoutMemory, scatter
from lightning_mgpu.errors import ConfigurationError

PHASES = ("scatter", "replicate", "parallel_apply", "gather")
"""The engine's phases, timed in ``DataParallel.phase_seconds`` (seconds summed over calls)."""

PrepareReplica = Callable[[nn.Module, int, int, torch.device], None]


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


class DataParallel(nn.Module):
    """Single-process data parallelism over any devices, the CPU and repeated devices included.

    ``torch.nn.DataParallel`` needs distinct CUDA devices; this wrapper runs the same algorithm with replicas whose
    parameters alias the originals where a device repeats, so a model can be checked for data-parallel problems on
    a laptop. Attribute access falls through to the wrapped module; calling the wrapper runs ``forward`` in
    parallel.

    Args:
        module: the module to replicate; it must live on ``devices[0]``.
        devices: one entry per replica; the first is the root device that outputs are gathered on.
        sync_batchnorm: BatchNorm layers that normalise by batch statistics use the statistics of the whole batch,
            exchanged between the replicas, so they compute what one device computes (see
            ``lightning_mgpu.engine.batchnorm``); ``False`` normalises each chunk by its own statistics, as
            ``torch.nn.DataParallel`` does.
    """

    def __init__(self, module: nn.Module, devices: Sequence[torch.device], sync_batchnorm: bool = True) -> None:
        super().__init__()
        if not devices:
            raise ConfigurationError("DataParallel needs at least one device; pass devices=[torch.device('cpu')].")
        self.module = module
        self.devices = [torch.device(device) for device in devices]
        self._apply_in_threads = ParallelApply(len(self.devices))
        self._replicate = ReplicaCache()
        self.sync_batchnorm = sync_batchnorm
        self._batchnorms: tuple[object, list[tuple[int, str]]] = (None, [])
        self.phase_seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self._batch_layouts: dict[str, LayoutMemory] = {}
        self._output_layouts: dict[str, LayoutMemory] = {}

    @property
    def root_device(self) -> torch.device:
        """The device that batches arrive on and outputs are gathered on."""
        return self.devices[0]

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Split the first input along dim 0, run ``module.forward`` per chunk, gather the outputs."""
        return self.gather(self.run("forward", inputs[0], inputs[1:], kwargs).outputs)

    def gather(self, outputs: Sequence[Any], sizes: Sequence[int] | None = None, method: str = "forward") -> Any:
        """Gather one output per replica on the root device (see ``lightning_mgpu.engine.gather``).

        Args:
            outputs: one output per replica, in batch order, as ``run`` returned them.
            sizes: the rows each replica received (``ReplicaOutputs.sizes``), so that lists with one item per row
                are concatenated; without them only ``PerSample`` lists are.
            method: the method that returned ``outputs``; each method's outputs keep their own memory of how their
                lists were gathered in earlier steps.
        """
        started = time.perf_counter()
        gathered = gather(outputs, self.root_device, sizes, memory=_layouts(self._output_layouts, method))
        self.phase_seconds["gather"] += time.perf_counter() - started
        return gathered

    def run(
        self,
        method: str,
        batch: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        context: ContextFactory | None = None,
        prepare_replica: PrepareReplica | None = None,
    ) -> ReplicaOutputs:
        """Call ``replica.<method>(chunk, *args, **kwargs)`` on every replica in parallel.

        Args:
            method: the name of the module method to call (``"forward"``, ``"training_step"``, ...).
            batch: split along dim 0, one chunk per replica; only it is split, ``args`` and ``kwargs`` reach every
                replica whole.
            args: further positional arguments, given to every replica.
            kwargs: keyword arguments, given to every replica.
            context: entered in each replica thread around the call, as ``context(index, device)``.
            prepare_replica: called as ``prepare_replica(replica, index, num_replicas, device)`` before the call,
                in the calling thread.

        Buffers that replica 0 reassigned are stored on the module afterwards, as its in-place updates are. A list
        in the batch that could be read as one item per sample or as fields is read as it was in earlier batches of
        the same method (see ``lightning_mgpu.engine.scatter``).
        """
        started = time.perf_counter()
        chunks, sizes = scatter(batch, self.devices, _layouts(self._batch_layouts, method))
        devices = self.devices[: len(chunks)]
        scattered = time.perf_counter()
        replicas = self._replicate(self.module, devices)
        if prepare_replica is not None:
            for index, (replica, device) in enumerate(zip(replicas, devices, strict=True)):
                prepare_replica(replica, index, len(replicas), device)
        rendezvous = self._synchronise_batchnorms(replicas)
        extra_kwargs = kwargs or {}
        calls = [
            _bind(getattr(replica, method), chunk, args, extra_kwargs, index, rendezvous)
            for index, (replica, chunk) in enumerate(zip(replicas, chunks, strict=True))
        ]
        replicated = time.perf_counter()
        outputs = self._apply_in_threads(calls, devices, context)
        keep_reassigned_buffers(self.module, replicas[0])
        applied = time.perf_counter()
        self.phase_seconds["scatter"] += scattered - started
        self.phase_seconds["replicate"] += replicated - scattered
        self.phase_seconds["parallel_apply"] += applied - replicated
        return ReplicaOutputs(outputs, sizes, replicas)

    def _synchronise_batchnorms(self, replicas: list[nn.Module]) -> ReplicaRendezvous | None:
        if not self.sync_batchnorm or len(replicas) < 2:
            return None
        structure = self._replicate.structure
        if self._batchnorms[0] is not structure:
            self._batchnorms = (structure, batchnorm_paths(self.module))
        layers = self._batchnorms[1]
        if not layers:
            return None
        rendezvous = ReplicaRendezvous(len(replicas))
        synchronise(replicas, layers, rendezvous)
        return rendezvous

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


def _layouts(memories: dict[str, LayoutMemory], method: str) -> LayoutMemory:
    memory = memories.get(method)
    if memory is None:
        memory = memories[method] = LayoutMemory()
    return memory


def _bind(
    function: Callable[..., Any],
    chunk: Any,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    index: int,
    rendezvous: ReplicaRendezvous | None,
) -> Callable[[], Any]:
    if rendezvous is None:

        def call() -> Any:
            return function(chunk, *args, **kwargs)

        return call

    def call_in_rendezvous() -> Any:
        try:
            result = function(chunk, *args, **kwargs)
        except BaseException as error:
            rendezvous.abort(error)
            raise
        rendezvous.finish(index)
        return result

    return call_in_rendezvous
