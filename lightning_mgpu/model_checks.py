"""Checks for the multi-GPU traps that show in a model's structure, run before any step.

Each finding names the attribute and the fix. Errors stop ``fit`` under the ``mgpu_*`` strategies; warnings are
shown once. The doctor runs the same checks.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from torch import nn
from torchmetrics import Metric

from lightning_mgpu.errors import ModelCheckError


@dataclass(frozen=True)
class Finding:
    """One problem found in a model.

    Attributes:
        level: ``"error"`` stops the run; ``"warning"`` is reported and the run goes on.
        check: a short stable name for the kind of problem (``"plain-container"``, ``"unregistered-tensor"``, ...).
        where: the attribute path, for example ``"encoder.heads"``.
        message: what is wrong and how to fix it.
    """

    level: Literal["error", "warning"]
    check: str
    where: str
    message: str


def check_model(module: nn.Module) -> list[Finding]:
    """Every structural multi-GPU trap in ``module`` and its submodules."""
    findings: list[Finding] = []
    for prefix, submodule in module.named_modules():
        if isinstance(submodule, Metric):
            continue  # torchmetrics keeps its states as attributes on purpose and moves them itself
        for name, value in _user_attributes(submodule):
            where = f"{prefix}.{name}" if prefix else name
            findings.extend(_check_attribute(where, value))
    return findings


def report(findings: list[Finding], strategy_name: str) -> None:
    """Raise one error listing every error-level finding; warn once per warning-level finding."""
    for finding in findings:
        if finding.level == "warning":
            warnings.warn(f"{strategy_name}: {finding.message}", UserWarning, stacklevel=3)
    errors = [finding for finding in findings if finding.level == "error"]
    if errors:
        listing = "\n".join(f"- {finding.message}" for finding in errors)
        raise ModelCheckError(
            f"{strategy_name} found {len(errors)} problem(s) in the model before training:\n{listing}"
        )


@functools.cache
def _baseline() -> frozenset[str]:
    """Attribute names every module has; built on first use, not at import, since it instantiates a LightningModule."""
    return frozenset(vars(nn.Module())) | frozenset(vars(pl.LightningModule())) | {"_hparams", "_hparams_initial"}


def _user_attributes(module: nn.Module) -> Iterator[tuple[str, Any]]:
    baseline = _baseline()
    for name, value in vars(module).items():
        if name not in baseline:
            yield name, value


def _check_attribute(where: str, value: Any) -> list[Finding]:
    if isinstance(value, torch.Tensor):
        return [
            Finding(
                "warning",
                "unregistered-tensor",
                where,
                f"`{where}` is a tensor but neither a parameter nor a buffer, so `.to()` does not move it and every"
                f" replica shares the one on {value.device}. Register it:"
                f" `self.register_buffer('{where.split('.')[-1]}', tensor)` (or `nn.Parameter` if it is trained),"
                " or create it inside the step on the input's device.",
            )
        ]
    if isinstance(value, (list, tuple, set, Mapping)) and not isinstance(value, (nn.Module, str)):
        kinds = sorted({_kind(item) for item in _leaves(value)} - {""})
        if kinds:
            container = type(value).__name__
            modules = "module" in kinds
            suggestion = "nn.ModuleList / nn.ModuleDict" if modules else "nn.ParameterList / nn.ParameterDict"
            return [
                Finding(
                    "error",
                    "plain-container",
                    where,
                    f"`{where}` is a plain Python {container} holding {' and '.join(kinds)}s, which are not trained,"
                    f" saved, moved to the device or replicated. Use {suggestion}, or register each one with"
                    f" `lightning_mgpu.register_parameters(self, '{where.split('.')[-1]}', params)` /"
                    " `self.register_buffer(...)`.",
                )
            ]
    return []


def _kind(value: Any) -> str:
    if isinstance(value, nn.Parameter):
        return "parameter"
    if isinstance(value, nn.Module):
        return "module"
    if isinstance(value, torch.Tensor):
        return "tensor"
    return ""


def _leaves(value: Any, depth: int = 0) -> Iterator[Any]:
    if depth > 4:
        return
    items = value.values() if isinstance(value, Mapping) else value
    for item in items:
        if isinstance(item, (list, tuple, set, Mapping)) and not isinstance(item, (nn.Module, str)):
            yield from _leaves(item, depth + 1)
        else:
            yield item
