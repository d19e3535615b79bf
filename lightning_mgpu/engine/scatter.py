"""Split a batch along dim 0 into one chunk per replica."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lightning_mgpu.errors import BatchSplitError


def chunk_sizes(batch_size: int, num_devices: int) -> list[int]:
    """Sizes that differ by at most one, one per replica; fewer replicas when the batch is smaller.

    ``torch.chunk`` would give 5 rows on 4 devices as 2 + 2 + 1 (three replicas); this gives 2 + 1 + 1 + 1.
    """
    if batch_size < 1:
        raise BatchSplitError(
            "The batch is empty (0 rows along dim 0), so there is nothing to split across replicas."
            " Drop empty batches in your DataLoader or dataset."
        )
    num_chunks = min(batch_size, num_devices)
    base, extra = divmod(batch_size, num_chunks)
    return [base + 1 if i < extra else base for i in range(num_chunks)]


def batch_size_of(batch: Any) -> int:
    """The common length along dim 0 of every tensor in ``batch``; raises if they disagree or there is none."""
    sizes: dict[str, int] = {}
    _collect_sizes(batch, "batch", sizes)
    if not sizes:
        raise BatchSplitError(
            f"mgpu_dp splits the batch along dim 0, but the batch ({type(batch).__name__}) holds no tensor with a"
            " batch dimension. Return tensors from your DataLoader (its default collate does), or use a"
            " single-device strategy for this model."
        )
    distinct = set(sizes.values())
    if len(distinct) > 1:
        listing = ", ".join(f"{path}: {size}" for path, size in sizes.items())
        raise BatchSplitError(
            f"The tensors in the batch disagree on their size along dim 0 ({listing}), so the batch cannot be split"
            " into matching chunks per replica. Make every tensor in the batch hold one row per sample, or move"
            " per-batch data out of the batch (for example into the LightningModule)."
        )
    return distinct.pop()


def scatter(batch: Any, devices: Sequence[torch.device]) -> tuple[list[Any], list[int]]:
    """Split ``batch`` into chunks for the first ``len(sizes)`` devices, each moved to its device.

    Tensors are split along dim 0, containers keep their type, lists of strings whose length is the batch size
    are split with the rows they describe, and any other value is given whole to every replica.

    Returns:
        The chunks and their sizes along dim 0.
    """
    total = batch_size_of(batch)
    sizes = chunk_sizes(total, len(devices))
    chunks = [
        _take(batch, start, size, total, device)
        for start, size, device in zip(_starts(sizes), sizes, devices[: len(sizes)], strict=True)
    ]
    return chunks, sizes


def _starts(sizes: list[int]) -> list[int]:
    starts, offset = [], 0
    for size in sizes:
        starts.append(offset)
        offset += size
    return starts


def _is_per_sample_strings(obj: Any) -> bool:
    return isinstance(obj, (list, tuple)) and len(obj) > 0 and all(isinstance(item, (str, bytes)) for item in obj)


def _collect_sizes(obj: Any, path: str, sizes: dict[str, int]) -> None:
    if isinstance(obj, torch.Tensor):
        if obj.dim() == 0:
            raise BatchSplitError(
                f"{path} is a 0-dim tensor, which has no batch dimension to split across replicas."
                " Give it a leading batch dimension, or move it out of the batch."
            )
        sizes[path] = obj.shape[0]
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            _collect_sizes(value, f"{path}[{key!r}]", sizes)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            _collect_sizes(getattr(obj, field.name), f"{path}.{field.name}", sizes)
    elif isinstance(obj, (list, tuple)) and not _is_per_sample_strings(obj):
        for index, value in enumerate(obj):
            _collect_sizes(value, f"{path}[{index}]", sizes)


def _take(obj: Any, start: int, size: int, total: int, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.narrow(0, start, size).to(device, non_blocking=True)
    if isinstance(obj, Mapping):
        items = [(key, _take(value, start, size, total, device)) for key, value in obj.items()]
        return _rebuild_mapping(obj, items)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: _take(getattr(obj, f.name), start, size, total, device) for f in dataclasses.fields(obj)}
        return dataclasses.replace(obj, **changes)
    if _is_per_sample_strings(obj):
        return type(obj)(obj[start : start + size]) if len(obj) == total else obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_take(value, start, size, total, device) for value in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_take(value, start, size, total, device) for value in obj)
    return obj


def _rebuild_mapping(original: Mapping, items: list[tuple[Any, Any]]) -> Mapping:
    try:
        return type(original)(items)  # type: ignore[call-arg]
    except TypeError:
        return dict(items)
