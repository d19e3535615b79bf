"""Make one replica of a module per device whose parameters stay differentiable aliases of the originals.

The backward pass of every replica therefore accumulates into the original parameters, so the optimizer sees the
gradient of the whole batch. A replica behaves like the module on one device: ``parameters()``,
``named_parameters()`` and ``buffers()`` of the replica and of every module inside it yield the replica's own
tensors (so weight penalties and ``next(self.parameters()).device`` work and are exact), tied weights stay tied, and
compiled submodules run compiled on the replica's own tensors. A replica built on the CPU behaves exactly like one
built on a GPU.

``torch.nn.DataParallel`` builds every replica module anew on every step. ``ReplicaCache`` keeps the replica objects
between steps and only re-points them at the module's current attributes, parameters and buffers, which costs a
fraction of rebuilding them (see benchmarks/README.md).

What a step may change besides parameters and buffers is never shared between replicas: each replica has its own copy
of every torchmetrics metric (``lightning_mgpu.replica_state.metrics``) and of the plain lists, dicts and sets of the
model's own code (``lightning_mgpu.engine.containers``), and ``ReplicaCache.settle`` puts what they changed back into
the module after the call, in batch order, or refuses it.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import types
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from lightning_mgpu import _compat
from lightning_mgpu.engine.containers import Isolated, combine, combine_values, isolate
from lightning_mgpu.errors import ReplicaStateError
from lightning_mgpu.library_code import is_library_class, kept_by_library
from lightning_mgpu.replica_state import ReplicaGuard, ReplicaStates
from lightning_mgpu.replica_state.buffers import BufferStarts, settle_buffers, store_buffers
from lightning_mgpu.replica_state.metrics import MetricReplicas, metric_units


class ReplicaCache:
    """Replica shells kept between calls, refreshed from the module on every call.

    Modules that customise ``__setattr__`` or their own replication (RNNs, torch.compile's wrapper, torchmetrics)
    get a fresh shell each call; every other module reuses its shell. What depends only on the module's structure
    (which shell stands for which module, which modules can reuse theirs) is worked out once per structure; a call
    then walks the modules once and refreshes each shell from its module's current attributes, parameters and
    buffers.
    """

    def __init__(self, *, first_shares_buffers: bool = False) -> None:
        self._first_shares_buffers = first_shares_buffers
        self._structure: _Structure | None = None
        self._structures: dict[tuple[torch.device, ...], _Structure] = {}
        self._kept_buffers: list[tuple[nn.Module, nn.Module]] = []
        self._buffer_starts: list[BufferStarts] = []
        self._isolated: list[Isolated] = []
        self._aliases: list[dict[int, torch.Tensor]] = []
        self._attributes: list[_Attributes] = []
        self._states = ReplicaStates()

    @property
    def structure(self) -> object:
        """Changes whenever the module's structure or the devices change, so callers can cache what depends on it."""
        return None if self._structure is None else self._structure.key

    @property
    def devices(self) -> tuple[torch.device, ...]:
        """The devices of the last call's replicas, in order; empty before the first."""
        return () if self._structure is None else self._structure.devices

    def __getstate__(self) -> dict[str, object]:
        """The shells hold views with autograd history, which cannot be copied; a copy starts with no shells."""
        return {"first_shares_buffers": self._first_shares_buffers}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__(first_shares_buffers=bool(state.get("first_shares_buffers")))  # type: ignore[misc]

    def __call__(
        self,
        module: nn.Module,
        devices: Sequence[torch.device],
        misplaced: Callable[[], None] | None = None,
    ) -> list[nn.Module]:
        """One replica of ``module`` per entry of ``devices``, in order.

        Parameters reach a replica on the parameter's own device as an alias, and a replica on another device as a
        differentiable copy; one parameter used by several modules is one tensor in the replica too. A replica
        running alone works on the module's own buffers, as one device does. Two or more work on private copies
        each, so concurrent replicas never write to the same buffer, and ``settle`` gives the module what they
        changed alike (``lightning_mgpu.replica_state.buffers``); with ``first_shares_buffers`` the first works on
        the module's buffers instead, as in ``torch.nn.DataParallel``'s ``replicate``, and nothing is settled.
        When a parameter or buffer of ``module`` is not on ``devices[0]``,
        ``misplaced()`` is called before any replica is made, so a caller that requires the module there can raise
        first.
        """
        originals = modules_of(module)
        devices = tuple(devices)
        structure = self._structures.get(devices)
        if structure is None or not _same_objects(structure.originals, originals):
            if structure is not None:
                self._structures.clear()  # the module changed: no structure of it is current any more
            structure = self._structures[devices] = _Structure(originals, devices)
        self._structure = structure
        root = devices[0]
        on_root = all_on(originals, root)
        if not on_root and misplaced is not None:
            misplaced()
        replicas = []
        self._kept_buffers = []
        shares = len(devices) == 1 or self._first_shares_buffers
        self._buffer_starts = [] if shares else [BufferStarts() for _ in devices]
        self._isolated = [Isolated() for _ in devices] if structure.isolates else []
        self._aliases = []
        for index, device in enumerate(devices):
            kept = self._kept_buffers if index == 0 and shares else None
            starts = None if shares else self._buffer_starts[index]
            isolated = self._isolated[index] if self._isolated else None
            aliases: dict[int, torch.Tensor] = {}
            on_device = on_root and device == root
            replicas.append(structure.refresh(index, device, on_device, shares, kept, starts, isolated, aliases))
            self._aliases.append(aliases)
        if structure.metrics is not None:
            structure.metrics.start()
        return replicas

    def begin(self, method: str | None) -> list[ReplicaGuard] | None:
        """Name the call that the replicas of the last ``__call__`` are about to run (``None``: forward).

        Returns one ``ReplicaGuard`` per replica, for each to run its call in, where two or more run side by side
        (``lightning_mgpu.replica_state``); ``None`` for a replica running alone, which shares nothing with another.
        """
        structure = self._structure
        if structure is None:
            return None
        if structure.metrics is not None:
            structure.metrics.name(method)
        # A replica running alone runs on a shell too: what it assigns reaches the module by the same rule.
        self._attributes = structure.snapshot(len(self._aliases))
        if len(self._aliases) < 2:
            return None
        if method is not None:
            _check_stored_method(structure.originals[0], method)
        own_buffers = [starts.tensor_ids for starts in self._buffer_starts]
        return self._states.begin(self._aliases, method or "forward", own_buffers)

    def settle_process(self, method: str | None) -> None:
        """Right after the replicas of the last call, in the caller's contexts: process-wide settings they changed.

        See ``lightning_mgpu.replica_state.process``; a refusal comes before anything else of the call is settled.
        """
        if self._structure is not None and len(self._aliases) > 1:
            self._states.settle_process(method or "forward")

    def settle(
        self,
        sizes: Sequence[int] | None,
        device: torch.device,
        method: str | None,
        per_replica_batchnorm: bool = False,
    ) -> None:
        """Put back into the module what the replicas of the last call changed, in batch order, or refuse it.

        Parameters that every replica changed alike in place are changed once, and other changes of them refused
        (``lightning_mgpu.replica_state``); torchmetrics metrics merge their copies' states
        (``lightning_mgpu.replica_state.metrics``), lists gain what every replica appended and sets what they added
        (``lightning_mgpu.engine.containers``), and buffers that replica 0 reassigned are stored on the module, as
        its in-place updates are; buffers that several replicas changed alike are changed once, and other changes
        of them refused (``lightning_mgpu.replica_state.buffers``). A refusal leaves the module's parameters and
        buffers unchanged.

        Args:
            sizes: the rows each replica received, in batch order.
            device: where appended items are gathered.
            method: the method the replicas ran (``None``: forward), for messages.
            per_replica_batchnorm: BatchNorm layers normalised each chunk by its own statistics
                (``sync_batchnorm=False``): their running statistics are the first replica's, as in
                ``torch.nn.DataParallel``.
        """
        structure = self._structure
        step = method or "forward"
        starts, self._buffer_starts = self._buffer_starts, []
        buffers = (
            settle_buffers(starts, structure.names, step, per_replica_batchnorm)
            if structure is not None and starts
            else []
        )
        if structure is not None and len(self._aliases) > 1:
            self._states.settle(structure.originals[0], step)
        if structure is not None and self._attributes:
            structure.settle_assignments(self._attributes, sizes, device, step)
        self._aliases, self._attributes = [], []
        if structure is not None and structure.metrics is not None:
            structure.metrics.settle(sizes)
        if self._isolated:
            combine(self._isolated, sizes, device, step)
        store_buffers(buffers)
        self.keep_reassigned_buffers()

    def resolve(self, value: Any, replica: int) -> tuple[nn.Module | None, Any] | None:
        """What ``value``, logged by replica ``replica`` in the last call, is on one device, if a metric made it.

        See ``lightning_mgpu.replica_state.metrics.MetricReplicas.resolve``.
        """
        structure = self._structure
        if structure is None or structure.metrics is None:
            return None
        return structure.metrics.resolve(value, replica)

    def keep_reassigned_buffers(self) -> None:
        """Store on the module the buffers that replica 0 of the last call reassigned (``self.count = self.count + 1``).

        Replica 0 works on the module's own buffers, so its in-place updates persist; a reassignment only rebinds the
        replica's name, and without this it would be lost at the end of the call. Only modules that had buffers when
        the call began are looked at: a name the module did not have is never stored.
        """
        for original, shell in self._kept_buffers:
            own = original._buffers
            for name, buffer in shell._buffers.items():
                if own.get(name, buffer) is not buffer:
                    own[name] = buffer


class _Structure:
    """What one module structure on one tuple of devices needs on every call, worked out once."""

    def __init__(self, originals: list[nn.Module], devices: tuple[torch.device, ...]) -> None:
        self.originals = originals
        self.devices = devices
        self.key = (tuple(id(original) for original in originals), devices)
        self.position = {id(original): index for index, original in enumerate(originals)}
        self.reusable = [_reusable(original) for original in originals]
        self.all_reusable = all(self.reusable)
        self.compiled_wrapper = [_compat.is_compiled_wrapper(original) for original in originals]
        self.shells = [[_shell(original) for original in originals] for _ in devices]
        self.current = [list(shells) for shells in self.shells]
        """Each replica's shells in the last call (fresh ones for modules that cannot reuse theirs)."""
        self.names = _names_of(originals[0])
        # A metric binds update and compute to itself, so even a replica running alone needs a copy of its own; a
        # replica running alone shares its containers with no other, so it gets no copies of them.
        parallel = len(devices) > 1
        units = metric_units(originals)
        self.metrics = MetricReplicas(units, devices, [self.names[id(unit)] for unit in units]) if units else None
        self.in_metrics = [False] * len(originals)
        if self.metrics is not None:
            for index in range(len(devices)):
                for original_id, copied in self.metrics.copies_of(index).items():
                    self.shells[index][self.position[original_id]] = copied
                    self.in_metrics[self.position[original_id]] = True
        self.own_code = [
            position
            for position, original in enumerate(originals)
            if parallel and not self.in_metrics[position] and not is_library_class(type(original))
        ]
        self.isolates = bool(self.own_code)
        self._library_kept: dict[tuple[int, str], bool] = {}
        self._signatures: dict[int, tuple[tuple[Any, ...], frozenset[str]]] = {}

    def refresh(
        self,
        index: int,
        device: torch.device,
        on_device: bool,
        shares_buffers: bool,
        kept_buffers: list[tuple[nn.Module, nn.Module]] | None,
        buffer_starts: BufferStarts | None,
        isolated: Isolated | None,
        aliases: dict[int, torch.Tensor],
    ) -> nn.Module:
        """Re-point replica ``index``'s shells at the modules' current state and return the top shell.

        ``on_device``: every parameter and buffer is on ``device`` already, so parameters become aliases and
        buffers stay shared or are cloned without a device check each. ``shares_buffers``: replica 0 works on the
        module's own buffers. ``kept_buffers`` and ``buffer_starts`` receive the modules with buffers and their
        shells. ``aliases`` (empty) receives the replica's own tensor for each parameter, by the parameter's ``id``.
        """
        originals = self.originals
        kept = self.shells[index]
        if self.all_reusable:
            shells = kept
        else:
            shells = [
                shell if reuse or in_metrics else _shell(original)
                for original, shell, reuse, in_metrics in zip(
                    originals, kept, self.reusable, self.in_metrics, strict=True
                )
            ]
        self.current[index] = shells
        position = self.position
        first = index == 0 and shares_buffers
        if on_device:
            aliases.update(_aliases_of(originals))
        compiled: list[tuple[nn.Module, nn.Module]] = []
        rows = zip(originals, shells, self.reusable, self.compiled_wrapper, self.in_metrics, strict=True)
        for original, shell, reuse, wrapper, in_metrics in rows:
            source = original.__dict__
            if in_metrics:  # a metric's own copy, made once: only its parameters and buffers follow the module's
                _follow_tensors(source, shell, device, aliases)
                continue
            if reuse:
                state = source.copy()  # a fresh dict: cheaper than clearing and refilling the shell's
                object.__setattr__(shell, "__dict__", state)
                children = source["_modules"]
                state["_modules"] = (
                    {name: None if child is None else shells[position[id(child)]] for name, child in children.items()}
                    if children
                    else {}
                )
                state["_parameters"] = _replica_parameters_of(source["_parameters"], device, aliases)
                buffers = source["_buffers"]
                if not buffers:
                    state["_buffers"] = {}
                elif on_device and first:
                    state["_buffers"] = dict(buffers)
                else:
                    state["_buffers"] = {
                        name: None if buffer is None else _buffer_copy(buffer, device, first)
                        for name, buffer in buffers.items()
                    }
                state[_compat.REPLICA_FLAG] = True
            else:
                _wire(original, shell, shells, position, device, aliases, first=first)
                buffers = source["_buffers"]
            if buffers:
                if kept_buffers is not None:
                    kept_buffers.append((original, shell))
                if buffer_starts is not None:
                    buffer_starts.add(original, shell)
            if wrapper or source.get(_compat.COMPILED_CALL) is not None:
                compiled.append((original, shell))
        for original, shell in compiled:
            _bind_compiled(original, shell)
        if isolated is not None:
            self._isolate(shells, aliases, isolated)
        return shells[0]

    def _isolate(self, shells: list[nn.Module], aliases: dict[int, torch.Tensor], isolated: Isolated) -> None:
        """Give one replica copies of the containers, and watch the plain tensors, of the model's own modules."""
        replica_buffers: dict[int, torch.Tensor] | None = None
        position = self.position

        def remap(value: Any) -> Any:
            nonlocal replica_buffers
            if isinstance(value, nn.Module):
                found = position.get(id(value))
                return None if found is None else shells[found]
            alias = aliases.get(id(value))
            if alias is not None:
                return alias
            if replica_buffers is None:
                replica_buffers = self._buffers_of(shells)
            return replica_buffers.get(id(value))

        for own in self.own_code:
            state = shells[own].__dict__
            names = self._state_names(own, state)
            shared = self._class_containers(own)
            if shared:
                # A container in a class attribute of the model's own (``losses = []`` in the class body) is reached
                # through self by every replica: each gets a copy of its own under the same name, as for one set
                # on the instance, and what it changed goes back into the class's container.
                inherited = [name for name in shared if name not in state]
                for name in inherited:
                    state[name] = shared[name]
                names = names.union(inherited)
            if names:
                isolate(state, names, _path(self.names[id(self.originals[own])]), remap, isolated)

    def _class_containers(self, position: int) -> dict[str, Any]:
        """The lists, dicts and sets that the model's own classes of module ``position`` hold as class attributes."""
        kind = type(self.originals[position])
        names = _CLASS_CONTAINERS.get(kind)
        if names is None:
            found: dict[str, None] = {}
            for owner in reversed(kind.__mro__):
                if is_library_class(owner) or owner is object:
                    continue
                for name, value in vars(owner).items():
                    if isinstance(value, _MUTABLE) and not name.startswith("__"):
                        found[name] = None
                    else:
                        found.pop(name, None)
            names = _CLASS_CONTAINERS[kind] = tuple(found)
        values = {name: getattr(kind, name, None) for name in names}  # read anew: the class may rebind them
        return {name: value for name, value in values.items() if isinstance(value, _MUTABLE)}

    def _state_names(self, position: int, state: dict[str, Any]) -> frozenset[str]:
        """The attributes of module ``position`` (its replica's ``state``) that hold containers or plain tensors.

        A container of a library's own type (Lightning's ``AttributeDict`` of saved hyperparameters) is the
        library's, as its attributes are. Worked out again only when the attributes' names or types change, which a
        step rarely does: a model's own modules are read every step, for every replica.
        """
        signature = (tuple(state), tuple(map(type, state.values())))
        known = self._signatures.get(position)
        if known is not None and known[0] == signature:
            return known[1]
        names = frozenset(
            name
            for name, value in state.items()
            if _may_hold_state(value) and not _library_container(value) and not self._kept(position, name)
        )
        self._signatures[position] = (signature, names)
        return names

    def _kept(self, position: int, name: str) -> bool:
        key = (position, name)
        kept = self._library_kept.get(key)
        if kept is None:
            kept = self._library_kept[key] = kept_by_library(self.originals[position], name)
        return kept

    def _buffers_of(self, shells: list[nn.Module]) -> dict[int, torch.Tensor]:
        """Each buffer of the module, by ``id``, mapped to the replica's own."""
        mapping: dict[int, torch.Tensor] = {}
        for original, shell in zip(self.originals, shells, strict=True):
            for name, buffer in original._buffers.items():
                replica = shell._buffers.get(name)
                if buffer is not None and replica is not None:
                    mapping[id(buffer)] = replica
        return mapping

    def snapshot(self, count: int) -> list[_Attributes]:
        """The attributes of the first ``count`` replicas' shells as the call begins, every module's in one list."""
        return [_Attributes([shell.__dict__ for shell in self.current[index]]) for index in range(count)]

    def settle_assignments(
        self, before: list[_Attributes], sizes: Sequence[int] | None, device: torch.device, step: str
    ) -> None:
        """Give the module the plain attributes the replicas assigned, as one device assigns them, or refuse them.

        An attribute is one device's when every replica assigned it and their values combine by the rules that
        gather step outputs (``containers.combine_values``): the same value once (``self.step_called = True``,
        ``self.count += 1``), a loss by the rows' mean, values per row in batch order. Names starting with ``_`` and
        attributes that the module's library code recomputes are torch's, Lightning's or the library's to keep.
        """
        changed: dict[int, set[str]] = {}
        for attributes in before:
            if attributes.unchanged():
                continue  # the common case, at C speed: nothing assigned in any module of the replica
            for position, names in attributes.changed():
                assignable = {name for name in names if self._assignable(position, name)}
                if assignable:
                    changed.setdefault(position, set()).update(assignable)
        assigned = [
            (self.originals[position], name, self._combined(position, name, sizes, device, step))
            for position, names in changed.items()
            for name in sorted(names)
        ]
        for original, name, value in assigned:  # only once every attribute has one device's value
            if value is _MISSING:
                delattr(original, name)
            else:
                setattr(original, name, value)

    def _assignable(self, position: int, name: str) -> bool:
        return name[0] != "_" and not self.in_metrics[position] and not self._kept(position, name)

    def _combined(self, position: int, name: str, sizes: Sequence[int] | None, device: torch.device, step: str) -> Any:
        """One device's value of attribute ``name`` of module ``position`` (``_MISSING``: deleted), or refuse it."""
        original = self.originals[position]
        path = f"{_path(self.names[id(original)])}.{name}"
        # A replica that did not assign the attribute holds the module's value, which is what it computed alike or not.
        values = [shells[position].__dict__.get(name, _MISSING) for shells in self.current[: len(sizes or [0])]]
        if all(value is _MISSING for value in values):
            return _MISSING
        if any(value is _MISSING for value in values):
            raise ReplicaStateError(
                f"{step} deleted {path} inside some replicas but not in others, so one device's module cannot be"
                " told. Delete it in the matching *_step_end hook, where self is the module itself.",
                path,
                step,
            )
        if len(values) == 1:
            return values[0]  # a replica running alone: its value is one device's
        assert sizes is not None  # several replicas ran, on rows
        return combine_values(values, sizes, device, path, step, f"assigned {path}")


class _Attributes:
    """One replica's module attributes as its call begins, to find cheaply after it whether any was assigned."""

    def __init__(self, states: list[dict[str, Any]]) -> None:
        self.states = states
        self.before = list(map(dict.copy, states))

    def unchanged(self) -> bool:
        """Whether every module holds the same names with the very same values (identity, not equality)."""
        return all(map(_same_attributes, self.states, self.before))

    def changed(self) -> Iterator[tuple[int, set[str]]]:
        """Each module's position and the names assigned, added or deleted in it since the call began."""
        for position, (state, before) in enumerate(zip(self.states, self.before, strict=True)):
            names = {name for name, value in state.items() if before.get(name, _MISSING) is not value}
            names.update(before.keys() - state.keys())
            if names:
                yield position, names


def _same_attributes(now: dict[str, Any], before: dict[str, Any]) -> bool:
    return now.keys() == before.keys() and all(map(operator.is_, now.values(), before.values()))


def _check_stored_method(module: nn.Module, method: str) -> None:
    """Refuse a step stored on the module as a callable that replicas cannot re-bind and that calls the module itself.

    A bound method or ``functools.partial`` of one is re-bound to each replica (``engine.containers``); a closure or
    a mock that wraps the module's method would run every replica's chunk on the module itself, in every thread.
    """
    stored = module.__dict__.get(method)
    if stored is None or isinstance(stored, (types.MethodType, functools.partial)) or not _reaches(stored, module, 0):
        return
    raise ReplicaStateError(
        f"self.{method} is a {type(stored).__name__} stored on the module that calls the module itself, so each"
        f" replica would run its chunk on the module instead of on itself ({method}'s self would not be the"
        f" replica, and what it sets or logs would land on the module, once per replica). Define {method} as a"
        f" method of the class, or store a bound method or a functools.partial of one (self.{method} ="
        f" functools.partial(self._step, stage='train')), which each replica re-binds to itself.",
        f"self.{method}",
        method,
    )


def _reaches(value: Any, module: nn.Module, depth: int) -> bool:
    """Whether calling ``value`` would call into ``module``: a method of it, in a closure, a wrapper or a mock."""
    if value is module:
        return True
    if depth > 3:
        return False
    if isinstance(value, types.MethodType):
        return value.__self__ is module or _reaches(value.__func__, module, depth + 1)
    if isinstance(value, functools.partial):
        return any(_reaches(item, module, depth + 1) for item in (value.func, *value.args, *value.keywords.values()))
    inner = [getattr(value, "__wrapped__", None), getattr(value, "_mock_wraps", None)]
    for cell in getattr(value, "__closure__", None) or ():
        with contextlib.suppress(ValueError):  # an empty cell
            inner.append(cell.cell_contents)
    return any(item is not None and _reaches(item, module, depth + 1) for item in inner)


def replicate(module: nn.Module, devices: Sequence[torch.device]) -> list[nn.Module]:
    """Fresh replicas of ``module``, one per device (see ``ReplicaCache`` for what a replica holds)."""
    return ReplicaCache(first_shares_buffers=True)(module, devices)


def modules_of(module: nn.Module) -> list[nn.Module]:
    """``list(module.modules())``, in the same order and without repeats, at about half its cost.

    Modules are told apart by ``id``: a torchmetrics metric's hash is computed from its states, each time.
    """
    found: list[nn.Module] = []
    seen: set[int] = set()
    stack = [module]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        found.append(current)
        children = current._modules
        if children:
            stack.extend([child for child in reversed(children.values()) if child is not None])
    return found


def _same_objects(left: list[nn.Module], right: list[nn.Module]) -> bool:
    return len(left) == len(right) and all(map(operator.is_, left, right))


def all_on(modules: list[nn.Module], device: torch.device) -> bool:
    """Whether every parameter and buffer of ``modules`` (from ``modules_of``) is on ``device`` exactly."""
    cpu = device.type == "cpu"  # the common case of virtual replicas: read without building a device per tensor
    for module in modules:
        for param in module._parameters.values():
            if param is not None and (not param.is_cpu if cpu else param.device != device):
                return False
        for buffer in module._buffers.values():
            if buffer is not None and (not buffer.is_cpu if cpu else buffer.device != device):
                return False
    return True


_MISSING = object()

_MUTABLE = (list, dict, set)

_CLASS_CONTAINERS: weakref.WeakKeyDictionary[type, tuple[str, ...]] = weakref.WeakKeyDictionary()
"""Each class's names of containers in class attributes of the model's own classes (``_class_containers``)."""


def _may_hold_state(value: Any) -> bool:
    """Whether an attribute's value is a container or a plain tensor, which replicas get copies of or watch.

    A bound method or ``functools.partial`` stored on the module (``self.step = functools.partial(self._step, ...)``)
    is re-bound to the replica, so that ``self`` in it is the replica, as it is in the class's own methods.
    """
    return isinstance(value, (list, tuple, dict, set, torch.Tensor, types.MethodType, functools.partial))


def _library_container(value: Any) -> bool:
    return not isinstance(value, torch.Tensor) and is_library_class(type(value))


def _names_of(module: nn.Module) -> dict[int, str]:
    """Each module inside ``module`` (itself included, as ``""``), by ``id``, mapped to its first attribute path."""
    names: dict[int, str] = {}
    for name, inner in module.named_modules(remove_duplicate=False):
        names.setdefault(id(inner), name)
    return names


def _path(name: str) -> str:
    """How the step's code names a module's attribute: ``self`` for the module, ``self.encoder`` for one inside."""
    return f"self.{name}" if name else "self"


def _follow_tensors(source: dict[str, Any], shell: nn.Module, device: torch.device, aliases: dict[int, Any]) -> None:
    """Point a metric copy's parameters and buffers at the module's, as every replica's: its state is its own."""
    if source["_parameters"]:
        shell._parameters = _replica_parameters_of(source["_parameters"], device, aliases)  # type: ignore[assignment]
    if source["_buffers"]:
        shell._buffers = {
            name: None if buffer is None else _buffer_copy(buffer, device, first=False)
            for name, buffer in source["_buffers"].items()
        }


def _reusable(original: nn.Module) -> bool:
    # A class's own __setattr__ may keep caches that only a fresh shell gets right; torch.compile's wrapper holds no
    # parameters of its own, so its __setattr__ never runs on a replica.
    custom = type(original).__setattr__ is not nn.Module.__setattr__
    if custom and not _compat.is_compiled_wrapper(original):
        return False
    return not _compat.has_own_replication(original)


def _shell(original: nn.Module) -> nn.Module:
    """A shallow copy of ``original`` with its own ``_parameters``/``_buffers``/``_modules`` dicts.

    Built by writing the instance dict directly, never through the class's ``__setattr__``, which modules such as
    torch.compile's wrapper redirect into the module they wrap; classes with their own replication hook use it.
    """
    if _compat.has_own_replication(original):
        return _compat.own_replica(original)
    shell = type(original).__new__(type(original))
    object.__setattr__(shell, "__dict__", {})
    _refresh(original, shell)
    return shell


def _refresh(original: nn.Module, shell: nn.Module) -> None:
    """What ``nn.Module._replicate_for_data_parallel`` does, into an existing shell."""
    state = shell.__dict__
    state.clear()
    state.update(original.__dict__)
    state["_parameters"] = {}
    state["_buffers"] = dict(original._buffers)
    state["_modules"] = dict(original._modules)
    state[_compat.REPLICA_FLAG] = True


def _wire(
    original: nn.Module,
    shell: nn.Module,
    shells: list[nn.Module],
    position: dict[int, int],
    device: torch.device,
    aliases: dict[int, torch.Tensor],
    first: bool,
) -> None:
    """Point a fresh shell's children, parameters and buffers at replica ``shells`` and tensors on ``device``."""
    for name, child in original._modules.items():
        shell._modules[name] = None if child is None else shells[position[id(child)]]
    parameters = _replica_parameters_of(original._parameters, device, aliases)
    for name, alias in parameters.items():
        if alias is not None:
            # A class with its own __setattr__ may keep caches of its weights (RNNs' flat weights): setting the
            # attribute keeps them in step, as torch's replicate does, before the alias moves to ``_parameters``.
            setattr(shell, name, alias)
            shell.__dict__.pop(name, None)
    shell._parameters.update(parameters)  # type: ignore[arg-type]
    for name, buffer in original._buffers.items():
        shell._buffers[name] = None if buffer is None else _buffer_copy(buffer, device, first)


def _bind_compiled(original: nn.Module, shell: nn.Module) -> None:
    """Make a replica of a compiled module run compiled on the replica's own tensors, not the original's."""
    if _compat.is_compiled_wrapper(original):
        _compat.bind_compiled_wrapper(shell)
    compiled = _compat.compiled_call(original)
    if compiled is None:
        return
    rebound = _compat.recompile_call(compiled, shell)
    if rebound is None:
        warnings.warn(
            f"{type(original).__name__} was compiled in place with .compile(), and this torch does not let its"
            " replicas be compiled the same way, so they run it uncompiled (same results, without the speed-up)."
            " Use torch.compile(module) instead of module.compile() to keep replicas compiled.",
            UserWarning,
            stacklevel=4,
        )
    _compat.set_compiled_call(shell, rebound)


def _replica_parameters_of(
    own: dict[str, Any], device: torch.device, aliases: dict[int, torch.Tensor]
) -> dict[str, torch.Tensor | None]:
    """A module's ``_parameters`` for a replica on ``device``: one alias per distinct parameter, kept in ``aliases``."""
    parameters: dict[str, torch.Tensor | None] = {}
    for name, param in own.items():
        if param is None:
            parameters[name] = None
            continue
        alias = aliases.get(id(param))
        if alias is None:
            alias = aliases[id(param)] = _parameter_alias(param, device)
        parameters[name] = alias
    return parameters


def _aliases_of(originals: list[nn.Module]) -> dict[int, torch.Tensor]:
    """One alias per distinct parameter of ``originals`` (by ``id``), for a replica on the parameters' own device."""
    distinct: dict[int, torch.Tensor] = {}
    for original in originals:
        for param in original._parameters.values():
            if param is not None:
                distinct[id(param)] = param
    return dict(zip(distinct, replica_parameters(list(distinct.values())), strict=True))


def replica_parameters(params: list[torch.Tensor]) -> Sequence[torch.Tensor]:
    """Aliases of ``params`` for one replica, made by a single autograd node when gradients are recorded.

    A replica's parameters must be tensors of their own whose gradients flow back to the originals, as the
    outputs of torch's ``Broadcast`` are in ``torch.nn.DataParallel``. An alias per parameter (``aten.alias``)
    costs one autograd node per parameter per replica, each run in the backward pass; one node for all of a
    replica's parameters halves that for a module with many (see benchmarks/README.md). A module with few keeps an
    alias each, which costs less than the one node's fixed price.
    """
    if torch.is_grad_enabled() and sum(param.requires_grad for param in params) >= _ONE_NODE_FROM:
        return _ReplicaParameters.apply(*params)
    return [_alias(param) for param in params]


_ONE_NODE_FROM = 4
"""From this many trainable parameters on, one node costs less than an alias each (about 6 us against 3 us each)."""


class _ReplicaParameters(torch.autograd.Function):
    """Identity on a replica's parameters: tensors sharing their storage, gradients passed through untouched.

    Passed through untouched, sparse gradients (``nn.Embedding(sparse=True)``) reach the parameters as on one
    device, a parameter that a replica leaves unused gets no gradient from it (not a zero one), and the backward
    pass stays differentiable for double backward.
    """

    @staticmethod
    def forward(ctx: Any, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)
        aliases = tuple([param.detach() for param in params])
        frozen = [alias for alias, param in zip(aliases, params, strict=True) if not param.requires_grad]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return aliases

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        return grads

    @staticmethod
    def jvp(ctx: Any, *tangents: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        return tangents


# ``alias`` rather than ``view_as``: its backward passes the gradient through untouched, so sparse gradients
# (nn.Embedding(sparse=True)) reach the parameter as they do on one device. Used for replicas of modules with few
# trainable parameters, where no gradient is recorded, and for a parameter already on a replica's device when
# others are not.
_alias = _compat.alias


def _parameter_alias(param: torch.Tensor, device: torch.device) -> torch.Tensor:
    if param.device == device:
        return _alias(param)
    return param.to(device, non_blocking=True)


def _buffer_copy(buffer: torch.Tensor, device: torch.device, first: bool) -> torch.Tensor:
    if buffer.device == device:
        return buffer if first else buffer.clone()
    return buffer.to(device, non_blocking=True, copy=True)
