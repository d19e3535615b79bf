"""Turning the runs and their comparisons into findings: what is wrong for the target strategy, and how to fix it."""

from __future__ import annotations

import re
from typing import Literal

import lightning.pytorch as pl
from torch import nn

from lightning_mgpu.doctor.report import Comparison, DoctorReport, Target
from lightning_mgpu.doctor.runs import Run
from lightning_mgpu.errors import BatchSplitError, GatherError
from lightning_mgpu.hooks import has_step_end
from lightning_mgpu.model_checks import Finding


def batchnorm_names(model: nn.Module) -> list[str]:
    """The BatchNorm layers that normalise by their own batch; SyncBatchNorm's statistics already span the ranks."""
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, nn.SyncBatchNorm)
    ]


def batchnorm_findings(model: nn.Module, target: Target, replicas: int) -> list[Finding]:
    """A warning per BatchNorm layer: its statistics are per replica (mgpu_dp) or per rank (mgpu_ddp)."""
    findings: list[Finding] = []
    for name in batchnorm_names(model):
        kind = type(model.get_submodule(name)).__name__
        if target == "mgpu_dp":
            message = (
                f"`{name}` ({kind}) normalises with per-replica statistics under mgpu_dp: each of the {replicas}"
                " replicas uses the mean and variance of its own chunk, not of the whole batch, and only replica"
                " 0's running statistics are kept. Accept that (with enough rows per replica), or use a"
                " normalisation without batch statistics (GroupNorm, LayerNorm)."
            )
        else:
            message = (
                f"`{name}` ({kind}) normalises with each rank's own batch under mgpu_ddp, and keeps per-rank running"
                " statistics (mgpu_ddp does not broadcast buffers). Pass Trainer(sync_batchnorm=True) to convert it"
                " to SyncBatchNorm, whose statistics span every rank's batch."
            )
        findings.append(Finding("warning", "batchnorm", name, message))
    return findings


def loss_findings(model: pl.LightningModule, reference: Run) -> list[Finding]:
    """What automatic optimization would make of the step's output: no loss, no ``'loss'`` key, not a scalar."""
    if not model.automatic_optimization:
        return []
    step = "training_step_end" if has_step_end(model, "training_step") else "training_step"
    output = reference.output
    if output is None:
        return [
            Finding(
                "warning",
                "no-loss",
                "output",
                f"{step} returned None, so Lightning skips the optimizer step for this batch and no gradients were"
                " compared. Return the loss (or a dict with a 'loss' key) to check the gradients too.",
            )
        ]
    if reference.loss_path is None:
        return [
            Finding(
                "error",
                "no-loss",
                "output",
                f"{step} returned a {type(output).__name__} without a 'loss' key; Lightning's automatic optimization"
                " needs a scalar tensor or a dict with 'loss'. Return the loss from training_step_end, computed on"
                " the outputs of every replica.",
            )
        ]
    loss = reference.loss
    if loss is not None and loss.numel() != 1:
        return [
            Finding(
                "error",
                "no-loss",
                reference.loss_path,
                f"{step} returned {reference.loss_path} of shape {tuple(loss.shape)}, but Lightning needs a scalar"
                " loss. Return per-sample values from training_step and reduce them (.mean()) in training_step_end.",
            )
        ]
    return []


def unused_parameter_findings(reference: Run, target: Target) -> list[Finding]:
    """A finding per parameter that requires grad but got none: an error under mgpu_ddp, where DDP fails on it."""
    findings: list[Finding] = []
    for name, grad in reference.grads.items():
        if grad is not None or not reference.requires_grad[name]:
            continue
        if target == "mgpu_ddp":
            findings.append(
                Finding(
                    "error",
                    "no-gradient",
                    name,
                    f"`{name}` requires grad but got no gradient from the training step. Under mgpu_ddp, DDP then"
                    ' fails at the next step ("Expected to have finished reduction in the prior iteration"). Pass'
                    " strategy=lightning_mgpu.DDPStrategy(find_unused_parameters=True) (static_graph=True if the"
                    " same parameters are unused every step), or freeze it with requires_grad_(False), or remove it.",
                )
            )
        else:
            findings.append(
                Finding(
                    "warning",
                    "no-gradient",
                    name,
                    f"`{name}` requires grad but got no gradient from the training step, so it is not trained."
                    " mgpu_dp runs anyway; mgpu_ddp would fail unless DDPStrategy(find_unused_parameters=True)."
                    " Freeze it with requires_grad_(False), or remove it, if it is not meant to be used.",
                )
            )
    return findings


def batch_dependent_findings(
    differing: list[Comparison], report: DoctorReport, batchnorms: list[str], random: bool
) -> list[Finding]:
    """A finding per differing output and one for all differing gradients, with the fix for the target.

    They are warnings, not errors, when ``random`` says the step draws random numbers outside ``nn.Dropout``,
    since the differences may then be that randomness only.
    """
    level: Literal["error", "warning"] = "warning" if random else "error"
    chunks = " + ".join(str(size) for size in report.chunk_sizes)
    between = f"between one device and {chunks} rows on {len(report.chunk_sizes)} replicas"
    cause = (
        f", here BatchNorm ({', '.join(batchnorms)}) normalising each chunk by its own statistics" if batchnorms else ""
    )
    fix = _batch_dependent_fix(report.target, bool(batchnorms))
    doubt = (
        " The step is random outside nn.Dropout (see random-step), so this may be that randomness only."
        if random
        else ""
    )
    findings: list[Finding] = []
    outputs = [comparison for comparison in differing if comparison.kind == "output"]
    for comparison in outputs:
        size = comparison.note if comparison.max_abs_diff is None else f"max abs diff {comparison.max_abs_diff:.3g}"
        message = (
            f"`{comparison.what}` differs {between} ({size}): training_step does batch-wise work that each replica"
            f" does on its chunk only{cause}. {fix}{doubt}"
        )
        findings.append(Finding(level, "batch-dependent", comparison.what, message))
    gradients = [comparison for comparison in differing if comparison.kind == "gradient"]
    if gradients:
        names = [comparison.what.removesuffix(".grad") for comparison in gradients]
        worst = max(gradients, key=_sort_key)
        size = "" if worst.max_abs_diff is None else f" (max abs diff {worst.max_abs_diff:.3g} at {worst.what})"
        message = (
            f"The gradients of {len(names)} parameter(s) differ {between}{size}: the loss depends on batch-wise work"
            f" done per chunk{cause}. {'The fix above applies.' if outputs else fix}{doubt}"
        )
        findings.append(Finding(level, "batch-dependent", _short_list(names), message))
    return findings


def _batch_dependent_fix(target: Target, batchnorm: bool) -> str:
    if target == "mgpu_ddp":
        return (
            "Under mgpu_ddp training_step_end receives only the rank's own output: gather what must span the global"
            " batch there with self.all_gather(..., sync_grads=True)"
            + ("; for BatchNorm, pass Trainer(sync_batchnorm=True)." if batchnorm else ".")
        )
    return (
        "Move the batch-wise computation (means over the batch, in-batch negatives, top-k across the batch) into"
        " training_step_end, which receives the outputs of every replica gathered"
        + ("; for BatchNorm, use SyncBatchNorm under mgpu_ddp or accept per-replica statistics." if batchnorm else ".")
    )


def _sort_key(comparison: Comparison) -> float:
    return -1.0 if comparison.max_abs_diff is None else comparison.max_abs_diff


def random_finding(where: str) -> Finding:
    """The warning that ``where`` changes with the seed on one device, so differences may be randomness."""
    return Finding(
        "warning",
        "random-step",
        where,
        f"`{where}` changes with the seed on one device: the step draws random numbers outside nn.Dropout modules"
        " (F.dropout, torch.randn, sampling), which replicas draw in a different order, so differences between the"
        " runs may be that randomness and are reported as warnings. Make the randomness an nn.Dropout module, or"
        " switch it off while checking, to compare exactly.",
    )


def step_failed(error: BaseException) -> Finding:
    """The error for a step that raised on one device, where nothing was split yet."""
    return Finding(
        "error",
        "step-failed",
        "training_step",
        f"training_step raised on one device, before any split: {_describe_error(error)}. The doctor runs the step"
        " outside a Trainer, so a step that needs self.trainer or self.optimizers() cannot be checked.",
    )


def split_failed(error: BaseException, replicas: int) -> Finding:
    """The error for a step that raised only when split: not splittable, not gatherable, or a replica's own error."""
    if isinstance(error, GatherError):
        return Finding("error", "not-gatherable", _gather_path(str(error)), str(error))
    if isinstance(error, BatchSplitError):
        return Finding("error", "not-splittable", "batch", str(error))
    return Finding(
        "error",
        "replica-error",
        "training_step",
        f"training_step runs on one device but raised when split across {replicas} replicas: {_describe_error(error)}",
    )


def _gather_path(message: str) -> str:
    match = re.match(r"(output\S*)", message)
    return match.group(1) if match else "output"


def _describe_error(error: BaseException) -> str:
    notes = " ".join(getattr(error, "__notes__", []))
    return f"{type(error).__name__}: {error}" + (f" ({notes})" if notes else "")


def _short_list(names: list[str], shown: int = 4) -> str:
    if len(names) <= shown:
        return ", ".join(names)
    return f"{', '.join(names[:shown])} (+{len(names) - shown} more)"
