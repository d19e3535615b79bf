"""Buffers a step changes inside two or more replicas: the same change once, any other refused, module unchanged.

Each replica, the first included, works on copies of the module's buffers while others run beside it, so no two
threads write to one tensor and the module keeps its values until every replica has finished. A buffer that every
replica left as the same value (a counter, ``num_batches_tracked``, BatchNorm's running statistics, which the exact
BatchNorm makes equal) goes into the module once, in place where the replicas changed it in place; a buffer the
replicas left at different values (a running mean of each replica's own rows) is refused with ``ReplicaStateError``,
since one device's value cannot be told from chunks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from lightning_mgpu._compat import BatchNorm, copy_all_, version_counter
from lightning_mgpu.errors import ReplicaStateError
from lightning_mgpu.replica_state.parameters import difference, same_values

_FIX = (
    "Update it where self is the module itself and the whole batch is at hand: training_step_end (or the matching"
    " *_step_end hook) or on_train_batch_end"
)
_MISSING = object()


class BufferStarts:
    """One replica's buffers as its call begins: each module's shell, with every buffer and its version counter."""

    __slots__ = ("entries", "tensor_ids")

    def __init__(self) -> None:
        self.entries: list[tuple[nn.Module, nn.Module, list[tuple[str, torch.Tensor | None, int]]]] = []
        self.tensor_ids: set[int] = set()
        """The ``id`` of each buffer copy recorded: the replica's own, alive for the call, written without a check."""

    def add(self, original: nn.Module, shell: nn.Module) -> None:
        """Record ``shell``'s buffers (``original``'s copies) before the call runs."""
        buffers = shell._buffers.items()
        versions = [(name, buffer, -1 if buffer is None else version_counter(buffer)) for name, buffer in buffers]
        self.entries.append((original, shell, versions))
        self.tensor_ids.update(map(id, shell._buffers.values()))


Update = tuple[nn.Module, str, object, bool]
"""A buffer to write after the call: the module, the buffer's name, its value (or removed), whether in place."""


def settle_buffers(
    starts: Sequence[BufferStarts], names: dict[int, str], step: str, per_replica_batchnorm: bool = False
) -> list[Update]:
    """What to write into the module's buffers after a call of several replicas, or ``ReplicaStateError``.

    A buffer counts as changed in a replica when the replica rebound it or changed it in place (its version counter
    moved). torch's batch-norm kernel updates running statistics without moving the counter; with the exact
    BatchNorm the package updates them itself, through ops that move it, and with ``per_replica_batchnorm`` a
    BatchNorm layer's buffers are taken from the first replica as they are and other buffers compared by value.
    Nothing is written here, so that a refusal elsewhere in the same step leaves the module unchanged too.

    Args:
        starts: each replica's, in batch order, recorded over the same modules in the same order.
        names: each module's path in the model, by ``id``.
        step: the method the replicas ran, for messages.
        per_replica_batchnorm: BatchNorm layers normalise each chunk by its own statistics
            (``sync_batchnorm=False``), and keep the first replica's running statistics, as ``torch.nn.DataParallel``
            does.

    Returns:
        ``(module, name, value, in_place)`` for each changed buffer; apply them with ``store_buffers``.
    """
    changed_buffers: list[tuple[nn.Module, str, list[object], bool, bool]] = []
    first = starts[0].entries
    for position, (original, _, recorded) in enumerate(first):
        first_kept = per_replica_batchnorm and isinstance(original, BatchNorm)
        for slot, (name, _, _) in enumerate(recorded):
            finals: list[object] = []
            rebound, changed = False, first_kept
            for replica in starts:
                _, shell, buffers = replica.entries[position]
                _, start, version = buffers[slot]
                final = shell._buffers.get(name, _MISSING)
                if final is not start:
                    rebound = changed = True
                elif start is not None and not changed:
                    own = original._buffers.get(name)
                    changed = _changed_in_place(start, -1 if per_replica_batchnorm else version, own)
                finals.append(final)
            if changed:
                changed_buffers.append((original, name, finals, rebound, first_kept))
    if not _all_alike([finals for _, _, finals, _, first_kept in changed_buffers if not first_kept]):
        for original, name, finals, _, first_kept in changed_buffers:  # the first that differs, named
            if not first_kept:
                _refuse_unlike(finals, f"self.{_buffer_path(names.get(id(original), ''), name)}", step)
    return [(original, name, finals[0], not rebound) for original, name, finals, rebound, _ in changed_buffers]


def store_buffers(updates: list[Update]) -> None:
    """Write what ``settle_buffers`` returned into the module, in place where the replicas changed it in place."""
    targets, values = [], []
    for module, name, value, in_place in updates:
        own = module._buffers.get(name)
        if value is _MISSING:
            del module._buffers[name]
        elif in_place and own is not None and isinstance(value, torch.Tensor) and _fits(own, value):
            targets.append(own)
            values.append(value)
        elif isinstance(value, torch.Tensor) and own is not None:
            module._buffers[name] = value.to(own.device)
        else:
            module._buffers[name] = value  # type: ignore[assignment]
    if targets:
        copy_all_(targets, values)


def _all_alike(values: list[list[object]]) -> bool:
    """Whether every replica left each buffer alike, checked with one comparison per dtype, device and shape.

    Each comparison is one call into torch (one device synchronisation on a GPU) over the buffers stacked: a net's
    BatchNorm layers of one width are one comparison for their statistics and one for their counts.
    """
    groups: dict[tuple[torch.dtype, torch.device, torch.Size], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for finals in values:
        first = finals[0]
        for final in finals[1:]:
            if final is first:
                continue
            if not (
                isinstance(first, torch.Tensor)
                and isinstance(final, torch.Tensor)
                and final.shape == first.shape
                and final.dtype == first.dtype
            ):
                return False
            lefts, rights = groups.setdefault((first.dtype, first.device, first.shape), ([], []))
            lefts.append(first)
            # A replica on another GPU: compared on the first's.
            rights.append(final if final.device == first.device else final.to(first.device))
    return all(same_values(torch.stack(lefts), torch.stack(rights)) for lefts, rights in groups.values())


def _refuse_unlike(finals: list[object], path: str, step: str) -> None:
    """``ReplicaStateError`` naming the first replica that left the buffer other than replica 0 did, if one did."""
    first = finals[0]
    for index, final in enumerate(finals[1:], start=1):
        if final is first:
            continue
        if isinstance(first, torch.Tensor) and isinstance(final, torch.Tensor):
            unlike = difference(first, final)
            if unlike is None:
                continue
        else:
            unlike = f"{_kind(first)} against {_kind(final)}"
        raise ReplicaStateError(
            f"{step} changed the buffer {path} inside the replicas, and replicas 0 and {index} left it at different"
            f" values ({unlike}), as a buffer updated from each replica's own rows is, so one device's value cannot"
            f" be told; the module's buffer is unchanged. {_FIX}.",
            path,
            step,
            buffer=True,
        )


def _changed_in_place(copy: torch.Tensor, version: int, own: torch.Tensor | None) -> bool:
    """Whether a replica changed its copy of a buffer in place; the module's own buffer still holds the value copied.

    A copy made in inference mode (Lightning's evaluation loops) keeps no version counter, so its value is compared.
    """
    if version != -1:
        return version_counter(copy) != version
    return own is None or not same_values(copy, own.to(copy.device))


def _kind(value: object) -> str:
    if value is _MISSING:
        return "removed"
    if value is None:
        return "None"
    return f"a tensor {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__


def _fits(own: torch.Tensor, value: torch.Tensor) -> bool:
    return own.shape == value.shape and own.dtype == value.dtype


def _buffer_path(module: str, name: str) -> str:
    return f"{module}.{name}" if module else name
