"""Plain Python state inside replicas: each replica gets copies of the module's lists, dicts and sets.

Replicas are threads that share whatever their module's attributes point to. A step that appends to ``self.outputs``
would append every replica's rows to one list, in whatever order the threads ran. So before a call, each replica gets
its own copy of every list, dict, set and tuple that the model's own code keeps in an attribute (a library's are the
library's to handle: ``lightning_mgpu.library_code``), nested ones included, with the modules, parameters and buffers
inside replaced by the replica's own. After the call, in the calling thread, each copy is compared with what it held:

- a list to which every replica appended the same number of items, each holding rows of the replica's chunk only
  (tensors with its rows, or containers of them), gets the items gathered across the replicas in batch order, one
  per append, which is what one device appends for the whole batch;
- a set that the replicas only added to gets their additions, whatever their order, and a dict the keys they added,
  where every replica that added a key gave it the same value (values per sample, or a cache each replica fills);
- anything else changed (another append, a dict's key changed, removed or given different values, an item
  replaced) raises ``ReplicaStateError`` naming the attribute and the fix, and so does a plain tensor attribute
  changed in place, which every replica shares.

Reassigned attributes (``self.count += 1``) live on the replica alone and are dropped after the call, as with
``torch.nn.DataParallel``; the ``mgpu_dp`` strategy warns about them.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import operator
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lightning_mgpu._compat import version_counter
from lightning_mgpu.engine.gather import gather
from lightning_mgpu.engine.reduce import weighted_mean
from lightning_mgpu.engine.scatter import PerSample, is_dataclass_instance, move_to
from lightning_mgpu.errors import ReplicaStateError

Remap = Callable[[Any], Any]
"""The replica's own counterpart of a module, parameter or buffer of the module, or ``None`` for anything else."""

_MUTABLE = (list, dict, set)
_ATOMS = (str, bytes, int, float, bool, type(None))
_FIX = (
    "Return the values from the step instead: the matching *_step_end hook receives every replica's, gathered in"
    " batch order, and there self is the module itself"
)


class Isolated:
    """What one replica was given in place of the module's containers and plain tensors, to compare after the call."""

    def __init__(self) -> None:
        self.lists: list[tuple[str, list[Any], list[Any], list[Any]]] = []
        """(path, the module's list, the replica's copy, what the copy held when given)."""
        self.sets: list[tuple[str, set[Any], set[Any], set[Any]]] = []
        self.dicts: list[tuple[str, dict[Any, Any], dict[Any, Any], dict[Any, Any]]] = []
        self.tensors: list[tuple[str, torch.Tensor, int]] = []
        """(path, a plain tensor every replica shares, its version counter when given)."""


def isolate(state: dict[str, Any], names: Iterable[str], prefix: str, remap: Remap, into: Isolated) -> None:
    """Replace, in a replica's ``state`` (its instance dict), the containers of attributes ``names`` by copies.

    ``prefix`` is the module's path (``"self"``, ``"self.encoder"``); ``remap`` gives the replica's own module,
    parameter or buffer for the module's.
    """
    for name in names:
        value = state[name]
        if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
            replica = remap(value)
            if replica is None:
                into.tensors.append((f"{prefix}.{name}", value, version_counter(value)))
                continue
        state[name] = _copy(value, f"{prefix}.{name}", remap, into, 0)


_DEPTH = 6
"""How deep containers are copied; deeper ones are shared, as everything else an attribute points to is."""


def _copy(value: Any, path: str, remap: Remap, into: Isolated, depth: int) -> Any:
    if isinstance(value, _ATOMS):
        return value
    if isinstance(value, (nn.Module, torch.Tensor)):
        replica = remap(value)
        return value if replica is None else replica
    if depth > _DEPTH or isinstance(value, PerSample):
        return value
    if isinstance(value, types.MethodType):
        owner = remap(value.__self__) if isinstance(value.__self__, nn.Module) else None
        return value if owner is None else types.MethodType(value.__func__, owner)
    if isinstance(value, functools.partial):
        return _rebound_partial(value, path, remap, into, depth)
    if isinstance(value, (list, dict)):
        copied: Any = copy.copy(value)
        for key, item in value.items() if isinstance(value, dict) else enumerate(value):
            if not isinstance(item, _ATOMS):
                new = _copy(item, f"{path}[{key!r}]", remap, into, depth + 1)
                if new is not item:
                    copied[key] = new
        if isinstance(value, dict):
            into.dicts.append((path, value, copied, dict(copied)))
        else:
            into.lists.append((path, value, copied, list(copied)))
        return copied
    if isinstance(value, set):
        members = copy.copy(value)
        into.sets.append((path, value, members, set(members)))
        return members
    if isinstance(value, tuple):
        items = [_copy(item, f"{path}[{index}]", remap, into, depth + 1) for index, item in enumerate(value)]
        if all(new is old for new, old in zip(items, value, strict=True)):
            return value
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value


def _rebound_partial(value: functools.partial[Any], path: str, remap: Remap, into: Isolated, depth: int) -> Any:
    """A ``functools.partial`` over the replica's own methods, modules and containers, as the step would call it."""
    func = _copy(value.func, f"{path}.func", remap, into, depth + 1)
    args = [_copy(item, f"{path}.args[{index}]", remap, into, depth + 1) for index, item in enumerate(value.args)]
    keywords = {
        key: _copy(item, f"{path}.keywords[{key!r}]", remap, into, depth + 1) for key, item in value.keywords.items()
    }
    if (
        func is value.func
        and all(map(operator.is_, args, value.args))
        and all(keywords[key] is item for key, item in value.keywords.items())
    ):
        return value
    return functools.partial(func, *args, **keywords)


def combine(replicas: Sequence[Isolated], sizes: Sequence[int] | None, device: torch.device, step: str) -> None:
    """Put back into the module, in batch order, what the replicas changed in their copies, or refuse it.

    Args:
        replicas: what each replica that ran was given, in batch order.
        sizes: the rows each replica received; without them no append can be shown to hold rows.
        device: where appended items are gathered.
        step: the method the replicas ran, for messages.
    """
    for column in zip(*(replica.tensors for replica in replicas), strict=True):
        path, tensor, version = column[0]
        if version_counter(tensor) != version:
            raise ReplicaStateError(
                f"{step} changed {path} in place inside the replicas. It is a plain tensor attribute, neither a"
                " parameter nor a buffer, so every replica changed the one tensor, in whatever order their threads"
                " ran. Register it as a buffer (self.register_buffer), whose changes replica 0 keeps as on one"
                f" device for values the whole batch shares, or change it after the step. {_FIX}.",
                path,
                step,
            )
    for column in zip(*(replica.dicts for replica in replicas), strict=True):
        _combine_additions(column, device, step)
    for column in zip(*(replica.sets for replica in replicas), strict=True):
        path, original = column[0][0], column[0][1]
        if any(not given <= copied for _, _, copied, given in column):
            raise ReplicaStateError(
                f"{step} removed items from the set {path} inside the replicas, where each has a copy of its own."
                f" {_FIX}.",
                path,
                step,
            )
        for _, _, copied, given in column:
            original.update(copied - given)
    for column in zip(*(replica.lists for replica in replicas), strict=True):
        _combine_appends(column, sizes, device, step)


def _combine_additions(
    column: Sequence[tuple[str, dict[Any, Any], dict[Any, Any], dict[Any, Any]]], device: torch.device, step: str
) -> None:
    """The keys the replicas added to a dict, each with the one value they agree on, go into the module's dict.

    Keys per sample (``self.losses[sample_id] = ...``) add up to one device's dict, and a cache the replicas each
    fill (``self.masks[shape] = ...``) gets every entry, and sets or dicts the replicas created at one key are
    merged; a key whose value the replicas disagree on otherwise, or a key the dict had that a replica changed or
    removed, has no one device's value.
    """
    path, original = column[0][0], column[0][1]
    added: dict[Any, Any] = {}
    for _, _, copied, given in column:
        if any(key not in copied or copied[key] is not value for key, value in given.items()):
            raise ReplicaStateError(
                f"{step} changed or removed a key of the dict {path} inside the replicas, where each has a copy of"
                f" its own, so one device's dict cannot be told from theirs. {_FIX}.",
                path,
                step,
            )
        for key, value in copied.items():
            if key in given:
                continue
            value = move_to(value, device)
            if key in added:
                merged = _merged(added[key], value)
                if merged is _MISSING:
                    raise ReplicaStateError(
                        f"{step} set {path}[{key!r}] to different values in different replicas, as a value computed"
                        f" from each replica's rows would be, so one device's value cannot be told. {_FIX}.",
                        f"{path}[{key!r}]",
                        step,
                    )
                value = merged
            added[key] = value
    original.update(added)


_MISSING = object()


def _merged(left: Any, right: Any) -> Any:
    """One value for a key two replicas added: the same value, sets united, dicts merged key by key; else missing.

    Sets and dicts have no order, so what the replicas added to one created at the same key
    (``self.seen.setdefault(batch_idx, set()).add(...)``) is what one device adds to it.
    """
    if isinstance(left, set) and isinstance(right, set) and type(left) is type(right):
        return left | right
    if isinstance(left, dict) and isinstance(right, dict) and type(left) is type(right):
        merged = copy.copy(left)
        for key, value in right.items():
            if key in merged:
                value = _merged(merged[key], value)
                if value is _MISSING:
                    return _MISSING
            merged[key] = value
        return merged
    return left if _same_value(left, right) else _MISSING


def _same_value(left: Any, right: Any) -> bool:
    """Whether two replicas' values are the same value: equal tensors, numbers, strings, or containers of them."""
    if left is right:
        return True
    if isinstance(left, torch.Tensor) and isinstance(right, torch.Tensor):
        return left.shape == right.shape and left.dtype == right.dtype and bool(torch.equal(left, right))
    if isinstance(left, _ATOMS) and type(left) is type(right):
        return bool(left == right)
    if isinstance(left, Mapping) and isinstance(right, Mapping):
        return left.keys() == right.keys() and all(_same_value(left[key], right[key]) for key in left)
    if isinstance(left, (list, tuple)) and type(left) is type(right) and len(left) == len(right):
        return all(_same_value(a, b) for a, b in zip(left, right, strict=True))
    return False


def _combine_appends(
    column: Sequence[tuple[str, list[Any], list[Any], list[Any]]],
    sizes: Sequence[int] | None,
    device: torch.device,
    step: str,
) -> None:
    path, original = column[0][0], column[0][1]
    appended = []
    for _, _, copied, given in column:
        if len(copied) < len(given) or any(new is not old for new, old in zip(copied, given, strict=False)):
            raise ReplicaStateError(
                f"{step} replaced or removed items of the list {path} inside the replicas, where each has a copy of"
                f" its own. {_FIX}.",
                path,
                step,
            )
        appended.append(copied[len(given) :])
    counts = [len(items) for items in appended]
    if not any(counts):
        return
    if len(set(counts)) > 1 or sizes is None:
        raise ReplicaStateError(
            f"{step} appended {counts} items to {path} in the replicas, so one device's appends for the whole batch"
            f" cannot be rebuilt from them. {_FIX}.",
            path,
            step,
        )
    for position in range(counts[0]):
        items = [items[position] for items in appended]
        original.append(combine_values(items, sizes, device, f"{path}[-1]", step, f"appended to {path}"))


def combine_values(
    values: Sequence[Any], sizes: Sequence[int], device: torch.device, path: str, step: str, what: str
) -> Any:
    """One device's value of what each replica computed on its chunk, by the rules that gather step outputs.

    Values with one entry per row of each replica's chunk (tensors, ``PerSample`` lists, containers of them) are
    gathered in batch order; a value every replica computed alike (a flag, a counter, the batch index) is taken
    once; 0-dim floats and floats, a mean over the rows such as a loss, become their mean weighted by the rows.

    Args:
        values: each replica's value, in batch order.
        sizes: the rows each replica received.
        device: where the value is gathered.
        path: how the step's code names the value, for messages.
        step: the method the replicas ran, for messages.
        what: what the step did with the value (``"assigned self.loss"``), for messages.

    Raises:
        ReplicaStateError: for values that none of the rules makes one device's.
    """
    if any(_holds_tensor(value) for value in values) and all(
        _not_rows(value, rows, path) is None for value, rows in zip(values, sizes, strict=True)
    ):
        return gather(list(values), device, list(sizes), path=path)
    first = values[0]
    if all(_same_value(first, value) for value in values[1:]):
        return first
    if all(_is_float_scalar(value) for value in values):
        if isinstance(first, torch.Tensor):
            return weighted_mean(torch.stack([move_to(value, device) for value in values]), list(sizes))
        return sum(float(value) * rows for value, rows in zip(values, sizes, strict=True)) / sum(sizes)
    if isinstance(first, dict) and all(type(value) is type(first) and value.keys() == first.keys() for value in values):
        combined = copy.copy(first)  # a dict of a loss and per-row values: each entry by the rule
        for key in first:
            entries = [value[key] for value in values]
            combined[key] = combine_values(entries, sizes, device, f"{path}[{key!r}]", step, what)
        return combined
    if isinstance(first, (list, tuple)) and all(
        type(value) is type(first) and len(value) == len(first) for value in values
    ):
        items = [
            combine_values([value[index] for value in values], sizes, device, f"{path}[{index}]", step, what)
            for index in range(len(first))
        ]
        return type(first)(*items) if hasattr(first, "_fields") else type(first)(items)
    odd = next(
        (
            f", and in replica {index} {reason}"
            for index, (value, rows) in enumerate(zip(values, sizes, strict=True))
            if _holds_tensor(value) and (reason := _not_rows(value, rows, path)) is not None
        ),
        "",
    )
    raise ReplicaStateError(
        f"{step} {what} inside the replicas, and the replicas' values differ ({_shown(values)}){odd}. Each replica"
        " sees its own rows of the batch, so only values with one entry per row (gathered in batch order), values"
        " every replica computes alike (taken once) and float means over the rows (averaged by rows) give one"
        " device's value; a count or a value of another kind does not. Return it from the step and combine it in"
        " the matching *_step_end hook, where self is the module itself.",
        path,
        step,
    )


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, (torch.Tensor, PerSample)):
        return True
    if isinstance(value, Mapping):
        return any(_holds_tensor(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(item) for item in value)
    return is_dataclass_instance(value) and any(
        _holds_tensor(getattr(value, field.name)) for field in dataclasses.fields(value)
    )


def _is_float_scalar(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dim() == 0 and (value.is_floating_point() or value.is_complex())
    return isinstance(value, float)


def _shown(values: Sequence[Any]) -> str:
    return ", ".join(f"{value!r:.40}" for value in values)


def _not_rows(item: Any, rows: int, path: str) -> str | None:
    """Why ``item`` holds something other than values with one entry per row, or ``None`` when it holds only them."""
    if item is None:
        return None
    if isinstance(item, torch.Tensor):
        if item.dim() == 0 or item.shape[0] != rows:
            return f"{path} is a tensor of shape {tuple(item.shape)}"
        return None
    if isinstance(item, PerSample):
        return None if len(item) == rows else f"{path} is a PerSample of {len(item)} items"
    if isinstance(item, Mapping):
        values: list[tuple[str, Any]] = [(f"{path}[{key!r}]", value) for key, value in item.items()]
    elif is_dataclass_instance(item):
        values = [(f"{path}.{field.name}", getattr(item, field.name)) for field in dataclasses.fields(item)]
    elif isinstance(item, (list, tuple)):
        values = [(f"{path}[{index}]", value) for index, value in enumerate(item)]
    else:
        return f"{path} is a {type(item).__name__} ({item!r:.40})"
    for inner_path, value in values:
        odd = _not_rows(value, rows, inner_path)
        if odd is not None:
            return odd
    return None
