"""Gather the replicas' outputs on the root device, in batch order."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lightning_mgpu.errors import GatherError

_FIX = (
    "Return only tensors, Python numbers, None, or dicts, lists, tuples and namedtuples of them from the step"
    " (the user's trap 3: outputs of every replica must be mergeable)."
)


def gather(outputs: Sequence[Any], device: torch.device, path: str = "output") -> Any:
    """Merge one output per replica into one output on ``device``.

    Tensors are concatenated along dim 0; 0-dim tensors and Python numbers become one element per replica;
    containers are gathered leaf by leaf and keep their type; ``None`` stays ``None``; dtypes are kept.

    Raises:
        GatherError: a leaf that cannot be gathered, or replicas whose outputs differ in structure. The message
            names the key path and the replica.
    """
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
                    " Return the same keys from every replica (use None for a missing value)."
                )
        items = [(key, gather([output[key] for output in outputs], device, f"{path}[{key!r}]")) for key in keys]
        try:
            return type(first)(items)  # type: ignore[call-arg]
        except TypeError:
            return dict(items)
    if isinstance(first, (list, tuple)):
        lengths = {len(output) for output in outputs}
        if len(lengths) > 1:
            raise GatherError(
                f"{path} has a different length in different replicas ({[len(o) for o in outputs]});"
                " return the same number of items from every replica."
            )
        items = [gather([output[i] for output in outputs], device, f"{path}[{i}]") for i in range(len(first))]
        if hasattr(first, "_fields"):
            return type(first)(*items)
        return type(first)(items)
    raise GatherError(f"{path} in replica 0 is a {_kind(first)}, which cannot be merged across replicas. {_FIX}")


def _gather_tensors(tensors: Sequence[torch.Tensor], device: torch.device, path: str) -> torch.Tensor:
    dims = [tensor.dim() for tensor in tensors]
    if 0 in dims and any(dims):
        raise GatherError(
            f"{path} is 0-dim in some replicas and not in others (dims {dims}); return the same shape from every"
            " replica."
        )
    moved = [tensor if tensor.device == device else tensor.to(device) for tensor in tensors]
    if dims[0] == 0:
        return torch.stack(moved)
    trailing = {tuple(tensor.shape[1:]) for tensor in tensors}
    if len(trailing) > 1:
        shapes = [tuple(tensor.shape) for tensor in tensors]
        raise GatherError(
            f"{path} has shapes {shapes} in the replicas, which differ beyond dim 0, so they cannot be concatenated"
            " along the batch dimension. Pad them to a common shape, or reduce them in the step."
        )
    return torch.cat(moved)


def _check_same_kind(outputs: Sequence[Any], path: str) -> None:
    expected = _category(outputs[0])
    for index, output in enumerate(outputs):
        category = _category(output)
        if category == "other":
            raise GatherError(
                f"{path} in replica {index} is a {_kind(output)}, which cannot be merged across replicas. {_FIX}"
            )
        if category != expected:
            raise GatherError(
                f"{path} is a {_kind(outputs[0])} in replica 0 but a {_kind(output)} in replica {index}."
                " Return the same structure from every replica."
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
    if isinstance(value, (list, tuple)) and not isinstance(value, str):
        return "sequence"
    return "other"


def _kind(value: Any) -> str:
    if dataclasses.is_dataclass(value):
        return f"dataclass {type(value).__name__}"
    return f"{type(value).__name__} ({value!r:.40})"
