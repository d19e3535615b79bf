"""The runs the doctor compares: one training step on one device, and the same step split across CPU replicas.

The split run goes through the ``MGPUDataParallel`` engine exactly as ``mgpu_dp`` runs it. Each run works on a fresh
deep copy of the model, so the model passed in is left untouched. A run keeps what ``training_step_end``
received (the whole batch's output on one device, the replicas' outputs gathered when split), what it returned,
every gradient and every buffer after the step, so that a difference can be traced to the stage it starts in.
"""

from __future__ import annotations

import copy
import random
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch import nn

from lightning_mgpu.engine import MGPUDataParallel
from lightning_mgpu.engine.scatter import scatter_to_devices
from lightning_mgpu.step.hooks import STEP_END_HOOKS, call_step_end, caller_runs_step_end, find_loss, has_step_end
from lightning_mgpu.step.replicas import mark_outside_replicas, run_replica_step

STEP_OUTPUT = "step output"
"""The root of the key paths of what a ``*_step_end`` hook received: ``step output['pred']``."""
DROPOUT = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
_UNATTACHED_LOG = r".*`self\.log\(\)` but the `self\.trainer` reference"


@dataclass
class Run:
    """What one run of the training step left, or the error it raised.

    Attributes:
        step_end: whether the module defines ``training_step_end``, so that ``step_output`` was recorded.
        step_output: what ``training_step_end`` received, copied before it ran: ``training_step``'s output on one
            device, the replicas' outputs gathered when split.
        output: what Lightning receives: ``training_step_end``'s result, or the step's output without the hook.
        loss_path: the key path of the loss in ``output``, or ``None`` when there is none.
        loss: the loss tensor at ``loss_path``.
        backward_done: whether the loss was back-propagated, so ``grads`` hold its gradients.
        grads: every parameter's gradient after the step (``None`` where it got none).
        requires_grad: every parameter's ``requires_grad``.
        buffers: every buffer after the step, copied.
        assigned: the public attributes that ``training_step`` assigned on the module or a module inside it, as
            dotted paths, seen when ``training_step_end`` starts; a replica assigns them on its own copy instead.
        error: what the step raised, if it did; the other fields are then empty.
    """

    step_end: bool = False
    step_output: Any = None
    output: Any = None
    loss_path: str | None = None
    loss: torch.Tensor | None = None
    backward_done: bool = False
    grads: dict[str, torch.Tensor | None] = field(default_factory=dict)
    requires_grad: dict[str, bool] = field(default_factory=dict)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    assigned: list[str] = field(default_factory=list)
    error: BaseException | None = None


def run_reference(model: pl.LightningModule, batch: Any, seed: int) -> Run:
    """The step on one device: the result the split run must match."""
    module = fresh_copy(model)
    run = _recording_step_end(module)
    seed_all(seed)
    try:
        with caller_runs_step_end():
            output = call_step_end(module, "training_step", module.training_step(copy.deepcopy(batch), 0))
            _finish(module, output, run)
    except Exception as error:
        return Run(error=error)
    return run


def run_split(model: pl.LightningModule, batch: Any, seed: int, replicas: int, sync_batchnorm: bool = True) -> Run:
    """The step split across ``replicas`` virtual CPU replicas by ``MGPUDataParallel``, as ``mgpu_dp`` runs it.

    With ``replicas=1`` one replica runs the whole batch: a difference that remains then is not batch-wise work
    but something a replica does differently from the module itself. ``sync_batchnorm`` is
    ``MGPUDPStrategy``'s option of that name.
    """
    module = fresh_copy(model)
    run = _recording_step_end(module)
    wrapper = MGPUDataParallel(module, [torch.device("cpu")] * replicas, sync_batchnorm=sync_batchnorm)
    seed_all(seed)
    try:
        with caller_runs_step_end():
            output = run_replica_step(wrapper, module, "training_step", (copy.deepcopy(batch), 0), {})
            _finish(module, output, run)
    except Exception as error:
        return Run(error=error)
    finally:
        wrapper.close()
    return run


def run_chunks(model: pl.LightningModule, batch: Any, seed: int, replicas: int) -> list[Run]:
    """The step on one device on each chunk that the split run gives a replica, on its own.

    The loss of the whole batch is a weighted mean of these chunks' losses when it is a mean of per-row (or
    per-token) terms, which ``loss_weight`` can reproduce; when it lies outside them, the step compares rows across
    the batch and no weighting can.
    """
    chunks, _, _ = scatter_to_devices(batch, [torch.device("cpu")] * replicas)
    return [run_reference(model, chunk, seed) for chunk in chunks]


def fresh_copy(model: pl.LightningModule, training: bool = True) -> pl.LightningModule:
    """A deep copy of ``model`` in training (or evaluation) mode, with every ``nn.Dropout*`` module in eval mode."""
    module = copy.deepcopy(model)
    module.train(training)
    for submodule in module.modules():
        if isinstance(submodule, DROPOUT):
            submodule.eval()
    mark_outside_replicas(module)  # as mgpu_dp does; the copy is discarded, so nothing is put back
    return module


def _recording_step_end(module: pl.LightningModule) -> Run:
    """A new ``Run`` into which ``module``'s ``training_step_end`` (on the doctor's copy) records what it receives.

    Wrapping the hook on the copy sees the gathered output exactly where ``mgpu_dp`` hands it over, without
    reaching into the strategy. The hook also notes the attributes that ``training_step`` assigned before it.
    """
    run = Run(step_end=has_step_end(module, "training_step"))
    if run.step_end:
        hook = getattr(module, STEP_END_HOOKS["training_step"])
        before = _attributes(module)

        def recording_hook(output: Any) -> Any:
            run.step_output = _detached_copy(output)
            now = _attributes(module)
            run.assigned = [path for path, value in now.items() if before.get(path, _MISSING) is not value]
            return hook(output)

        setattr(module, STEP_END_HOOKS["training_step"], recording_hook)  # noqa: B010 - the doctor's own copy
    return run


_MISSING = object()


def _attributes(module: nn.Module) -> dict[str, Any]:
    """The public plain attributes of ``module`` and every module inside it, by dotted path."""
    return {
        f"{prefix}.{name}" if prefix else name: value
        for prefix, submodule in module.named_modules()
        for name, value in vars(submodule).items()
        if not name.startswith("_") and name != STEP_END_HOOKS["training_step"]
    }


def _detached_copy(value: Any) -> Any:
    """``value`` with its tensors detached and cloned and its containers rebuilt, so the hook cannot change it."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, Mapping):
        return {key: _detached_copy(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_detached_copy(item) for item in value]
    return value


def _finish(module: pl.LightningModule, output: Any, run: Run) -> None:
    run.output = output
    run.loss_path, loss = find_loss(output)
    if isinstance(loss, torch.Tensor):
        run.loss = loss
        if module.automatic_optimization and loss.numel() == 1 and loss.requires_grad:
            loss.backward()
            run.backward_done = True
    for name, parameter in module.named_parameters():
        run.grads[name] = parameter.grad
        run.requires_grad[name] = parameter.requires_grad
    run.buffers = {name: buffer.detach().clone() for name, buffer in module.named_buffers()}


def seed_all(seed: int) -> None:
    """Seed what ``seed_everything`` seeds, without its environment variable (the doctor runs inside processes)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@contextmanager
def quiet_unattached_logging() -> Iterator[None]:
    """Silence Lightning's warning that ``self.log`` does nothing without a Trainer: the doctor has none."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_UNATTACHED_LOG)
        yield
