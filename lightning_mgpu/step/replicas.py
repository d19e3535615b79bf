"""One data-parallel step of a LightningModule: replicas run the step, then ``*_step_end`` or the default loss.

Shared by ``MGPUDPStrategy`` and the doctor, which runs the same step outside a Trainer.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_mgpu._compat import set_lightning_device
from lightning_mgpu.engine import MGPUDataParallel, weighted_mean
from lightning_mgpu.engine.replicate import modules_of
from lightning_mgpu.engine.scatter import (
    field_values,
    is_dataclass_instance,
    is_namedtuple,
    rebuild_dataclass,
    rebuild_mapping,
    rebuild_sequence,
)
from lightning_mgpu.errors import ConfigurationError, GatherError
from lightning_mgpu.namespaces import LIGHTNING, namespace_of
from lightning_mgpu.step.health import StepHealth
from lightning_mgpu.step.hooks import STEP_END_HOOKS, call_step_end, find_loss, has_step_end
from lightning_mgpu.step.replica_log import ReplicaLog, replay


def run_replica_step(
    wrapper: MGPUDataParallel,
    module: pl.LightningModule,
    step: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    context: Callable[[], AbstractContextManager[Any]] = nullcontext,
    health: StepHealth | None = None,
    collated: bool = False,
) -> Any:
    """Run ``module.<step>(*args, **kwargs)`` split across the replicas of ``wrapper`` and return what Lightning sees.

    The first argument is the batch; ``context`` (the precision plugin's context) is entered once, in the calling
    thread, around the replicas' calls: a default dtype it sets is process-wide, so replica threads entering it
    each would race to set and restore it, and its thread-local part (autocast, grad mode) reaches every replica
    thread as the caller's state does. Values logged in replicas are combined and logged on ``module``; the gathered
    output goes to the ``*_step_end`` hook, or, without one, every 0-dim value the replicas returned is combined
    into one by a mean weighted by chunk size (``combine_scalars``). ``health``, when given, warns about idle devices
    and a non-finite training loss. ``collated`` says torch's ``default_collate`` built the batch, so its lists
    are read as it builds them (``lightning_mgpu.engine.scatter.Source``).
    """
    if not args:
        raise ConfigurationError(
            f"mgpu_dp needs the batch as the first positional argument of {step}.", setting=f"LightningModule.{step}"
        )
    if isinstance(args[0], Iterator):
        raise ConfigurationError(
            f"{step} takes a dataloader iterator, which mgpu_dp cannot split across replicas. Define"
            f" {step}(self, batch, batch_idx) instead, or use strategy='mgpu_ddp'.",
            setting=f"LightningModule.{step}",
        )
    if collated:
        wrapper.collated_methods.add(step)
    else:
        wrapper.collated_methods.discard(step)
    scattered = wrapper.scatter_batch(args[0], args[1:], kwargs, step)
    replicas = wrapper.replicate(wrapper.module, scattered.devices)
    logs = [
        prepare_replica(replica, index, len(replicas), device, rows)
        for index, (replica, device, rows) in enumerate(zip(replicas, scattered.devices, scattered.sizes, strict=True))
    ]
    with context():
        outputs = wrapper.parallel_apply(replicas, scattered.calls, scattered.devices, step)
    wrapper.settle(scattered.sizes, step)
    replay(logs, module, wrapper.root_device, wrapper.resolve_logged)
    gathered = wrapper.gather(outputs, scattered.sizes, step)
    if has_step_end(module, step):
        result = call_step_end(module, step, gathered)
    elif step == "predict_step":
        return gathered
    else:
        result = combine_scalars(outputs, scattered.sizes, gathered, step)
    if health is not None and step == "training_step":
        health.check_rows(sum(scattered.sizes), len(wrapper.devices))
        losses = [find_loss(output)[1] for output in outputs]
        health.check_loss(result, lambda: f"at step {module.global_step}", losses)
    return result


LOSS_WEIGHT = "loss_weight"
"""The key next to ``"loss"`` that states the count a replica's loss is a mean over (see ``combine_scalars``)."""

_ABSENT = object()


def mark_outside_replicas(module: nn.Module) -> Callable[[], None]:
    """Make ``module`` read as replica 0 of 1, which it is outside the replicas; returns what puts back its own.

    So code that reads ``self.replica_index`` or ``self.num_replicas`` runs anywhere, ``MGPUMixin`` or not.
    """
    saved = {name: vars(module).get(name, _ABSENT) for name in ("replica_index", "num_replicas")}
    module.__dict__.update(replica_index=0, num_replicas=1)

    def restore() -> None:
        for name, value in saved.items():
            if value is _ABSENT:
                module.__dict__.pop(name, None)
            else:
                module.__dict__[name] = value

    return restore


def prepare_replica(replica: nn.Module, index: int, num_replicas: int, device: torch.device, rows: int) -> ReplicaLog:
    """Give a replica its place (``replica_index``, ``num_replicas``, ``device``) and a ``log`` that records."""
    setattr(replica, "replica_index", index)  # noqa: B010 - nn.Module's typed __setattr__ rejects an int
    setattr(replica, "num_replicas", num_replicas)  # noqa: B010
    for submodule in modules_of(replica):
        set_lightning_device(submodule, device)
    setattr(replica, "manual_backward", _refuse_manual_backward)  # noqa: B010
    log = ReplicaLog(index, rows, namespace_of(type(replica)) or LIGHTNING, replica)
    setattr(replica, "log", log)  # noqa: B010 - an instance attribute shadows LightningModule.log
    return log


def _refuse_manual_backward(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError(
        "self.manual_backward() was called inside a replica under mgpu_dp. Each replica sees only its chunk, so"
        " its backward would weigh the chunks wrongly. Return the per-sample values (or the chunk loss) from"
        " training_step and call self.manual_backward() on the combined loss in training_step_end."
    )


def combine_scalars(outputs: list[Any], sizes: list[int], gathered: Any, step: str) -> Any:
    """Without a ``*_step_end`` hook, make each 0-dim value the replicas returned one value, one device's.

    A replica's 0-dim floating tensor or float is its chunk's value. A mean over the rows, such as a loss, becomes
    one device's by a mean weighted by the rows each replica received; the ``"loss"`` of a dict that holds a
    ``"loss_weight"`` next to it (the count the loss is a mean over: tokens, unmasked positions) is weighted by that
    instead, and the counts are added. Tensors with rows stay gathered. An integer or boolean 0-dim value (a count,
    a flag) is no mean, and is refused with its key path.

    Raises:
        GatherError: for an integer or boolean 0-dim value.
        ConfigurationError: for a ``"loss_weight"`` that is not one number per replica.
    """
    if isinstance(gathered, Mapping) and LOSS_WEIGHT in gathered and _is_scalar(outputs[0].get("loss")):
        counts = gathered[LOSS_WEIGHT]
        if not (isinstance(counts, torch.Tensor) and counts.dim() == 1 and len(counts) == len(outputs)):
            raise ConfigurationError(
                f"{step}'s {LOSS_WEIGHT!r} must be a number or a 0-dim tensor (the count the loss is a mean"
                f" over), but the replicas returned {counts!r}.",
                setting=f"LightningModule.{step}",
            )
        combined = {
            key: _combine([output[key] for output in outputs], value, sizes, step, f"output[{key!r}]")
            for key, value in gathered.items()
            if key not in ("loss", LOSS_WEIGHT)
        }
        combined["loss"] = weighted_mean(gathered["loss"], counts)
        combined[LOSS_WEIGHT] = counts.sum()
        return rebuild_mapping(gathered, [(key, combined[key]) for key in gathered], "output")
    return _combine(outputs, gathered, sizes, step, "output")


def _combine(values: list[Any], gathered: Any, sizes: list[int], step: str, path: str) -> Any:
    """``combine_scalars`` for one key path: ``values`` are the replicas' own, ``gathered`` what gathering made."""
    first = values[0]
    if isinstance(first, torch.Tensor):
        if first.dim() != 0:
            return gathered
        if first.is_floating_point() or first.is_complex():
            return weighted_mean(gathered, sizes)
        raise _count_error(path, step, f"a 0-dim {first.dtype} tensor")
    if isinstance(first, (bool, numbers.Integral)):
        raise _count_error(path, step, f"a Python {type(first).__name__}")
    if isinstance(first, numbers.Real):
        return sum(float(value) * rows for value, rows in zip(values, sizes, strict=True)) / sum(sizes)
    if isinstance(first, Mapping) and isinstance(gathered, Mapping):
        items = [
            (key, _combine([value[key] for value in values], item, sizes, step, f"{path}[{key!r}]"))
            for key, item in gathered.items()
        ]
        return rebuild_mapping(gathered, items, path)
    if is_dataclass_instance(first) and is_dataclass_instance(gathered):
        fields = [
            (name, _combine([getattr(value, name) for value in values], item, sizes, step, f"{path}.{name}"))
            for name, item in field_values(gathered)
        ]
        return rebuild_dataclass(gathered, fields)
    same_type = isinstance(first, (list, tuple)) and type(gathered) is type(first)
    if same_type and all(len(value) == len(gathered) for value in values):  # not concatenated as one item per row
        items = [
            _combine([value[index] for value in values], item, sizes, step, f"{path}[{index}]")
            for index, item in enumerate(gathered)
        ]
        return type(gathered)(*items) if is_namedtuple(gathered) else rebuild_sequence(gathered, items)
    return gathered


def _count_error(path: str, step: str, kind: str) -> GatherError:
    return GatherError(
        f"{path} is {kind} in each replica. Without {STEP_END_HOOKS[step]}, mgpu_dp combines a step's 0-dim values"
        " into one by their mean weighted by each replica's rows, which is one device's value for a mean over the"
        " rows, but a count or a flag is not a mean. Return a float mean or one value per row, or define"
        f" {STEP_END_HOOKS[step]} and combine the replicas' values (one per replica) there.",
        path,
    )


def _is_scalar(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 0
