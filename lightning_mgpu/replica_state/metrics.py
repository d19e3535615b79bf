"""torchmetrics inside replicas: each replica's calls are recorded, and the module's metric takes them once, whole.

A ``Metric`` binds ``update`` and ``compute`` to the object it was built as, so a replica made the way torch makes
one would update the module's own metric from every replica thread at once: updates lost, list states in thread order.
Here every metric and ``MetricCollection`` of the module (a *unit*: the outermost one, with whatever it holds) gets one
deep copy per replica, made once per module structure, which the replica's code reaches. A copy's ``update`` records
its arguments and updates nothing; calling a copy computes that replica's rows' value (as a DDP rank's call returns
its shard's) and records the arguments too. After the step, the arguments of every replica's matching call are joined
in batch order (tensors and lists with one entry per row of the replica's chunk concatenated, values every replica
passed alike kept) and the module's own metric is updated, or called, once with them: what one device does, for any
metric whatever its flags, at one update's cost. The value of a call, logged, is that whole call's value.

A call with an argument that is not one entry per row (a 0-dim value, a count of the replica's rows) is one replica's
contribution, as a DDP rank's is: each copy takes its replica's calls and the copies' states go into the module's
metric through torchmetrics' own ``merge_state``, the way torchmetrics combines ranks. A metric that ``merge_state``
refuses (``full_state_update=True``, ``dist_sync_on_step=True``, a merge of its own that raises), given such an
argument, and ``compute()`` or ``reset()`` called on a replica's copy from the step's code raise ``ReplicaStateError``
naming the metric and the fix.
"""

from __future__ import annotations

import copy
import functools
import itertools
import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn
from torchmetrics import CatMetric, Metric, MetricCollection

from lightning_mgpu._compat import (
    caller_module,
    forget_computed,
    set_forward_value,
    set_update_count,
    version_counter,
)
from lightning_mgpu.engine.scatter import is_namedtuple
from lightning_mgpu.errors import ReplicaStateError

_UNITS = (Metric, MetricCollection)
_MERGE_FIX = (
    "update and call it in the matching *_step_end hook instead, on the outputs gathered from every replica, where"
    " it is the module's own metric"
)


def metric_units(modules: Sequence[nn.Module]) -> list[nn.Module]:
    """The metrics and ``MetricCollection`` s among ``modules`` that no other one among them holds, in their order."""
    candidates = [module for module in modules if isinstance(module, _UNITS)]
    if not candidates:
        return []
    held = {id(inner) for unit in candidates for inner in _subtree(unit)[1:]}
    return [unit for unit in candidates if id(unit) not in held]


def _subtree(module: nn.Module) -> list[Any]:
    """``list(module.modules())``: the module first, then what it holds, each once (metrics read as ``Any``)."""
    return list(module.modules())


class MetricReplicas:
    """The metric units of one module structure, each with one copy per device and a scratch copy.

    Args:
        units: from ``metric_units``.
        devices: one per replica; copies live on their replica's device.
        names: the attribute path of each unit's root in the module, for messages (``"val_acc"``).
    """

    def __init__(self, units: Sequence[nn.Module], devices: Sequence[torch.device], names: Sequence[str]) -> None:
        self.units = [_Unit(unit, devices, name) for unit, name in zip(units, names, strict=True)]

    def copies_of(self, index: int) -> dict[int, nn.Module]:
        """Each original module of every unit, by ``id``, mapped to its counterpart in replica ``index``'s copy."""
        mapping: dict[int, nn.Module] = {}
        for unit in self.units:
            mapping.update(zip(map(id, unit.nodes), unit.copies[index].nodes, strict=True))
        return mapping

    def start(self) -> None:
        """Put every copy back to its default state, for the next call."""
        for unit in self.units:
            for replica in unit.copies:
                replica.start("forward")

    def name(self, method: str | None) -> None:
        """Name the call the copies are about to take part in (``None``: forward), for messages."""
        for unit in self.units:
            for replica in unit.copies:
                replica.method = method or "forward"

    def settle(self, sizes: Sequence[int] | None) -> None:
        """Give the module's metrics the calls the replicas' copies recorded, as one device's calls on the whole batch.

        Args:
            sizes: the rows each replica received, in batch order; ``None`` for a call without inputs, which ran
                on one replica.
        """
        rows = list(sizes) if sizes is not None else [0]
        plans = [unit.plan(rows) for unit in self.units]  # a refusal comes before any metric of the module changes
        for _, merge in plans:
            if merge is not None:
                merge()
        # The module's metrics take the calls in the order the step made them, whatever their metric: metrics that
        # draw random numbers (BootStrapper) draw them in one device's order.
        for take in sorted((take for takes, _ in plans for take in takes), key=operator.attrgetter("order")):
            take.unit.take(take.number, take.call)

    def resolve(self, value: Any, replica: int) -> tuple[Metric | None, Any] | None:
        """What ``value``, logged by ``replica`` in the last call, stands for on one device, if it is a metric's.

        Returns ``(metric, None)`` for one of the replica's copies of a metric (the module's own ``metric``, whose
        ``_forward_cache`` is then one device's value of its last call), ``(None, value)`` for a tensor that a
        metric call returned (one device's value of that call), and ``None`` for anything else.
        """
        for unit in self.units:
            found = unit.resolve(value, replica)
            if found is not None:
                return found
        return None


class _Copy:
    """One replica's copy of a unit, and the calls of its metrics it recorded in the current step."""

    def __init__(self, unit: _Unit, device: torch.device, index: int) -> None:
        root = _deep_copy(unit.root)
        if unit.device != device:
            root.to(device)
        self.unit = unit
        self.index = index
        self.nodes = _subtree(root)
        if len(self.nodes) != len(unit.nodes):
            raise RuntimeError(f"the copy of {unit.name} has another structure than the metric itself")
        self.method = "forward"
        self.internal = False
        self.dirty = True  # a deep copy holds the metric's states: the first start resets them
        self.calls: list[_Call] = []
        self._open: _Call | None = None
        self._counts: dict[int, int] = {}
        self._marks: dict[int, list[tuple[int, int]]] = {}
        self.positions = {id(node): position for position, node in enumerate(self.nodes)}
        for position, node in enumerate(self.nodes):
            if isinstance(node, _UNITS):
                node.__dict__["compute"] = _Guard(self, position, "compute", node.compute)
                if "reset" not in vars(unit.nodes[position]):  # a reset of the user's own (a mock) stays theirs
                    node.__dict__["reset"] = _Guard(self, position, "reset", node.reset)
                node.__dict__["update"] = _Recorded(self, position, node.update)
                node.register_forward_pre_hook(self._open_call, with_kwargs=True)
                node.register_forward_hook(self._close_call)

    def start(self, method: str) -> None:
        """Back to the default state, for a call of ``method``; a list state gets a new list, never cleared in place.

        A merged metric may hold the very list a copy gathered; clearing the copy's own would empty it there too. A
        copy whose metrics ran nothing since the last start is left as it is.
        """
        self.method = method
        self.calls = []
        self._open = None
        if not self.dirty:
            return
        self.internal = True
        try:
            # Every list first: a wrapper's reset resets the metrics it holds (MultitaskWrapper), which may come later.
            for position in self.unit.metrics:
                node = self.nodes[position]
                for name, value in node.metric_state.items():
                    if isinstance(value, list):
                        setattr(node, name, [])
            for position in self.unit.metrics:
                self.nodes[position].reset()
        finally:
            self.internal = False
        self.dirty = False
        # A wrapper's reset may leave its own count alone (ClasswiseWrapper resets only its metric): count from here.
        self._counts = {position: self.nodes[position].update_count for position in self.unit.metrics}
        self._marks = {position: _marks(self.nodes[position]) for position in self.unit.stateful}

    @property
    def calling(self) -> bool:
        """Whether one of the copy's metrics is being called (its forward runs), or the package runs it."""
        return self._open is not None or self.internal

    def record(self, position: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Keep an ``update`` of metric ``position`` the step's code made, for the module's metric after the step."""
        self.calls.append(_recorded(position, "update", args, kwargs))

    def take_calls(self) -> None:
        """Run every recorded call on this copy, in order, from its default state: its replica's part of the step."""
        calls = self.calls
        self.dirty = True
        self.start(self.method)
        self.calls = calls
        self.internal = True
        self.dirty = True
        try:
            for call in calls:
                node = self.nodes[call.owner]
                if call.kind == "update":
                    node.update(*call.args, **call.kwargs)
                else:
                    node(*call.args, **call.kwargs)  # a metric's forward may leave other states than an update
        finally:
            self.internal = False

    def updated(self, position: int) -> int:
        """How many updates metric ``position`` of this copy counted since it was last reset."""
        return int(self.nodes[position].update_count) - self._counts[position]

    def changed(self, position: int) -> bool:
        """Whether metric ``position`` of this copy counted an update or changed a state since it was last reset.

        A wrapper may change its states without counting (``Running`` keeps its window so), or count nothing while
        its metrics do; either way it took part in the call.
        """
        if self.updated(position):
            return True
        marks = self._marks.get(position)
        return marks is not None and marks != _marks(self.nodes[position])

    def snapshot(self, position: int) -> None:
        """Keep node ``position``'s state as the open call computes its value from it (one call's rows only)."""
        call = self._open
        if call is not None and position not in call.states:
            node = self.nodes[position]
            call.states[position] = {name: _kept(value) for name, value in node.metric_state.items()}

    def _open_call(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # A call inside another (a collection's metrics) belongs to the outer one; the package's own calls to none.
        if self._open is None and not self.internal:
            self._open = _recorded(self.positions[id(module)], "forward", args, kwargs)
            self.dirty = True

    def _close_call(self, module: nn.Module, args: Any, output: Any) -> Any:
        call = self._open
        if call is None or self.nodes[call.owner] is not module:
            return None
        leaves = [id(leaf) for _, leaf in _leaves(output)]
        if len(set(leaves)) < len(leaves):
            # One tensor at several keys (MinMaxMetric's first value is its max and min too): each key gets a tensor
            # object of its own, so that a logged value tells which key it was, as it does on one device.
            output = _distinct(output, set())
        call.output = output
        self.calls.append(call)
        self._open = None
        return output


class _Call:
    """A call of one of a copy's metrics (``owner``): its kind, arguments and value, and the states it computed from.

    ``kind`` is ``"update"`` or ``"forward"``; ``states`` holds, for a call, each metric's state as its value was
    computed (its own rows only).
    """

    __slots__ = ("args", "kind", "kwargs", "order", "output", "owner", "states", "versions")

    def __init__(self, owner: int, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any], order: int = 0) -> None:
        self.owner = owner
        self.kind = kind
        self.args = args
        self.kwargs = kwargs
        self.order = order
        """When the call was made, among every metric call of the process: calls are made again in this order."""
        self.output: Any = None
        self.states: dict[int, dict[str, Any]] = {}
        self.versions: list[int] = []
        """Each tensor argument's in-place changes when the call was made."""

    def changed_argument(self) -> str | None:
        """The argument changed in place since the call was made, if one (its values are not the call's any more)."""
        for (where, tensor), version in zip(_tensor_arguments(self.args, self.kwargs), self.versions, strict=True):
            if version_counter(tensor) != version:
                return where
        return None


def _recorded(owner: int, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Call:
    """A call made now, with its place in the order of calls and its tensor arguments' in-place changes so far."""
    call = _Call(owner, kind, args, kwargs, next(_ORDER))
    call.versions = [version_counter(tensor) for _, tensor in _tensor_arguments(args, kwargs)]
    return call


_ORDER = itertools.count()
"""Numbers metric calls in the order they were made: ``next`` on a count is atomic under the interpreter lock."""


def _tensor_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors among a call's arguments, however deep in lists, tuples and mappings, each with where it is."""
    named = [(f"argument {index + 1}", value) for index, value in enumerate(args)]
    named += [(f"{key}=", value) for key, value in kwargs.items()]
    for where, value in named:
        for path, tensor in _leaves(value):
            yield where + "".join(f"[{key!r}]" for key in path), tensor


class _Recorded:
    """A copy's ``update``: called from the step's code it is recorded; inside a call of the metric it updates."""

    def __init__(self, replica: _Copy, position: int, update: Callable[..., Any]) -> None:
        functools.update_wrapper(self, update)
        self.replica = replica
        self.position = position
        self.update = update

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        replica = self.replica
        if replica.calling:
            return self.update(*args, **kwargs)
        replica.record(self.position, args, kwargs)
        return None


class _Guard:
    """A copy's ``compute`` or ``reset``: torchmetrics' own code may call it, the step's code may not."""

    def __init__(self, replica: _Copy, position: int, name: str, call: Callable[..., Any]) -> None:
        functools.update_wrapper(self, call)
        self.replica = replica
        self.position = position
        self.name = name
        self.call = call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        replica = self.replica
        if not replica.calling and not caller_module(1).startswith("torchmetrics"):
            raise _refusal_in_replica(replica, self.position, self.name)
        if self.name == "compute":
            replica.snapshot(self.position)
        return self.call(*args, **kwargs)


class _Unit:
    """A metric or collection of the module, its copies and its scratch copy, and the matching of their nodes."""

    def __init__(self, root: nn.Module, devices: Sequence[torch.device], name: str) -> None:
        self.root = root
        self.name = name
        self.nodes = _subtree(root)
        self.metrics = [position for position, node in enumerate(self.nodes) if isinstance(node, Metric)]
        self.stateful = [position for position in self.metrics if _keeps_state(self.nodes[position])]
        self.within = {  # each unit node's position, with the positions of the metrics it holds
            position: [
                inner
                for inner, node in enumerate(self.nodes)
                if isinstance(node, Metric) and _holds(self.nodes[position], node)
            ]
            for position, node in enumerate(self.nodes)
            if isinstance(node, _UNITS)
        }
        # Calls of a metric whose forward reduces the batch's state into the metric's (no metric in it declares
        # full_state_update or dist_sync_on_step) leave the states one update leaves, so their copies merge as they
        # stand; another's forward may leave others (MinMaxMetric's resets its metric to the batch).
        self.forward_updates = {
            position: all(
                self.nodes[inner].full_state_update is False and not self.nodes[inner].dist_sync_on_step
                for inner in inners
            )
            for position, inners in self.within.items()
        }
        self.device = _device_of(root)
        self.copies = [_Copy(self, device, index) for index, device in enumerate(devices)]
        self.scratch = _Copy(self, self.device, -1)
        self.refusals = self._refusals()
        self._settled = 0
        self._outputs: list[Any] | None = None
        self._values: dict[tuple[int, int], Any] = {}
        self._leaves: list[dict[int, tuple[int, tuple[Any, ...]]]] | None = None

    def path(self, position: int) -> str:
        """``self.<path>`` of node ``position``, as the step's code would name it."""
        if position == 0:
            return f"self.{self.name}" if self.name else "self"
        inner = next(name for name, node in self.root.named_modules() if node is self.nodes[position])
        return f"self.{self.name}.{inner}" if self.name else f"self.{inner}"

    def _refusals(self) -> dict[int, str]:
        """Why each metric whose replicas' states cannot be merged cannot be, by position.

        A metric with states of its own is asked: ``merge_state`` of the scratch copy's fresh state. A wrapper or a
        composition whose metrics hold the states has none of its own: its metrics' states are merged, as
        ``Metric.sync`` gathers them across DDP ranks.
        """
        refusals = {}
        scratch, fresh = self.scratch, self.copies[0]
        scratch.start("forward")
        fresh.start("forward")
        scratch.dirty = True
        for position in self.stateful:
            node = scratch.nodes[position]
            set_update_count(node, 1)
            try:
                node.merge_state(fresh.nodes[position])
            except Exception as error:  # noqa: BLE001 - whatever merge_state raises is its refusal
                refusals[position] = f"{type(error).__name__}: {error}"
        scratch.start("forward")
        return refusals

    def plan(self, sizes: list[int]) -> tuple[list[_Take], Callable[[], None] | None]:
        """How the module's metrics take what the first ``len(sizes)`` copies recorded in the call, in batch order.

        Returns the calls whose arguments join, to be made once on the module's metrics with the whole batch
        (``take``), each with its order among the step's calls; or a merge of the copies' states into the module's
        metrics, to be run. Where every call was a call of the metric (its forward), which updated the copy as it
        computed the replica's value, and torchmetrics can merge the metrics, the copies are merged as they stand:
        as exact, and cheaper. A refusal is raised here, before any metric of the module changes.
        """
        copies = self.copies[: len(sizes)]
        self._settled = len(sizes)
        self._outputs = None
        self._values = {}
        self._leaves = None
        if not any(replica.calls for replica in copies):
            return [], None
        self._check_unchanged(copies)
        refused = self._refused(copies)
        calls = [call for replica in copies for call in replica.calls]
        if refused is None and all(call.kind == "forward" and self.forward_updates[call.owner] for call in calls):
            return [], functools.partial(self._merge, copies)
        joined = _join_calls(copies, sizes, self.device, self.path)
        if isinstance(joined, list):
            self._outputs = [None] * len(joined)
            return [_Take(call.order, self, index, call) for index, call in enumerate(joined)], None
        if refused is not None:
            position, reason = refused
            raise ReplicaStateError(
                f"{copies[0].method} updated {self.path(position)} ({type(self.nodes[position]).__name__}) inside"
                f" the replicas with {joined}. So the replicas' arguments cannot be joined into the whole batch's,"
                f" and torchmetrics cannot merge the replicas' states into one either ({reason.rstrip('.')})."
                " Pass it one value per row of the batch (per-row predictions and targets, not a value reduced over"
                f" the rows), or {_MERGE_FIX}.",
                self.path(position),
                copies[0].method,
            )
        for replica in copies:
            replica.take_calls()  # each copy, from its default state: the module's metrics are left alone
        return [], functools.partial(self._merge, copies)

    def _check_unchanged(self, copies: Sequence[_Copy]) -> None:
        """Refuse a call whose tensor argument the step changed in place afterwards: its values are not the call's."""
        for replica in copies:
            for call in replica.calls:
                where = call.changed_argument()
                if where is not None:
                    path = f"{self.path(call.owner)}.{call.kind}"
                    raise ReplicaStateError(
                        f"{replica.method} changed {where} of {path} in place after passing it, inside replica"
                        f" {replica.index}. One device's metric takes the values at the call; inside the replicas"
                        " the module's metric takes every replica's arguments after the step, and would see the"
                        " changed ones. Pass a copy (.clone()), or make a new tensor instead of changing it.",
                        self.path(call.owner),
                        replica.method,
                    )

    def take(self, index: int, call: _Call) -> None:
        """Make call ``index`` of the step (``plan`` returned it), every replica's joined, on the module's metric."""
        node = self.nodes[call.owner]
        value = node.update(*call.args, **call.kwargs) if call.kind == "update" else node(*call.args, **call.kwargs)
        self._outputs[index] = value  # type: ignore[index]

    def _refused(self, copies: Sequence[_Copy]) -> tuple[int, str] | None:
        """The first metric the copies' calls reached whose states torchmetrics cannot merge, and why, if one."""
        for owner in dict.fromkeys(call.owner for replica in copies for call in replica.calls):
            for position in self.within[owner]:
                reason = self.refusals.get(position)
                if reason is not None:
                    return position, reason
        return None

    def _merge(self, copies: Sequence[_Copy]) -> None:
        """Merge the states the copies reached into the module's metrics, in batch order."""
        self.scratch.start("forward")
        self.scratch.dirty = True
        for position in self.metrics:
            original = self.nodes[position]
            counts = [replica.updated(position) for replica in copies]
            changed = [replica.changed(position) for replica in copies]
            if not any(changed):
                continue
            before = original.update_count
            if position in self.stateful:
                incoming = [replica.nodes[position] for replica, keep in zip(copies, changed, strict=True) if keep]
                for metric in incoming:
                    _move_states(metric, self.device)
                merged = self.scratch.nodes[position]
                _merge_in_order(merged, [original, *incoming])
                for name, value in merged.metric_state.items():
                    setattr(original, name, value)
            set_update_count(original, before + max(counts))
            forget_computed(original)
            if any(position in call.states for replica in copies for call in replica.calls):
                set_forward_value(original, None)  # worked out when logged (resolve), from every replica's call

    def resolve(self, value: Any, replica: int) -> tuple[Metric | None, Any] | None:
        if replica >= self._settled:
            return None
        copied = self.copies[replica]
        if isinstance(value, _UNITS):
            position = copied.positions.get(id(value))
            if position is None:
                return None
            original = self.nodes[position]
            if not isinstance(original, Metric):
                return None
            if self._outputs is None:
                # A composition (``SumMetric() + SumMetric()``) computes from its metrics' states, none of its own.
                last = [
                    index
                    for index, call in enumerate(copied.calls)
                    if position in call.states or call.owner == position
                ]
                if last:
                    set_forward_value(original, self._value_of(position, last[-1]))
            return original, None
        if not isinstance(value, torch.Tensor):
            return None
        if self._leaves is None:
            self._leaves = [_leaf_index(other.calls) for other in self.copies[: self._settled]]
        found = self._leaves[replica].get(id(value))
        if found is None:
            return None
        index, path = found
        if self._outputs is not None:
            whole = self._outputs[index]
        else:
            whole = self._value_of(self.copies[replica].calls[index].owner, index)
        for key in path:
            whole = whole[key]
        return None, whole

    def _value_of(self, position: int, index: int) -> Any:
        """One device's value of node ``position`` in call ``index``: every replica's matching call, merged."""
        key = (position, index)
        if key in self._values:
            return self._values[key]
        copies = self.copies[: self._settled]
        calls = [replica.calls[index] if index < len(replica.calls) else None for replica in copies]
        owner = calls[0].owner if calls[0] is not None else None
        if any(call is None or call.owner != owner for call in calls):
            raise ReplicaStateError(
                f"{copies[0].method} logged the value of a call of {self.path(position)} inside the replicas, but"
                f" the replicas called it different numbers of times ({[len(replica.calls) for replica in copies]}),"
                f" so one device's value cannot be worked out. Call the metric once per step in every replica, or"
                " log it from the matching *_step_end hook.",
                self.path(position),
                copies[0].method,
            )
        scratch = self.scratch
        scratch.start("forward")
        scratch.dirty = True
        for node_position in self.stateful:
            states = [
                {name: _to(value, self.device) for name, value in call.states[node_position].items()}
                for call in calls
                if call is not None and node_position in call.states
            ]
            if states:
                _merge_in_order(scratch.nodes[node_position], states)
        scratch.internal = True
        try:
            value = scratch.nodes[position].compute()
        finally:
            scratch.internal = False
        self._values[key] = value
        return value


class _Take(NamedTuple):
    """Call number ``number`` of the step for ``unit``'s metrics, every replica's joined; ``order``-th of all calls."""

    order: int
    unit: _Unit
    number: int
    call: _Call


class _Unjoinable(Exception):
    """An argument the replicas passed that is not one entry per row of their chunks, nor the same in all."""


def _join_calls(
    copies: Sequence[_Copy], sizes: Sequence[int], device: torch.device, path: Callable[[int], str]
) -> list[_Call] | str:
    """The calls every replica made, each joined into one call on the whole batch; or why they cannot be."""
    first = copies[0].calls
    for replica in copies[1:]:
        if [(call.owner, call.kind) for call in replica.calls] != [(call.owner, call.kind) for call in first]:
            counts = [len(other.calls) for other in copies]
            return f"calls that differ between the replicas (replica 0 made {len(first)}, the replicas {counts})"
    if len(copies) == 1:
        return list(first)
    joined = []
    with torch.no_grad():
        for index, call in enumerate(first):
            calls = [replica.calls[index] for replica in copies]
            where = f"{path(call.owner)}.{call.kind}"
            try:
                if any(
                    len(other.args) != len(call.args) or other.kwargs.keys() != call.kwargs.keys() for other in calls
                ):
                    raise _Unjoinable(f"arguments that differ between the replicas in {where}")
                args = tuple(
                    _join([other.args[i] for other in calls], sizes, device, f"argument {i + 1} of {where}")
                    for i in range(len(call.args))
                )
                kwargs = {
                    key: _join([other.kwargs[key] for other in calls], sizes, device, f"{key}= of {where}")
                    for key in call.kwargs
                }
            except _Unjoinable as reason:
                return str(reason)
            joined.append(_Call(call.owner, call.kind, args, kwargs, call.order))
    return joined


def _join(values: Sequence[Any], sizes: Sequence[int], device: torch.device, what: str) -> Any:
    """One device's argument from the replicas' ``values``: rows concatenated in batch order, shared values kept.

    A tensor, list or tuple with one entry per row of each replica's chunk (its first dimension, its length) holds
    the chunk's rows; dicts, and lists and tuples of the same length otherwise, are joined entry by entry; anything
    else must be the same in every replica (a threshold, a class count), or it is one replica's own.
    """
    first = values[0]
    if isinstance(first, torch.Tensor):
        if not all(isinstance(value, torch.Tensor) for value in values):
            raise _Unjoinable(f"{what}, a tensor in some replicas only")
        if first.dim() == 0:
            raise _Unjoinable(f"{what}, a 0-dim tensor (a value of the replica's rows, not one per row)")
        per_row = all(value.dim() > 0 and value.shape[0] == rows for value, rows in zip(values, sizes, strict=True))
        if per_row and len({tuple(value.shape[1:]) for value in values}) == 1:
            return torch.cat([value.detach().to(device) for value in values])
        if all(value.shape == first.shape and torch.equal(value, first.to(value.device)) for value in values):
            return first.to(device)
        shapes = [tuple(value.shape) for value in values]
        raise _Unjoinable(f"{what}, tensors of shapes {shapes} for chunks of {list(sizes)} rows")
    if isinstance(first, Mapping):
        keys = list(first.keys())
        if not all(isinstance(value, Mapping) and list(value.keys()) == keys for value in values):
            raise _Unjoinable(f"{what}, mappings with different keys")
        joined = {key: _join([value[key] for value in values], sizes, device, f"{what}[{key!r}]") for key in keys}
        return joined if type(first) is dict else type(first)(joined)  # type: ignore[call-arg]
    if isinstance(first, (list, tuple)) and not is_namedtuple(first):
        if not all(type(value) is type(first) for value in values):
            raise _Unjoinable(f"{what}, a {type(first).__name__} in some replicas only")
        if all(len(value) == rows for value, rows in zip(values, sizes, strict=True)):
            return type(first)(_to(item, device) for value in values for item in value)
        if len({len(value) for value in values}) == 1:
            return type(first)(
                _join([value[i] for value in values], sizes, device, f"{what}[{i}]") for i in range(len(first))
            )
        lengths = [len(value) for value in values]
        raise _Unjoinable(f"{what}, of lengths {lengths} for chunks of {list(sizes)} rows")
    if all(value is first for value in values) or all(_equal_plain(value, first) for value in values):
        return first
    shown = ", ".join(f"{value!r:.20}" for value in values)
    raise _Unjoinable(f"{what}, which differs between the replicas ({shown})")


def _equal_plain(value: Any, other: Any) -> bool:
    """Whether two plain values (numbers, strings, ``None``) are the same."""
    plain = (type(None), bool, int, float, str)
    return isinstance(value, plain) and type(value) is type(other) and value == other


def _holds(outer: nn.Module, inner: nn.Module) -> bool:
    return any(module is inner for module in outer.modules())


def _marks(metric: Metric) -> list[tuple[int, int]]:
    """What a metric's states are now: each one's identity and, for a tensor, its in-place changes, else its length."""
    return [
        (id(value), version_counter(value) if isinstance(value, torch.Tensor) else len(value))
        for value in metric.metric_state.values()
    ]


def _keeps_state(metric: Metric) -> bool:
    """Whether ``metric`` has states of its own, not only those of a metric it wraps, which it reads through.

    A wrapper such as ``ClasswiseWrapper`` shows its metric's states as its own; merging both would merge them twice.
    """
    held = {
        id(value)
        for inner in metric.modules()
        if inner is not metric and isinstance(inner, Metric)
        for value in inner.metric_state.values()
    }
    return any(id(value) not in held for value in metric.metric_state.values())


def _merge_in_order(target: Metric, sources: Sequence[Metric | dict[str, Any]]) -> None:
    """Make ``target``'s state the merge of ``sources``' states, the first first (a list state: in their order).

    ``merge_state`` puts the incoming state first, so the sources are taken from the last; the last is copied, not
    merged into ``target``'s default state, which a state reduced by stacking would keep as an entry.
    """
    ordered = list(reversed(sources)) if _incoming_first() else list(sources)
    base = ordered[0] if isinstance(ordered[0], dict) else ordered[0].metric_state
    for name, value in base.items():
        setattr(target, name, _kept(value))
    set_update_count(target, 1)
    for source in ordered[1:]:
        set_update_count(target, target.update_count + 1)  # merge_state counts the incoming in a mean state
        target.merge_state(source)


@functools.cache
def _incoming_first() -> bool:
    """Whether ``merge_state`` puts the incoming state before the metric's own in a list state, as torchmetrics does."""
    own, incoming = CatMetric(), CatMetric()
    own.update(torch.zeros(1))
    incoming.update(torch.ones(1))
    own.merge_state(incoming)
    return bool(own.compute()[0] == 1)


def _refusal_in_replica(replica: _Copy, position: int, name: str) -> ReplicaStateError:
    path = replica.unit.path(position)
    step = replica.method
    if name == "compute":
        reason = (
            f"{step} called {path}.compute() inside replica {replica.index}, whose copy of the metric holds only this"
            " replica's rows of the step (one device's would hold every row of every step so far)."
        )
    else:
        reason = (
            f"{step} called {path}.reset() inside replica {replica.index}, which would reset only this replica's"
            " copy, not the metric every replica's updates go into."
        )
    return ReplicaStateError(
        f"{reason} Call it after the step: in the matching *_step_end hook or an epoch-end hook, where the metric"
        f" holds every replica's updates. Inside the step, calling the metric ({path}(preds, target)) returns this"
        " replica's rows' value, as a DDP rank's call returns its shard's, and logging it or the metric logs one"
        " device's value.",
        path,
        step,
    )


def _deep_copy(unit: nn.Module) -> nn.Module:
    """A deep copy of ``unit``, its metrics' tensors with autograd history copied without it.

    A metric called in training keeps what it was given, and ``copy.deepcopy`` refuses tensors that are not leaves of
    the autograd graph; the copy's states are reset before use anyway.
    """
    memo: dict[int, Any] = {}
    for node in unit.modules():
        if isinstance(node, Metric):
            for value in vars(node).values():
                _detach_into(value, memo)
    return copy.deepcopy(unit, memo)


def _detach_into(value: Any, memo: dict[int, Any]) -> None:
    if isinstance(value, torch.Tensor):
        if value.grad_fn is not None:
            memo[id(value)] = value.detach().clone()
    elif isinstance(value, (list, tuple)):
        for item in value:
            _detach_into(item, memo)
    elif isinstance(value, dict):
        for item in value.values():
            _detach_into(item, memo)


def _kept(value: Any) -> Any:
    """A metric state as it is now: tensors cloned (a later update may add into them), lists copied."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, list):
        return list(value)
    return value


def _to(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor in it on ``device``: a state, or one row of an argument (a detection's dict)."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, list):
        return [_to(item, device) for item in value]
    if isinstance(value, tuple) and not is_namedtuple(value):
        return tuple(_to(item, device) for item in value)
    if type(value) is dict:
        return {key: _to(item, device) for key, item in value.items()}
    return value


def _move_states(metric: Metric, device: torch.device) -> None:
    """Put a copy's states on ``device``, where the module's metric is, so that merging adds tensors of one device."""
    if metric.device == device:
        return
    for name, value in metric.metric_state.items():
        setattr(metric, name, _to(value, device))


def _device_of(unit: nn.Module) -> torch.device:
    metric = next((node for node in unit.modules() if isinstance(node, Metric)), None)
    return metric.device if metric is not None else torch.device("cpu")


def _leaf_index(calls: Sequence[_Call]) -> dict[int, tuple[int, tuple[Any, ...]]]:
    """Each tensor that a copy's calls returned, by ``id``, mapped to the call's index and its key path in the value."""
    return {id(leaf): (index, path) for index, call in enumerate(calls) for path, leaf in _leaves(call.output)}


def _distinct(output: Any, seen: set[int]) -> Any:
    """``output`` with every tensor object that appears again replaced by a view of it: equal, and its own object."""
    if isinstance(output, torch.Tensor):
        if id(output) in seen:
            return output.view_as(output)
        seen.add(id(output))
        return output
    if isinstance(output, dict):
        return type(output)((key, _distinct(value, seen)) for key, value in output.items())
    if isinstance(output, (list, tuple)) and not is_namedtuple(output):
        return type(output)(_distinct(value, seen) for value in output)
    return output


def _leaves(output: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], torch.Tensor]]:
    """The tensors in a value (a tensor, or mappings, lists and tuples of them), with their key paths."""
    if isinstance(output, torch.Tensor):
        yield path, output
    elif isinstance(output, Mapping):
        for key, value in output.items():
            yield from _leaves(value, (*path, key))
    elif isinstance(output, (list, tuple)):
        for position, value in enumerate(output):
            yield from _leaves(value, (*path, position))
