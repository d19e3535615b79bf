"""The torch function mode each replica's call runs in, and what the calling thread does before and after the call.

Replicas are threads of one process: what torch keeps per process (the default generator, the storage of the
module's parameters on a shared device) is reached by all of them. ``ReplicaGuard`` sees every torch function a
replica calls and routes the two that would make a result depend on thread timing: writes to a parameter go to a
copy of the replica's own (``parameters``), random numbers come from a generator of the replica's own (``random``).
``ReplicaStates`` makes one guard per replica before a call and, after it, gives the module one device's result or
refuses it.
"""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_mgpu.replica_state import parameters
from lightning_mgpu.replica_state.parameters import ParameterWrites, written_tensors
from lightning_mgpu.replica_state.process import ProcessSettings
from lightning_mgpu.replica_state.random import DefaultGenerator, ReplicaRandom, StepSeed, draws

_DATA = torch.Tensor.data
_dynamo_compiling = torch.compiler.is_dynamo_compiling
"""True while torch.compile traces, False otherwise at the cost of one call (``is_compiling`` costs several)."""
_DETACH = torch.Tensor.detach


class ReplicaGuard(TorchFunctionMode):
    """One replica's torch function mode for one call: parameter writes and random draws made the replica's own."""

    def __init__(self, writes: ParameterWrites, random: ReplicaRandom, step: str) -> None:
        super().__init__()
        self.writes = writes
        self.random = random
        self.step = step

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if _dynamo_compiling():
            # Traced by torch.compile: the cache shared by every replica would become a guard of the compiled graph
            # that another replica's thread invalidates as it fills the cache (a recompile, or a failed guard); and
            # the bookkeeping of a write or a draw, which reads the replica's own tensors by identity, runs outside the
            # graph (a graph break at the write), as it would make the graph guard on them, and they change each call.
            kind = _kind(func)
            if kind == _PLAIN and "out" not in kwargs:
                return func(*args, **kwargs)
            return _route_untraced(self, kind, func, args, kwargs)
        cached = _KINDS.get(func)
        if cached is None:
            cached = _KINDS[func] = _kind(func)
        if cached == _PLAIN and "out" not in kwargs:
            return func(*args, **kwargs)
        return self.route(cached, func, args, kwargs)

    def route(self, kind: int, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A view, a write or a draw: the replica's own tensors and generator take the place of the shared ones."""
        if kind == _VIEW:
            result = func(*args, **kwargs)
            if func.__name__ == "__set__":
                self.writes.assigned(args[0])
            else:
                self.writes.viewed(args[0], result)
            return result
        written = written_tensors(func, args, kwargs)
        if written:
            self.writes.before_write(written, getattr(func, "__name__", str(func)), self.step)
        if kind == _DRAW:
            return self.random.call(func, args, kwargs)
        return func(*args, **kwargs)


_route_untraced = torch.compiler.disable(ReplicaGuard.route)


_PLAIN, _VIEW, _WRITE, _DRAW = 0, 1, 2, 3
_KINDS: dict[Any, int] = {}
"""Each torch function seen in a replica, by what the guard does with it: nothing, a view of a tensor, a possible
write (``out=`` makes any function one), a draw of random numbers (which may write too, ``bernoulli_``)."""


def _kind(func: Any) -> int:
    if func is _DETACH or getattr(func, "__self__", None) is _DATA:
        return _VIEW
    if draws(func):
        return _DRAW
    name = getattr(func, "__name__", "")
    if name.endswith("_") or name == "__setitem__":
        return _WRITE
    return _PLAIN


class ReplicaStates:
    """What the replicas of each call reach in common, made each one's own for the call and settled after it."""

    def __init__(self) -> None:
        self._default = DefaultGenerator()
        self._generators: list[dict[torch.device, torch.Generator]] = []
        self._writes: list[ParameterWrites] = []
        self._seed: StepSeed | None = None
        self._process: ProcessSettings | None = None

    def begin(
        self, aliases: Sequence[dict[int, torch.Tensor]], step: str, own_buffers: Sequence[AbstractSet[int]] = ()
    ) -> list[ReplicaGuard]:
        """One guard per replica of a call about to run.

        ``aliases[i]`` maps each parameter's ``id`` to replica i's; ``own_buffers[i]``, where given, holds the
        ``id`` of each buffer copy of replica i's own (``lightning_mgpu.replica_state.buffers.BufferStarts``).
        """
        while len(self._generators) < len(aliases):
            self._generators.append({})
        seed = self._seed = self._default.begin()
        self._process = ProcessSettings()
        buffers = list(own_buffers) or [frozenset()] * len(aliases)
        self._writes = [ParameterWrites(own, ids) for own, ids in zip(aliases, buffers, strict=True)]
        return [
            ReplicaGuard(writes, ReplicaRandom(index, seed, self._generators[index]), step)
            for index, writes in enumerate(self._writes)
        ]

    def settle_process(self, step: str) -> None:
        """After the call, first: process-wide settings the replicas changed are put back, and the call refused."""
        process, self._process = self._process, None
        if process is not None:
            process.settle(step)

    def settle(self, module: nn.Module, step: str) -> None:
        """After the call: parameters the replicas changed alike are changed once, or the call is refused."""
        writes, self._writes = self._writes, []
        seed, self._seed = self._seed, None
        if any(replica.changed for replica in writes):
            named = dict(module.named_parameters())
            parameters.settle(
                writes,
                {id(parameter): parameter for parameter in named.values()},
                {id(parameter): name for name, parameter in named.items()},
                step,
            )
        if seed is not None:
            self._default.settle(seed)
