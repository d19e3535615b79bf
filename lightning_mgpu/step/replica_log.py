"""``self.log`` inside replicas: checked and recorded per replica, combined across replicas, logged once on the module.

Lightning's result collection is not thread-safe and knows nothing of replicas, so replicas never touch it: each
replica's ``log`` runs the checks of Lightning's own ``LightningModule.log`` (so it raises what one device raises,
where one device raises it) and records the call. After the step each recorded call is logged on the module from the
main thread, in order: the n-th call of a name combines the n-th calls of the replicas that made one (a mean weighted
by the rows each replica saw, or the ``reduce_fx`` given), so a name logged twice in a step is logged twice on the
module, as on one device (the last value on step, both in the epoch's aggregate). A torchmetrics metric, or a value
that calling one returned, is logged as one device logs it instead: the module's own metric, into which every
replica's copy was merged, or one device's value of that call.

``reduce_fx`` takes exactly what ``LightningModule.log`` takes, and means the same across replicas as Lightning
makes it mean across steps and processes.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torchmetrics import Metric

from lightning_mgpu._compat import log_checker, log_parameters
from lightning_mgpu.engine.reduce import reduce_op_name, weighted_mean
from lightning_mgpu.errors import ReplicaStateError
from lightning_mgpu.namespaces import LIGHTNING, Namespace

Record = tuple[str, Any, dict[str, Any]]
"""One ``self.log`` call: the name, the value, and the options given, by name (positional ones too)."""


class ReplicaLog:
    """Stands in for ``LightningModule.log`` on one replica; ``log_dict`` reaches it through ``self.log``.

    Args:
        index: the replica's index.
        rows: the rows of the batch the replica received, which weigh its values.
        namespace: the module's Lightning namespace, whose ``LightningModule.log`` this stands in for.
        module: the replica. With it, every call is checked where it is made, as ``LightningModule.log`` checks it on
            the replica; without it, what Lightning refuses is refused when the calls are logged on the module.
    """

    def __init__(
        self, index: int, rows: int, namespace: Namespace = LIGHTNING, module: nn.Module | None = None
    ) -> None:
        self.index = index
        self.rows = rows
        self.namespace = namespace
        self.records: list[Record] = []
        self._check = None if module is None else log_checker(module, namespace.LightningModule.log)

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        """Record ``self.log(*args, **kwargs)`` once Lightning's checks pass, which raise as on one device."""
        if self._check is not None:
            self._check(*args, **kwargs)
        options = dict(zip(log_parameters(self.namespace.LightningModule.log), args, strict=False)) | kwargs
        name, value = options.pop("name"), options.pop("value")
        self.records.append((name, value, options))


# What ``LightningModule.log`` accepts as ``reduce_fx``, besides these names in any letter case: the functions
# themselves. Anything else Lightning rejects with a MisconfigurationException.
_REDUCE_FUNCTIONS: tuple[tuple[Any, str], ...] = (
    (torch.mean, "mean"),
    (torch.sum, "sum"),
    (sum, "sum"),
    (torch.max, "max"),
    (max, "max"),
    (torch.min, "min"),
    (min, "min"),
)


def _reduction_of(reduce_fx: Any) -> str | None:
    """``"mean"``, ``"sum"``, ``"max"`` or ``"min"`` for a ``reduce_fx`` Lightning accepts, else ``None``."""
    if isinstance(reduce_fx, str):
        return reduce_op_name(reduce_fx)
    return next((meaning for function, meaning in _REDUCE_FUNCTIONS if reduce_fx is function), None)


def reduction(name: str, reduce_fx: Any, index: int, namespace: Namespace = LIGHTNING) -> str:
    """The reduction ``reduce_fx`` stands for, ``"mean"``, ``"sum"``, ``"max"`` or ``"min"``, as Lightning reads it.

    Raises:
        MisconfigurationException: ``namespace``'s, the module's own, for a ``reduce_fx`` that
            ``LightningModule.log`` rejects, as it would.
    """
    meaning = _reduction_of(reduce_fx)
    if meaning is not None:
        return meaning
    raise namespace.MisconfigurationException(
        f"self.log({name!r}, ..., reduce_fx={reduce_fx!r}) was called inside replica {index}. Lightning's self.log"
        " accepts reduce_fx 'mean' (or 'avg'), 'sum', 'max' or 'min', in any letter case, or torch.mean,"
        " torch.sum, torch.max, torch.min, sum, max or min. For another reduction, update a torchmetrics Metric"
        " with the gathered outputs in the *_step_end hook and log the Metric there."
    )


Resolve = Callable[[Any, int], "tuple[Any, Any] | None"]
"""``MGPUDataParallel.resolve_logged``: what a value a replica logged is on one device, if a metric made it."""

Entry = tuple[ReplicaLog, Any, dict[str, Any]]
"""One replica's call: its log, the value, the options."""


def replay(logs: Sequence[ReplicaLog], module: pl.LightningModule, device: torch.device, resolve: Resolve) -> None:
    """Log every recorded call once on ``module``, in order, with the replicas' values of it combined."""
    for (name, _), entries in _calls(logs).items():
        options = dict(entries[0][2])
        weights = _weights(entries)
        if options.get("batch_size") is not None:
            options["batch_size"] = int(sum(weights))
        module.log(name, _one_device_value(name, entries, weights, device, resolve), **options)


def _calls(logs: Sequence[ReplicaLog]) -> dict[tuple[str, int], list[Entry]]:
    """Each name's n-th calls, from the replicas that made one, keyed ``(name, n)`` in the order they were made."""
    calls: dict[tuple[str, int], list[Entry]] = {}
    for log in logs:
        made: dict[str, int] = {}
        for name, value, options in log.records:
            made[name] = made.get(name, -1) + 1
            calls.setdefault((name, made[name]), []).append((log, value, options))
    return calls


def _one_device_value(
    name: str, entries: list[Entry], weights: Sequence[float], device: torch.device, resolve: Resolve
) -> Any:
    """The value one device logs for this call; a value Lightning refuses is handed on as it is, to be refused."""
    one_device = _metric_value(name, entries, resolve)
    if one_device is not None:
        return one_device
    values = [value for _, value, _ in entries]
    for value in values:
        if not _is_scalar(value):
            return value
    combine = _reduction_of(entries[0][2].get("reduce_fx", "mean"))
    if combine is None:
        return values[0]
    return _combine(torch.stack([_as_tensor(value, device) for value in values]), weights, combine)


def _is_scalar(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 1
    return isinstance(value, numbers.Number)


def _metric_value(name: str, entries: list[Entry], resolve: Resolve) -> Any:
    """The module's metric, or one device's value of a metric's call, that every replica logged as ``name``.

    A metric that is none of the module's is returned as it is, for ``LightningModule.log`` to refuse as on one
    device; ``None`` when no replica logged a metric or a metric's value.
    """
    resolved = [resolve(value, log.index) for log, value, _ in entries]
    if all(found is None for found in resolved):
        made_in_step = next((value for _, value, _ in entries if isinstance(value, Metric)), None)
        attribute = entries[0][2].get("metric_attribute")
        if made_in_step is not None and attribute is not None:
            raise ReplicaStateError(
                f"self.log({name!r}, <Metric>, metric_attribute={attribute!r}) was called inside the replicas with a"
                " metric made inside the step, so each replica's holds only the rows that replica received and none"
                " is one device's. Keep the metric as an attribute of the LightningModule (assigned in __init__) and"
                " log that, or update it with the gathered outputs in the *_step_end hook.",
                f"self.log({name!r})",
                "self.log",
            )
        return made_in_step
    found = {id(item) for pair in resolved if pair is not None for item in pair if item is not None}
    if any(pair is None for pair in resolved) or len(found) != 1:
        raise ReplicaStateError(
            f"self.log({name!r}, ...) logged a metric's value in some replicas and something else (or another"
            " call's value) in others, so one device's value cannot be told. Log the same metric, or the value of the"
            " same call of it, in every replica.",
            f"self.log({name!r})",
            "self.log",
        )
    metric, value = resolved[0]  # type: ignore[misc]
    return metric if metric is not None else value


def _as_tensor(value: Any, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.to(device).reshape(())
    # Like LightningModule.log: Python numbers become tensors of the default dtype.
    return torch.tensor(value, dtype=torch.get_default_dtype(), device=device)


def _weights(entries: list[Entry]) -> list[float]:
    """The ``batch_size`` each replica passed to ``self.log``, or else the rows each replica received."""
    given = [kwargs.get("batch_size") for _, _, kwargs in entries]
    if all(size is not None for size in given):
        return [float(size) for size in given]  # type: ignore[arg-type]
    return [float(log.rows) for log, _, _ in entries]


def _combine(values: torch.Tensor, weights: Sequence[float], combine: str) -> torch.Tensor:
    """One value from the replicas' values; a mean is weighted as Lightning weights steps, by batch size."""
    if combine == "sum":
        return values.sum()
    if combine == "max":
        return values.max()
    if combine == "min":
        return values.min()
    return weighted_mean(values, weights)
