"""torchmetrics inside replicas: each replica updates a copy of its own, merged into the module's metric afterwards.

A ``Metric`` binds ``update`` and ``compute`` to the object it was built as, so a replica made the way torch makes
one would update the module's own metric from every replica thread at once: updates lost, list states in thread order.
Here every metric and ``MetricCollection`` of the module (a *unit*: the outermost one, with whatever it holds) gets one
deep copy per replica, made once per module structure. Before each call the copies go back to their default state;
each replica updates or calls its own; after the call, in batch order, each copy's state goes into the module's
metric through torchmetrics' own ``merge_state``, which is how torchmetrics combines the states of DDP ranks. The
module's metric then holds what one device's updates on the whole batch give, and counts one update per call, as
one device does.

What a metric returns when called inside a replica is that replica's rows' value, as a DDP rank's call returns its
shard's. For logging, ``resolve`` gives the value one device's call returns: each replica's state at its call is kept,
and the states of every replica's matching call are merged into a scratch copy, which computes it. A metric that
``merge_state`` refuses (``full_state_update=True``, ``dist_sync_on_step=True``, a merge of its own that raises) and
``compute()`` or ``reset()`` called on a replica's copy from the step's code raise ``ReplicaStateError`` naming the
metric and the fix: use it after the step, in the ``*_step_end`` hook, where it is the module's own.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

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
from lightning_mgpu.errors import ReplicaStateError

_UNITS = (Metric, MetricCollection)
_MERGE_FIX = (
    "Update and call it in the matching *_step_end hook instead, on the outputs gathered from every replica, where"
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

    def settle(self, replicas: int) -> None:
        """Merge what the first ``replicas`` copies gathered in the call into the module's metrics, in batch order."""
        for unit in self.units:
            unit.settle(replicas)

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
    """One replica's copy of a unit, and what it recorded in the current call."""

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
        self.calls: list[_Call] = []
        self._open: _Call | None = None
        self._counts: dict[int, int] = {}
        self._marks: dict[int, list[tuple[int, int]]] = {}
        for position, node in enumerate(self.nodes):
            if isinstance(node, _UNITS):
                node.__dict__["compute"] = _Guard(self, position, "compute", node.compute)
                node.__dict__["reset"] = _Guard(self, position, "reset", node.reset)
                node.register_forward_pre_hook(self._open_call)
                node.register_forward_hook(self._close_call)

    def start(self, method: str) -> None:
        """Back to the default state, for a call of ``method``; a list state gets a new list, never cleared in place.

        A merged metric may hold the very list a copy gathered; clearing the copy's own would empty it there too.
        """
        self.method = method
        self.calls = []
        self._open = None
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
        # A wrapper's reset may leave its own count alone (ClasswiseWrapper resets only its metric): count from here.
        self._counts = {position: self.nodes[position].update_count for position in self.unit.metrics}
        self._marks = {position: _marks(self.nodes[position]) for position in self.unit.stateful}

    @property
    def calling(self) -> bool:
        """Whether one of the copy's metrics is being called (its forward runs)."""
        return self._open is not None

    def updated(self, position: int) -> int:
        """How many updates metric ``position`` of this copy counted since ``start``."""
        return int(self.nodes[position].update_count) - self._counts[position]

    def changed(self, position: int) -> bool:
        """Whether metric ``position`` of this copy counted an update or changed a state since ``start``.

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

    def _open_call(self, module: nn.Module, args: Any) -> None:
        if self._open is None:  # a call inside another (a collection's metrics) belongs to the outer one
            self._open = _Call(next(position for position, node in enumerate(self.nodes) if node is module))

    def _close_call(self, module: nn.Module, args: Any, output: Any) -> None:
        call = self._open
        if call is not None and self.nodes[call.owner] is module:
            call.output = output
            self.calls.append(call)
            self._open = None


class _Call:
    """A call of one of a copy's metrics (``owner``): what it returned, and each metric's state it computed from."""

    __slots__ = ("output", "owner", "states")

    def __init__(self, owner: int) -> None:
        self.owner = owner
        self.output: Any = None
        self.states: dict[int, dict[str, Any]] = {}


class _Guard:
    """A copy's ``compute`` or ``reset``: torchmetrics' own code may call it, the step's code may not."""

    def __init__(self, replica: _Copy, position: int, name: str, call: Callable[..., Any]) -> None:
        self.replica = replica
        self.position = position
        self.name = name
        self.call = call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        replica = self.replica
        inside_a_call = replica.internal or replica.calling
        if not inside_a_call and not caller_module(1).startswith("torchmetrics"):
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
        self.within = {  # each metric's position, with the positions of the metrics it holds
            position: [
                inner
                for inner, node in enumerate(self.nodes)
                if isinstance(node, Metric) and _holds(self.nodes[position], node)
            ]
            for position in self.metrics
        }
        self.device = _device_of(root)
        self.copies = [_Copy(self, device, index) for index, device in enumerate(devices)]
        self.scratch = _Copy(self, self.device, -1)
        self.refusals = self._refusals()
        self._settled = 0
        self._values: dict[tuple[int, int], Any] = {}
        self._leaves: list[dict[int, tuple[int, tuple[Any, ...]]]] | None = None

    def path(self, position: int) -> str:
        """``self.<path>`` of node ``position``, as the step's code would name it."""
        if position == 0:
            return f"self.{self.name}" if self.name else "self"
        inner = next(name for name, node in self.root.named_modules() if node is self.nodes[position])
        return f"self.{self.name}.{inner}" if self.name else f"self.{inner}"

    def _refusals(self) -> dict[int, str]:
        """Why each metric that cannot be merged cannot be, by position.

        A metric with states of its own is asked: ``merge_state`` of the scratch copy's fresh state. A wrapper whose
        metrics hold the states has none to merge, and merging them is exact unless it declares its update needs the
        state so far (``BootStrapper``: ``full_state_update=True``), as torchmetrics would refuse to merge it.
        """
        refusals = {}
        for position in self.metrics:
            node = self.nodes[position]
            if position not in self.stateful and (node.full_state_update is True or node.dist_sync_on_step):
                flag = "full_state_update=True" if node.full_state_update is True else "dist_sync_on_step=True"
                refusals[position] = f"{type(node).__name__} declares {flag}"
        scratch, fresh = self.scratch, self.copies[0]
        scratch.start("forward")
        fresh.start("forward")
        for position in self.stateful:
            node = scratch.nodes[position]
            set_update_count(node, 1)
            try:
                node.merge_state(fresh.nodes[position])
            except Exception as error:  # noqa: BLE001 - whatever merge_state raises is its refusal
                refusals[position] = f"{type(error).__name__}: {error}"
        scratch.start("forward")
        return refusals

    def settle(self, replicas: int) -> None:
        copies = self.copies[:replicas]
        self._settled = replicas
        self._values = {}
        self._leaves = None
        touched = [replica for replica in copies if any(replica.changed(position) for position in self.metrics)]
        if not touched:
            return
        for position, reason in self.refusals.items():
            if any(replica.changed(inner) for replica in touched for inner in self.within[position]):
                raise ReplicaStateError(
                    f"{touched[0].method} updated {self.path(position)} ({type(self.nodes[position]).__name__})"
                    f" inside the replicas, and torchmetrics cannot merge the replicas' states into one ({reason})."
                    f" {_MERGE_FIX}. A metric of your own whose update needs no earlier state can declare"
                    " full_state_update = False in its class.",
                    self.path(position),
                    touched[0].method,
                )
        self.scratch.start("forward")
        for position in self.metrics:
            original = self.nodes[position]
            counts = [replica.updated(position) for replica in touched]
            changed = [replica.changed(position) for replica in touched]
            if not any(changed):
                continue
            before = original.update_count
            if position in self.stateful:
                incoming = [replica.nodes[position] for replica, keep in zip(touched, changed, strict=True) if keep]
                for metric in incoming:
                    _move_states(metric, self.device)
                merged = self.scratch.nodes[position]
                _merge_in_order(merged, [original, *incoming])
                for name, value in merged.metric_state.items():
                    setattr(original, name, value)
            set_update_count(original, before + max(counts))
            forget_computed(original)
            if any(position in call.states for replica in touched for call in replica.calls):
                set_forward_value(original, None)  # worked out when logged (resolve), from every replica's call

    def resolve(self, value: Any, replica: int) -> tuple[Metric | None, Any] | None:
        if replica >= self._settled:
            return None
        copied = self.copies[replica]
        if isinstance(value, _UNITS):
            if not any(value is node for node in copied.nodes):
                return None
            position = next(position for position, node in enumerate(copied.nodes) if node is value)
            original = self.nodes[position]
            if isinstance(original, Metric):
                # A composition (``SumMetric() + SumMetric()``) computes from its metrics' states, none of its own.
                last = [
                    index
                    for index, call in enumerate(copied.calls)
                    if position in call.states or call.owner == position
                ]
                if last:
                    set_forward_value(original, self._value_of(position, last[-1]))
                return original, None
            return None
        if not isinstance(value, torch.Tensor):
            return None
        if self._leaves is None:
            self._leaves = [_leaf_index(other.calls) for other in self.copies[: self._settled]]
        found = self._leaves[replica].get(id(value))
        if found is None:
            return None
        index, path = found
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
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, list):
        return [_to(item, device) for item in value]
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


def _leaves(output: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], torch.Tensor]]:
    """The tensors in a metric's value (a tensor, or dicts, lists and tuples of them), with their key paths."""
    if isinstance(output, torch.Tensor):
        yield path, output
    elif isinstance(output, dict):
        for key, value in output.items():
            yield from _leaves(value, (*path, key))
    elif isinstance(output, (list, tuple)):
        for position, value in enumerate(output):
            yield from _leaves(value, (*path, position))
