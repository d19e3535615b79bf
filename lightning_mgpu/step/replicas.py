"""One data-parallel step of a LightningModule: replicas run the step, then ``*_step_end`` or the default loss.

Shared by ``MGPUDPStrategy`` and the doctor, which runs the same step outside a Trainer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_mgpu._compat import set_lightning_device
from lightning_mgpu.checks import kept_by_library
from lightning_mgpu.engine import MGPUDataParallel, weighted_mean
from lightning_mgpu.engine.replicate import assigned_attributes, modules_of
from lightning_mgpu.errors import ConfigurationError
from lightning_mgpu.namespaces import LIGHTNING, namespace_of
from lightning_mgpu.step.health import StepHealth
from lightning_mgpu.step.hooks import call_step_end, find_loss, has_step_end
from lightning_mgpu.step.replica_log import ReplicaLog, replay


def run_replica_step(
    wrapper: MGPUDataParallel,
    module: pl.LightningModule,
    step: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    context: Callable[[], AbstractContextManager[Any]] = nullcontext,
    health: StepHealth | None = None,
) -> Any:
    """Run ``module.<step>(*args, **kwargs)`` split across the replicas of ``wrapper`` and return what Lightning sees.

    The first argument is the batch; ``context`` (the precision plugin's autocast) is entered in every replica
    thread. Values logged in replicas are combined and logged on ``module``; the gathered output goes to the
    ``*_step_end`` hook, or, without one, per-replica scalar losses are combined by a mean weighted by chunk size.
    ``health``, when given, warns about idle devices and a non-finite training loss.
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
    scattered = wrapper.scatter_batch(args[0], args[1:], kwargs)
    replicas = wrapper.replicate(wrapper.module, scattered.devices)
    logs = [
        prepare_replica(replica, index, len(replicas), device, rows)
        for index, (replica, device, rows) in enumerate(zip(replicas, scattered.devices, scattered.sizes, strict=True))
    ]
    outputs = wrapper.parallel_apply(replicas, scattered.calls, scattered.devices, step, context)
    replay(logs, module, wrapper.root_device)
    if health is not None and health.wants(f"attributes in {step}"):
        assigned = assigned_attributes(module, replicas[0], _SET_BY_PREPARE, kept_by_library)
        health.check_assigned(assigned, step)
    gathered = wrapper.gather(outputs, scattered.sizes, step)
    if has_step_end(module, step):
        result = call_step_end(module, step, gathered)
    elif step == "predict_step":
        return gathered
    else:
        result = _reduce_loss(outputs, scattered.sizes, gathered)
    if health is not None and step == "training_step":
        health.check_rows(sum(scattered.sizes), len(wrapper.devices))
        losses = [find_loss(output)[1] for output in outputs]
        health.check_loss(result, lambda: f"at step {module.global_step}", losses)
    return result


LOSS_WEIGHT = "loss_weight"
"""The key next to ``"loss"`` that states the count a replica's loss is a mean over (see ``_reduce_loss``)."""

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


_SET_BY_PREPARE = frozenset({"replica_index", "num_replicas", "manual_backward", "log"})


def prepare_replica(replica: nn.Module, index: int, num_replicas: int, device: torch.device, rows: int) -> ReplicaLog:
    """Give a replica its place (``replica_index``, ``num_replicas``, ``device``) and a ``log`` that records."""
    setattr(replica, "replica_index", index)  # noqa: B010 - nn.Module's typed __setattr__ rejects an int
    setattr(replica, "num_replicas", num_replicas)  # noqa: B010
    for submodule in modules_of(replica):
        set_lightning_device(submodule, device)
    setattr(replica, "manual_backward", _refuse_manual_backward)  # noqa: B010
    log = ReplicaLog(index, rows, namespace_of(type(replica)) or LIGHTNING)
    setattr(replica, "log", log)  # noqa: B010 - an instance attribute shadows LightningModule.log
    return log


def _refuse_manual_backward(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError(
        "self.manual_backward() was called inside a replica under mgpu_dp. Each replica sees only its chunk, so"
        " its backward would weigh the chunks wrongly. Return the per-sample values (or the chunk loss) from"
        " training_step and call self.manual_backward() on the combined loss in training_step_end."
    )


def _reduce_loss(outputs: list[Any], sizes: list[int], gathered: Any) -> Any:
    """Without a ``*_step_end`` hook, combine per-replica scalar losses into the single-device loss.

    Each replica's loss is weighted by its rows, or by the ``"loss_weight"`` it returned next to ``"loss"`` (the
    count its loss is a mean over: tokens, unmasked positions), which makes the combination exact for such means.
    """
    if all(isinstance(output, torch.Tensor) and output.dim() == 0 for output in outputs):
        return weighted_mean(gathered, sizes)
    if all(isinstance(output, dict) and _is_scalar(output.get("loss")) for output in outputs):
        if LOSS_WEIGHT not in gathered:  # gathering checked that every replica returned the same keys
            gathered["loss"] = weighted_mean(gathered["loss"], sizes)
            return gathered
        weights = gathered[LOSS_WEIGHT]
        if not (isinstance(weights, torch.Tensor) and weights.dim() == 1 and len(weights) == len(outputs)):
            raise ConfigurationError(
                f"training_step's {LOSS_WEIGHT!r} must be a number or a 0-dim tensor (the count the loss is a mean"
                f" over), but the replicas returned {weights!r}.",
                setting="LightningModule.training_step",
            )
        gathered["loss"] = weighted_mean(gathered["loss"], weights)
        gathered[LOSS_WEIGHT] = weights.sum()
    return gathered


def _is_scalar(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 0
