"""Parameters a replica's step changes in place: each replica writes a copy of its own, the module gets one change.

On the CPU and where a device repeats, a replica's parameters alias the module's storage, so an in-place update made
in the step (a momentum encoder's ``torch._foreach_mul_(target, m)``, ``p.data.mul_(m)``, ``p.data = ...``) would
be applied once per replica, in whatever order their threads ran; on distinct GPUs the replicas hold copies, and only
replica 0's would reach the module. So before a replica first writes to a parameter's storage, its alias gets a
private copy (copy on write), and the step goes on with it, as it would with its own parameter on one device. After
the step, in the calling thread, ``ParameterWrites.settle`` applies one rule: a parameter every replica changed to the
same value gets that value once, which is one device's result; any other change stops the step with
``ReplicaStateError`` before the module has changed.
"""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import torch

from lightning_mgpu.errors import ReplicaStateError

_NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "detach_", "retain_grad_", "record_stream_"})
"""Methods whose names end in ``_`` but that write no element of the tensor."""

_FIX = (
    "Make the change in a hook where self is the module itself, once per step: on_train_batch_start or"
    " on_train_batch_end (a momentum encoder's update), or the matching *_step_end hook"
)


def written_tensors(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors a torch function call writes to in place: its ``out=``, or its first argument for ``x.op_()``."""
    out = kwargs.get("out") if kwargs else None
    if out is not None:
        return list(out) if isinstance(out, (tuple, list)) else [out]
    name = getattr(func, "__name__", "")
    if not (name.endswith("_") and not name.endswith("__")) and name != "__setitem__":
        return []
    if name in _NOT_WRITES or not args:
        return []
    first = args[0]
    if isinstance(first, torch.Tensor):
        return [first]
    if name.startswith("_foreach_") and isinstance(first, (list, tuple)):
        return [tensor for tensor in first if isinstance(tensor, torch.Tensor)]
    return []


class ParameterWrites:
    """One replica's parameters, watched for writes in one call.

    Args:
        aliases: the replica's own tensor for each of the module's parameters, by the parameter's ``id``.
        own_buffers: the ``id`` of each buffer copy of the replica's own, which shares no parameter's storage: a
            write to one needs no check (BatchNorm's ``num_batches_tracked.add_(1)`` in every layer, every step).
    """

    def __init__(self, aliases: dict[int, torch.Tensor], own_buffers: AbstractSet[int] = frozenset()) -> None:
        self.aliases = aliases
        self._own_buffers = own_buffers
        self._original_of: dict[int, int] | None = None
        self._shared: set[int] | None = None
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        """Full views of an alias (its ``.data``, ``.detach()``), by ``id``: (the view, the alias)."""
        self.changed: dict[int, torch.Tensor] = {}
        """The aliases this replica changed, by their parameter's ``id``."""
        self._private: set[int] = set()

    def _originals(self) -> dict[int, int]:
        if self._original_of is None:
            self._original_of = {id(alias): original for original, alias in self.aliases.items()}
        return self._original_of

    def _shared_storages(self) -> set[int]:
        if self._shared is None:
            self._shared = {_storage(alias) for alias in self.aliases.values()} - {0}
        return self._shared

    def viewed(self, source: torch.Tensor, view: torch.Tensor) -> None:
        """``view`` is ``source.data`` or ``source.detach()``: a write to it is a write to ``source``."""
        if id(source) in self._originals():
            self._views[id(view)] = (view, source)

    def assigned(self, alias: torch.Tensor) -> None:
        """``alias.data = value`` ran: the replica's parameter holds another tensor now."""
        original = self._originals().get(id(alias))
        if original is None:
            return
        self.changed[original] = alias
        if _storage(alias) in self._shared_storages():
            self._private.discard(original)  # it shares a parameter's storage again: copy before the next write
        else:
            self._private.add(original)

    def before_write(self, tensors: list[torch.Tensor], name: str, step: str) -> None:
        """Give each alias among ``tensors`` a private copy before it is written; refuse other writes to parameters."""
        for tensor in tensors:
            if id(tensor) in self._own_buffers:
                continue  # the common write: BatchNorm's num_batches_tracked.add_(1), before any map is built
            originals = self._originals()
            original = originals.get(id(tensor))
            if original is not None:
                self._write(original, tensor, direct=True)
                continue
            view = self._views.get(id(tensor))
            if view is not None:
                alias = view[1]
                self._write(originals[id(alias)], alias, direct=False)
                if _storage(tensor) != _storage(alias):
                    tensor.data = alias.data  # a view taken before the copy follows the alias to it
                continue
            storage = _storage(tensor)
            if storage and storage in self._shared_storages():
                raise ReplicaStateError(
                    f"{step} wrote to part of a parameter in place inside the replicas ({name} on a view of it), and"
                    " the replicas share the module's parameters, so every replica would write to the one tensor,"
                    f" in whatever order their threads ran. {_FIX}; or write to the whole parameter (p.mul_(...),"
                    " p.data.mul_(...)), which each replica does on a copy of its own.",
                    "self",
                    step,
                )

    def _write(self, original: int, alias: torch.Tensor, direct: bool) -> None:
        """Replica's own copy of a parameter before a write to it; ``direct``: the write is not through ``.data``."""
        if direct and torch.is_grad_enabled() and alias.requires_grad:
            # As on one device: a parameter is a leaf, and torch refuses to record an in-place change of one.
            raise RuntimeError("a leaf Variable that requires grad is being used in an in-place operation.")
        if original not in self._private:
            with torch.no_grad():
                private = alias.detach().clone()
            alias.data = private
            self._private.add(original)
            for view, source in self._views.values():
                if source is alias:
                    view.data = private
        self.changed[original] = alias


def settle(
    writes: Sequence[ParameterWrites], parameters: dict[int, torch.Tensor], names: dict[int, str], step: str
) -> None:
    """Give the module's parameters what the replicas changed, once, or refuse it before anything changes.

    Args:
        writes: each replica's, in batch order.
        parameters: the module's parameters, by ``id``.
        names: each parameter's name in the module, by ``id``.
        step: the method the replicas ran, for messages.

    Raises:
        ReplicaStateError: where the replicas did not all change a parameter to one value.
    """
    changed = {original for replica in writes for original in replica.changed}
    updates: list[tuple[torch.Tensor, torch.Tensor]] = []
    for original in changed:
        parameter = parameters[original]
        values = [replica.changed.get(original) for replica in writes]
        path = f"self.{names.get(original, '?')}"
        missing = [index for index, value in enumerate(values) if value is None]
        if missing:
            raise ReplicaStateError(
                f"{step} changed the parameter {path} inside some replicas but not in replica {missing[0]}, so one"
                f" device's change cannot be told. {_FIX}.",
                path,
                step,
            )
        first = values[0]
        assert first is not None
        for index, value in enumerate(values[1:], start=1):
            assert value is not None
            unlike = difference(first, value)
            if unlike is not None:
                raise ReplicaStateError(
                    f"{step} changed the parameter {path} in place inside the replicas, and replicas 0 and {index}"
                    f" changed it to different values ({unlike}), as a change computed from each replica's rows"
                    f" would be, so one device's value cannot be told; the module's parameter is unchanged. {_FIX}.",
                    path,
                    step,
                )
        updates.append((parameter, first))
    for parameter, value in updates:
        _store(parameter, value)


def _store(parameter: torch.Tensor, value: torch.Tensor) -> None:
    """Write ``value`` into the module's parameter, in place where it fits, without autograd seeing a change."""
    own = parameter.data
    if own.shape == value.shape and own.dtype == value.dtype and own.device == value.device:
        own.copy_(value.detach())
    else:
        parameter.data = value.detach().to(parameter.device)


def same_values(left: torch.Tensor, right: torch.Tensor) -> bool:
    """``torch.equal``, but a NaN equals a NaN: a value every replica left NaN is one value."""
    if torch.equal(left, right):
        return True
    floating = left.is_floating_point() or left.is_complex()
    return floating and left.shape == right.shape and torch.allclose(left, right, rtol=0, atol=0, equal_nan=True)


def difference(left: torch.Tensor, right: torch.Tensor) -> str | None:
    """How ``right`` differs from ``left`` in words (shape and dtype, or the largest difference); ``None``: equal."""
    if left.shape != right.shape or left.dtype != right.dtype:
        return f"{tuple(left.shape)} {left.dtype} against {tuple(right.shape)} {right.dtype}"
    right = right.detach().to(left.device)
    if same_values(left.detach(), right):
        return None
    if left.is_floating_point() or left.is_complex():
        return f"by up to {(left.detach() - right).abs().max().item():.3g}"
    return "unequal"


def _storage(tensor: torch.Tensor) -> int:
    try:
        return tensor.untyped_storage().data_ptr()
    except RuntimeError:  # a tensor without storage (a functional or meta tensor) aliases no parameter
        return 0
