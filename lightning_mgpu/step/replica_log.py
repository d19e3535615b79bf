"""``self.log`` inside replicas: recorded per replica, combined across replicas, logged once from the main thread.

Lightning's result collection is not thread-safe and knows nothing of replicas, so replicas never touch it: each
replica's ``log`` only records, and after the step the values of each name are combined (mean weighted by the rows
each replica saw, or the ``reduce_fx`` given to ``self.log``) and handed to the real ``LightningModule.log``.
A torchmetrics metric, or a value that calling one returned, is logged as one device logs it instead: the module's
own metric, into which every replica's copy was merged, or one device's value of that call.

``reduce_fx`` takes exactly what ``LightningModule.log`` takes, and means the same across replicas as Lightning
makes it mean across steps and processes.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from torchmetrics import Metric

from lightning_mgpu.engine.reduce import reduce_op_name, weighted_mean
from lightning_mgpu.errors import ReplicaStateError
from lightning_mgpu.namespaces import LIGHTNING, Namespace


class ReplicaLog:
    """Stands in for ``LightningModule.log`` on one replica; ``log_dict`` reaches it through ``self.log``."""

    def __init__(self, index: int, rows: int, namespace: Namespace = LIGHTNING) -> None:
        self.index = index
        self.rows = rows
        self.namespace = namespace
        self.records: list[tuple[str, Any, dict[str, Any]]] = []

    def __call__(self, name: str, value: Any, **kwargs: Any) -> None:
        """Record ``self.log(name, value, **kwargs)``, checked as ``LightningModule.log`` would check it."""
        if not isinstance(value, (torch.Tensor, numbers.Number, Metric)):
            raise TypeError(
                f"self.log({name!r}, ...) got a {type(value).__name__} in replica {self.index}; log a number or a"
                " scalar tensor, or use self.log_dict for a dict."
            )
        if isinstance(value, torch.Tensor) and value.numel() != 1:
            raise ValueError(
                f"self.log({name!r}, ...) got a tensor of shape {tuple(value.shape)} in replica {self.index}; log a"
                " scalar (reduce it in the step), or log per-sample values from the *_step_end hook."
            )
        reduction(name, kwargs.get("reduce_fx", "mean"), self.index, self.namespace)
        self.records.append((name, value, kwargs))


# What ``LightningModule.log`` accepts as ``reduce_fx``, besides these names in any letter case: the functions
# themselves. Anything else Lightning rejects with a MisconfigurationException, and so do replicas.
_REDUCE_FUNCTIONS: tuple[tuple[Any, str], ...] = (
    (torch.mean, "mean"),
    (torch.sum, "sum"),
    (sum, "sum"),
    (torch.max, "max"),
    (max, "max"),
    (torch.min, "min"),
    (min, "min"),
)


def reduction(name: str, reduce_fx: Any, index: int, namespace: Namespace = LIGHTNING) -> str:
    """The reduction ``reduce_fx`` stands for, ``"mean"``, ``"sum"``, ``"max"`` or ``"min"``, as Lightning reads it.

    Raises:
        MisconfigurationException: ``namespace``'s, the module's own, for a ``reduce_fx`` that
            ``LightningModule.log`` rejects, as it would.
    """
    meaning = reduce_op_name(reduce_fx) if isinstance(reduce_fx, str) else None
    if meaning is not None:
        return meaning
    for function, meaning in _REDUCE_FUNCTIONS:
        if reduce_fx is function:
            return meaning
    raise namespace.MisconfigurationException(
        f"self.log({name!r}, ..., reduce_fx={reduce_fx!r}) was called inside replica {index}. Lightning's self.log"
        " accepts reduce_fx 'mean' (or 'avg'), 'sum', 'max' or 'min', in any letter case, or torch.mean,"
        " torch.sum, torch.max, torch.min, sum, max or min. For another reduction, update a torchmetrics Metric"
        " with the gathered outputs in the *_step_end hook and log the Metric there."
    )


Resolve = Callable[[Any, int], "tuple[Any, Any] | None"]
"""``MGPUDataParallel.resolve_logged``: what a value a replica logged is on one device, if a metric made it."""


def replay(logs: Sequence[ReplicaLog], module: pl.LightningModule, device: torch.device, resolve: Resolve) -> None:
    """Log every recorded name once on ``module``, with its values combined across the replicas that logged it."""
    by_name: dict[str, list[tuple[ReplicaLog, Any, dict[str, Any]]]] = {}
    for log in logs:
        for name, value, kwargs in log.records:
            by_name.setdefault(name, []).append((log, value, kwargs))
    for name, entries in by_name.items():
        kwargs = dict(entries[0][2])
        weights = _weights(entries)
        if kwargs.get("batch_size") is not None:
            kwargs["batch_size"] = int(sum(weights))
        one_device = _metric_value(name, entries, resolve)
        if one_device is not None:
            module.log(name, one_device, **kwargs)
            continue
        values = torch.stack([_as_tensor(value, device) for _, value, _ in entries])
        combine = reduction(name, kwargs.get("reduce_fx", "mean"), entries[0][0].index, entries[0][0].namespace)
        module.log(name, _combine(values, weights, combine), **kwargs)


def _metric_value(name: str, entries: list[tuple[ReplicaLog, Any, dict[str, Any]]], resolve: Resolve) -> Any:
    """The module's metric, or one device's value of a metric's call, that every replica logged as ``name``."""
    resolved = [resolve(value, log.index) for log, value, _ in entries]
    if all(found is None for found in resolved):
        if any(isinstance(value, Metric) for _, value, _ in entries):
            raise TypeError(
                f"self.log({name!r}, <Metric>) was called inside the replicas with a metric that is not an"
                " attribute of the LightningModule (one made inside the step, say). Lightning logs a metric by the"
                " attribute it is kept in: assign it in __init__ (self.metric = ...) and log that."
            )
        return None
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


def _weights(entries: list[tuple[ReplicaLog, Any, dict[str, Any]]]) -> list[float]:
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
