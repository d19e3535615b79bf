"""Gather the replicas' outputs on the root device, in batch order: the inverse of ``scatter``."""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lightning_mgpu.engine.scatter import (
    Fields,
    Fit,
    LayoutMemory,
    PerSample,
    combine_fits,
    field_values,
    is_dataclass_instance,
    is_namedtuple,
    move_to,
    rebuild_dataclass,
    rebuild_mapping,
    rebuild_sequence,
)
from lightning_mgpu.errors import GatherError

_FIX = (
    "Return only tensors, Python numbers, None, or dicts, lists, tuples, namedtuples and dataclasses of them from"
    " the step, so the outputs of every replica can be merged; a list of other values (such as names) is"
    " concatenated when it holds one item per row of the replica's chunk, or when it is a lightning_mgpu.PerSample."
)


# How a list item would merge if the list were gathered item by item: like rows or a per-replica value, as no
# tensor (None, numbers), not at all (a string, a tensor whose rows are not the chunk's), or as a PerSample or
# Fields, which a step returns only for whole-batch data (so the list around it is gathered item by item).


def gather(
    outputs: Sequence[Any],
    device: torch.device,
    sizes: Sequence[int] | None = None,
    *,
    memory: LayoutMemory | None = None,
    path: str = "output",
) -> Any:
    """Merge one output per replica into one output on ``device``, in batch order.

    Tensors are concatenated along dim 0; 0-dim tensors and Python numbers become one element per replica;
    mappings, dataclasses, namedtuples, ``Fields`` and other lists and tuples are gathered leaf by leaf and keep
    their type; ``None`` stays ``None``; dtypes are kept. A ``PerSample`` is concatenated item by item, and so is
    a plain list or tuple with one item per row of every replica's chunk (``sizes``) whose items could not be
    gathered one by one (names, per-sample tensors of other lengths): what ``scatter`` split by items comes back
    whole. Such a list whose items would merge either way is read as ``memory`` recorded for its key path.

    Args:
        outputs: one output per replica, in batch order.
        device: where the gathered tensors go.
        sizes: the rows each replica received; without them only ``PerSample`` lists are concatenated.
        memory: the readings of this output's lists in earlier steps, updated with this step's.
        path: the key path named in errors.

    Raises:
        GatherError: a leaf that cannot be gathered, or replicas whose outputs differ in structure. The message
            names the key path and the replica.
    """
    return _gather(outputs, device, None if sizes is None else list(sizes), memory, path)


def _gather(
    outputs: Sequence[Any], device: torch.device, sizes: list[int] | None, memory: LayoutMemory | None, path: str
) -> Any:
    first = outputs[0]
    _check_same_kind(outputs, path)
    if first is None:
        return None
    if isinstance(first, torch.Tensor):
        return _gather_tensors(outputs, device, path)
    if isinstance(first, numbers.Number):
        return torch.tensor(list(outputs), device=device)
    if isinstance(first, Mapping):
        keys = list(first.keys())
        for index, output in enumerate(outputs):
            if list(output.keys()) != keys:
                raise GatherError(
                    f"{path} of replica {index} has keys {list(output.keys())} but replica 0 returned {keys}."
                    " Return the same keys from every replica (use None for a missing value).",
                    path,
                    index,
                )
        items = [
            (key, _gather([output[key] for output in outputs], device, sizes, memory, f"{path}[{key!r}]"))
            for key in keys
        ]
        return rebuild_mapping(first, items, path)
    if is_dataclass_instance(first):
        return _gather_dataclass(outputs, device, sizes, memory, path)
    if isinstance(first, PerSample) or (
        sizes is not None
        and not is_namedtuple(first)
        and not isinstance(first, Fields)
        and _one_item_per_row(outputs, sizes, memory, path)
    ):
        items = [item for output in outputs for item in output]
        return rebuild_sequence(first, [move_to(item, device, f"{path}[{i}]") for i, item in enumerate(items)])
    lengths = [len(output) for output in outputs]
    if len(set(lengths)) > 1:
        if sizes is None:
            readings = "when every replica returns the same number of items"
        else:
            readings = (
                f"when every replica returns the same number of items, or concatenated when every replica returns one"
                f" item per row of its chunk (chunks of {sizes} rows)"
            )
        raise GatherError(
            f"{path} has {lengths} items in the replicas. A list or tuple is gathered item by item {readings}; return"
            " one of those, or wrap the list in lightning_mgpu.PerSample(...) to concatenate lists of any length.",
            path,
        )
    items = [
        _gather([output[i] for output in outputs], device, sizes, memory, f"{path}[{i}]") for i in range(lengths[0])
    ]
    return type(first)(*items) if is_namedtuple(first) else rebuild_sequence(first, items)


def _gather_dataclass(
    outputs: Sequence[Any], device: torch.device, sizes: list[int] | None, memory: LayoutMemory | None, path: str
) -> Any:
    first = outputs[0]
    for index, output in enumerate(outputs):
        if type(output) is not type(first):
            raise GatherError(
                f"{path} is a {_kind(first)} in replica 0 but a {_kind(output)} in replica {index}."
                " Return the same structure from every replica.",
                path,
                index,
            )
    names = [name for name, _ in field_values(first)]
    values = []
    for name in names:
        column = [getattr(output, name, None) for output in outputs]
        values.append((name, _gather(column, device, sizes, memory, f"{path}.{name}")))
    return rebuild_dataclass(first, values)


def _one_item_per_row(outputs: Sequence[Any], sizes: list[int], memory: LayoutMemory | None, path: str) -> bool:
    """Whether a plain list or tuple holds one item per row of every replica's chunk and is to be concatenated."""
    lengths = [len(output) for output in outputs]
    remembered = memory.recall(path) if memory is not None else None
    if lengths != sizes:
        if remembered:
            raise GatherError(
                f"{path} was concatenated as one item per row in an earlier step, but now the replicas return"
                f" {lengths} items for chunks of {sizes} rows. Return one item per row in every step; a list of"
                " values of its own is gathered item by item when wrapped in lightning_mgpu.Fields(...).",
                path,
            )
        if memory is not None and remembered is None:
            memory.remember(path, False)
        return False
    if remembered is not None:
        return remembered
    if len(set(lengths)) > 1:
        per_row = True  # item by item needs the same length in every replica
    else:
        fits = {_fit(item, size) for output, size in zip(outputs, sizes, strict=True) for item in output}
        if Fit.MARKED in fits:
            per_row = False
        elif Fit.CONFLICT in fits or Fit.ROWS not in fits:
            per_row = True  # items that cannot be gathered one by one, or values such as ids: one per row
        else:
            # Tensors with the chunk's rows (``logits, features`` or an LSTM's ``out, (h, c)``) are gathered item by
            # item, as torch.nn.DataParallel gathers them; one tensor per sample is returned as a PerSample.
            per_row = False
    if memory is not None:
        memory.remember(path, per_row)
    return per_row


def _fit(obj: Any, rows: int) -> Fit:
    """How ``obj`` would merge as an item of a list gathered item by item, in a replica with ``rows`` rows."""
    if isinstance(obj, torch.Tensor):
        return Fit.ROWS if obj.dim() == 0 or obj.shape[0] == rows else Fit.CONFLICT
    if obj is None or _category(obj) == "number":
        return Fit.FREE
    if isinstance(obj, (PerSample, Fields)):
        return Fit.MARKED
    if isinstance(obj, Mapping):
        return combine_fits(_fit(value, rows) for value in obj.values())
    if is_dataclass_instance(obj):
        return combine_fits(_fit(value, rows) for _, value in field_values(obj))
    if isinstance(obj, (list, tuple)):
        fits = [_fit(value, rows) for value in obj]
        if len(obj) == rows and not is_namedtuple(obj) and Fit.MARKED not in fits:
            return Fit.ROWS if _holds_tensor(obj) else Fit.FREE  # it merges either way, as rows or as items
        return combine_fits(fits)
    return Fit.CONFLICT


def _holds_tensor(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, Mapping):
        return any(_holds_tensor(value) for value in obj.values())
    if is_dataclass_instance(obj):
        return any(_holds_tensor(value) for _, value in field_values(obj))
    if isinstance(obj, (list, tuple)):
        return any(_holds_tensor(value) for value in obj)
    return False


def _gather_tensors(tensors: Sequence[torch.Tensor], device: torch.device, path: str) -> torch.Tensor:
    dims = [tensor.dim() for tensor in tensors]
    if 0 in dims and any(dims):
        raise GatherError(
            f"{path} is 0-dim in some replicas and not in others (dims {dims}); return the same shape from every"
            " replica.",
            path,
        )
    moved = [tensor if tensor.device == device else tensor.to(device) for tensor in tensors]
    if dims[0] == 0:
        return torch.stack(moved)
    trailing = {tuple(tensor.shape[1:]) for tensor in tensors}
    if len(trailing) > 1:
        shapes = [tuple(tensor.shape) for tensor in tensors]
        raise GatherError(
            f"{path} has shapes {shapes} in the replicas, which differ beyond dim 0, so they cannot be concatenated"
            " along the batch dimension. Pad them to a common shape, or reduce them in the step.",
            path,
        )
    return torch.cat(moved)


def _check_same_kind(outputs: Sequence[Any], path: str) -> None:
    expected = _category(outputs[0])
    for index, output in enumerate(outputs):
        category = _category(output)
        if category == "other":
            raise GatherError(
                f"{path} in replica {index} is a {_kind(output)}, which cannot be merged across replicas. {_FIX}",
                path,
                index,
            )
        if category != expected:
            raise GatherError(
                f"{path} is a {_kind(outputs[0])} in replica 0 but a {_kind(output)} in replica {index}."
                " Return the same structure from every replica.",
                path,
                index,
            )


def _category(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, bool) or isinstance(value, numbers.Number) and not isinstance(value, complex):
        return "number"
    if isinstance(value, Mapping):
        return "mapping"
    if is_dataclass_instance(value):
        return "dataclass"
    if isinstance(value, (list, tuple)):
        return "sequence"
    return "other"


def _kind(value: Any) -> str:
    if is_dataclass_instance(value):
        return f"dataclass {type(value).__name__}"
    return f"{type(value).__name__} ({value!r:.40})"
