"""The runs the doctor compares: one training step on one device, and the same step split across CPU replicas.

The split run goes through the ``DataParallel`` engine exactly as ``mgpu_dp`` runs it. Each run works on a fresh
deep copy of the model, so the model the user passed is left untouched.
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

from lightning_mgpu.engine import DataParallel
from lightning_mgpu.hooks import call_step_end, caller_runs_step_end
from lightning_mgpu.strategies._replica_step import run_replica_step

DROPOUT = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


@dataclass
class Run:
    """What one run of the training step left: its output, the loss in it, every gradient, or the error it raised."""

    output: Any = None
    loss_path: str | None = None
    loss: torch.Tensor | None = None
    backward_done: bool = False
    grads: dict[str, torch.Tensor | None] = field(default_factory=dict)
    requires_grad: dict[str, bool] = field(default_factory=dict)
    error: BaseException | None = None


def run_reference(model: pl.LightningModule, batch: Any, seed: int) -> Run:
    """The step on one device: the result the split run must match."""
    module = _fresh_copy(model)
    seed_all(seed)
    try:
        with caller_runs_step_end(module):
            output = call_step_end(module, "training_step", module.training_step(copy.deepcopy(batch), 0))
        return _finish(module, output)
    except Exception as error:
        return Run(error=error)


def run_split(model: pl.LightningModule, batch: Any, seed: int, replicas: int) -> Run:
    """The step split across ``replicas`` virtual CPU replicas by ``DataParallel``, as ``mgpu_dp`` runs it."""
    module = _fresh_copy(model)
    wrapper = DataParallel(module, [torch.device("cpu")] * replicas)
    seed_all(seed)
    try:
        with caller_runs_step_end(module):
            output = run_replica_step(wrapper, module, "training_step", (copy.deepcopy(batch), 0), {})
        return _finish(module, output)
    except Exception as error:
        return Run(error=error)
    finally:
        wrapper.close()


def _fresh_copy(model: pl.LightningModule) -> pl.LightningModule:
    module = copy.deepcopy(model)
    module.train()
    for submodule in module.modules():
        if isinstance(submodule, DROPOUT):
            submodule.eval()
    # Outside the replicas the module is "replica 0 of 1", as DataParallelStrategy.setup makes it.
    setattr(module, "replica_index", 0)  # noqa: B010 - nn.Module's typed __setattr__ rejects an int
    setattr(module, "num_replicas", 1)  # noqa: B010
    return module


def _finish(module: pl.LightningModule, output: Any) -> Run:
    run = Run(output=output)
    run.loss_path, loss = _loss_of(output)
    if isinstance(loss, torch.Tensor):
        run.loss = loss
        if module.automatic_optimization and loss.numel() == 1 and loss.requires_grad:
            loss.backward()
            run.backward_done = True
    for name, parameter in module.named_parameters():
        run.grads[name] = parameter.grad
        run.requires_grad[name] = parameter.requires_grad
    return run


def _loss_of(output: Any) -> tuple[str | None, Any]:
    if isinstance(output, torch.Tensor):
        return "output", output
    if isinstance(output, Mapping) and "loss" in output:
        return "output['loss']", output["loss"]
    return None, None


def seed_all(seed: int) -> None:
    """Seed what ``seed_everything`` seeds, without its environment variable (the doctor runs inside processes)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@contextmanager
def quiet_unattached_logging() -> Iterator[None]:
    """Silence Lightning's warning that ``self.log`` does nothing without a Trainer: the doctor has none."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*`self\.log\(\)` but the `self\.trainer` reference")
        yield
