"""The doctor: find a LightningModule's multi-GPU traps on a laptop, before GPU hours are spent on them.

It runs one training step on a probe batch twice, on one device and split across virtual CPU replicas exactly as
``mgpu_dp`` splits it, and compares the outputs, the loss and every gradient. A difference means the step does
batch-wise work that each replica can only do on its own chunk. The structural checks of ``model_checks`` and
findings about unused parameters and BatchNorm complete the report. ``cli.py`` prints the report; nothing here
prints.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import importlib.util
import math
import numbers
import random
import re
import sys
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import numpy as np
import torch
import yaml
from torch import nn

from lightning_mgpu.engine import DataParallel, chunk_sizes
from lightning_mgpu.engine.scatter import batch_size_of
from lightning_mgpu.errors import BatchSplitError, GatherError
from lightning_mgpu.hooks import call_step_end, caller_runs_step_end, has_step_end
from lightning_mgpu.model_checks import Finding, check_model
from lightning_mgpu.strategies._replica_step import run_replica_step

Target = Literal["mgpu_dp", "mgpu_ddp"]
TARGETS: tuple[Target, ...] = ("mgpu_dp", "mgpu_ddp")

_DROPOUT = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
_BATCH_HOOKS = ("on_before_batch_transfer", "on_after_batch_transfer")
_SPEC_HELP = "package.module.ClassName (importable from the current directory) or path/to/file.py:ClassName"


class DoctorError(ValueError):
    """The doctor cannot start: a class that does not load, init args that do not fit, no probe batch."""


@dataclass(frozen=True)
class Comparison:
    """One value compared between the one-device run and the split run.

    Attributes:
        what: the key path of an output (``"output['loss']"``) or a parameter's gradient (``"layer.weight.grad"``).
        kind: ``"output"`` or ``"gradient"``.
        max_abs_diff: the largest absolute difference; ``None`` when shapes differ, a value is missing, or a
            difference is not finite (NaN or inf in one run only).
        same: within ``atol + rtol * |one-device value|`` everywhere, with equal shapes.
        note: why ``max_abs_diff`` is ``None``, or anything else the numbers do not say.
    """

    what: str
    kind: Literal["output", "gradient"]
    max_abs_diff: float | None
    same: bool
    note: str = ""

    @property
    def verdict(self) -> Literal["same", "differs"]:
        """``"same"`` or ``"differs"``, as the table prints it."""
        return "same" if self.same else "differs"


@dataclass
class DoctorReport:
    """Everything the doctor found about one model on one probe batch.

    Attributes:
        model: the LightningModule's class name.
        target: the strategy the findings are judged for (``"mgpu_dp"`` or ``"mgpu_ddp"``).
        replicas: the virtual replicas the split run asked for.
        seed: the seed both runs started from.
        atol: the absolute tolerance of the comparisons.
        rtol: the relative tolerance of the comparisons.
        batch_rows: the probe batch's rows along dim 0; ``None`` when the batch cannot be split.
        chunk_sizes: the rows each replica received in the split run.
        loss: the key path of the loss in the step's output, or ``None`` when the step returned no loss.
        findings: the problems, errors first.
        comparisons: the values compared, outputs first, then gradients in parameter order.
        notes: what the doctor did that affects how to read the rest (dropout switched off, ...).
    """

    model: str
    target: Target
    replicas: int
    seed: int
    atol: float
    rtol: float
    batch_rows: int | None = None
    chunk_sizes: list[int] = field(default_factory=list)
    loss: str | None = None
    findings: list[Finding] = field(default_factory=list)
    comparisons: list[Comparison] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def errors(self) -> list[Finding]:
        """The error-level findings: each one breaks or silently changes multi-GPU training."""
        return [finding for finding in self.findings if finding.level == "error"]

    @property
    def warnings(self) -> list[Finding]:
        """The warning-level findings: worth knowing, training still runs as written."""
        return [finding for finding in self.findings if finding.level == "warning"]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: the settings, ``findings``, ``comparisons`` and a ``summary``."""
        return {
            "model": self.model,
            "target": self.target,
            "replicas": self.replicas,
            "seed": self.seed,
            "atol": self.atol,
            "rtol": self.rtol,
            "batch_rows": self.batch_rows,
            "chunk_sizes": list(self.chunk_sizes),
            "loss": self.loss,
            "findings": [asdict(finding) for finding in self.findings],
            "comparisons": [{**asdict(comparison), "verdict": comparison.verdict} for comparison in self.comparisons],
            "notes": list(self.notes),
            "summary": {
                "errors": len(self.errors),
                "warnings": len(self.warnings),
                "compared": len(self.comparisons),
                "differ": sum(not comparison.same for comparison in self.comparisons),
                "ok": not self.errors,
            },
        }


def run_doctor(
    model: str | None = None,
    init_args: Mapping[str, Any] | None = None,
    data: str | None = None,
    data_init_args: Mapping[str, Any] | None = None,
    config: str | Path | None = None,
    *,
    seed: int | None = None,
    replicas: int = 2,
    target: Target = "mgpu_dp",
    atol: float = 1e-5,
    rtol: float = 1e-4,
) -> DoctorReport:
    """Load the model and datamodule as ``lightning-mgpu doctor`` names them, and diagnose the first training batch.

    Args:
        model: the LightningModule class as ``package.module.ClassName`` or ``path/to/file.py:ClassName``;
            overrides the config's ``model.class_path``.
        init_args: the model's init args; override the config's.
        data: the LightningDataModule class, spelt like ``model``; overrides the config's ``data.class_path``.
        data_init_args: the datamodule's init args; override the config's.
        config: a LightningCLI-style YAML file; its ``model:`` and ``data:`` sections are used (either
            ``{class_path, init_args}`` or plain init args), and ``seed_everything`` is the default seed.
        seed: seeds the model's initialisation, the probe batch and both runs; the config's ``seed_everything``,
            else 0, when ``None``.
        replicas: virtual replicas for the split run.
        target: the strategy to judge the findings for.
        atol: absolute tolerance of the comparisons.
        rtol: relative tolerance of the comparisons.

    Raises:
        DoctorError: the inputs do not give a model and a probe batch; the message says what to pass.
    """
    sections = read_config(config) if config is not None else {}
    model_class, model_args = _resolve(
        "model", model, init_args, sections.get("model"), pl.LightningModule, "--model", "--init-args"
    )
    data_class, data_args = _resolve(
        "data", data, data_init_args, sections.get("data"), pl.LightningDataModule, "--data", "--data-init-args"
    )
    if seed is None:
        configured = sections.get("seed_everything")
        seed = configured if isinstance(configured, int) and not isinstance(configured, bool) else 0
    _check_options(replicas, target, atol, rtol)
    _seed(seed)
    module = instantiate(model_class, model_args, "model", "--init-args")
    datamodule = instantiate(data_class, data_args, "data", "--data-init-args")
    batch = probe_batch(datamodule, module)
    return diagnose(module, batch, replicas=replicas, target=target, seed=seed, atol=atol, rtol=rtol)


def load_class(spec: str, option: str = "--model") -> type:
    """The class named by ``package.module.ClassName`` or ``path/to/file.py:ClassName``.

    A file is imported as a module of its own (registered in ``sys.modules``, its folder put on ``sys.path`` as
    ``python file.py`` would), once per file, so a model and a datamodule from the same file share it. The current
    directory is importable, as under ``python -m``, because the console script alone would not make it so.
    """
    file_part, colon, class_name = spec.rpartition(":")
    if colon and file_part.endswith(".py"):
        module = _import_file(Path(file_part), spec, option)
    else:
        module_name, dot, class_name = spec.rpartition(".")
        if not dot or not module_name or not class_name:
            raise DoctorError(f"{option} {spec!r} names no class. Pass {option} as {_SPEC_HELP}.")
        if "" not in sys.path and str(Path.cwd()) not in sys.path:
            sys.path.insert(0, str(Path.cwd()))
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            raise DoctorError(
                f"{option} {spec!r}: cannot import {module_name!r} ({error}). Pass {option} as {_SPEC_HELP}."
            ) from error
    found = getattr(module, class_name, None)
    if not isinstance(found, type):
        defined = sorted(
            name
            for name, value in vars(module).items()
            if isinstance(value, type) and value.__module__ == module.__name__
        )
        listing = f" (it defines {', '.join(defined)})" if defined else ""
        raise DoctorError(f"{option} {spec!r}: no class {class_name!r} there{listing}. Pass {option} as {_SPEC_HELP}.")
    return found


def read_config(path: str | Path) -> dict[str, Any]:
    """The YAML config as a dict; only its ``model``, ``data`` and ``seed_everything`` keys are used."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise DoctorError(f"--config {str(path)!r} cannot be read ({error}); pass the path of a YAML file.") from error
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise DoctorError(f"--config {str(path)!r} is not valid YAML: {error}") from error
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise DoctorError(
            f"--config {str(path)!r} holds a {type(loaded).__name__}; it must be a mapping with model: and data:"
            " sections, as LightningCLI writes it."
        )
    return loaded


def instantiate(cls: type, init_args: Mapping[str, Any], section: str, option: str) -> Any:
    """``cls(**init_args)`` as LightningCLI builds it: types checked and converted, nested ``class_path`` built.

    Building through jsonargparse, as LightningCLI does, makes the doctor's model the one ``fit --config`` trains.
    """
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(cls, section, fail_untyped=False)
    try:
        parsed = parser.parse_object({section: dict(init_args)})
    except Exception as error:
        raise DoctorError(
            f"The init args for {cls.__name__} do not fit its __init__: {error}. Fix {option} or the config's"
            f" {section}: section."
        ) from error
    build = getattr(parser, "instantiate", None) or parser.instantiate_classes  # renamed in jsonargparse 4.49
    try:
        return getattr(build(parsed), section)
    except Exception as error:
        raise DoctorError(
            f"{cls.__name__}(...) raised {type(error).__name__}: {error}. Fix {option} or the config's {section}:"
            " section."
        ) from error


def probe_batch(datamodule: pl.LightningDataModule, module: pl.LightningModule | None = None) -> Any:
    """The first batch of ``datamodule.train_dataloader()`` after ``prepare_data()`` and ``setup("fit")``.

    The batch goes through ``on_before_batch_transfer`` and ``on_after_batch_transfer`` (the datamodule's where it
    overrides them, else the module's, as Lightning chooses), since batch-wise augmentation there is part of the
    step the replicas see.
    """
    name = type(datamodule).__name__
    try:
        datamodule.prepare_data()
        datamodule.setup("fit")
        batch = next(iter(datamodule.train_dataloader()))
    except StopIteration as error:
        raise DoctorError(f"{name}.train_dataloader() yields no batch; give the datamodule some data.") from error
    except Exception as error:
        raise DoctorError(
            f"{name} could not give a probe batch: {type(error).__name__}: {error}. The doctor calls prepare_data(),"
            " setup('fit') and takes the first batch of train_dataloader()."
        ) from error
    for hook in _BATCH_HOOKS:
        owner: Any = datamodule if _overrides(datamodule, pl.LightningDataModule, hook) else module
        if owner is not None:
            try:
                batch = getattr(owner, hook)(batch, 0)
            except Exception as error:
                raise DoctorError(
                    f"{type(owner).__name__}.{hook} raised {type(error).__name__}: {error}. The doctor runs it outside"
                    " a Trainer, so it cannot use self.trainer."
                ) from error
    return batch


def diagnose(
    model: pl.LightningModule,
    batch: Any,
    *,
    replicas: int = 2,
    target: Target = "mgpu_dp",
    seed: int = 0,
    atol: float = 1e-5,
    rtol: float = 1e-4,
) -> DoctorReport:
    """Check ``model`` for multi-GPU traps with ``batch`` as the probe; ``model`` itself is left untouched.

    Both runs work on deep copies in training mode, with every ``nn.Dropout*`` module in eval mode so that dropout's
    randomness does not look like a difference. When something differs, a third run with another seed tells
    differences caused by batch-wise work from those caused by other randomness in the step.
    """
    _check_options(replicas, target, atol, rtol)
    report = DoctorReport(type(model).__name__, target, replicas, seed, atol, rtol)
    report.findings.extend(check_model(model))
    report.findings.extend(_batchnorm_findings(model, target, replicas))
    dropouts = [name for name, module in model.named_modules() if isinstance(module, _DROPOUT)]
    if dropouts:
        report.notes.append(
            f"Dropout modules in eval mode in both runs, so their randomness does not count as a difference:"
            f" {', '.join(dropouts)}."
        )
    try:
        report.batch_rows = batch_size_of(batch)
    except BatchSplitError as error:
        report.findings.append(Finding("error", "not-splittable", "batch", str(error)))
        return _sorted(report)
    report.chunk_sizes = chunk_sizes(report.batch_rows, replicas)
    if len(report.chunk_sizes) < 2:
        report.findings.append(
            Finding(
                "warning",
                "small-batch",
                "batch",
                f"The probe batch has {report.batch_rows} row, so one replica ran and the comparison cannot show"
                " batch-wise work. Give the datamodule a batch size of at least the number of replicas.",
            )
        )
    with _quiet_unattached_logging():
        reference = _run_reference(model, batch, seed)
        if reference.error is not None:
            report.findings.append(_step_failed(reference.error))
            return _sorted(report)
        split = _run_split(model, batch, seed, replicas)
    report.loss = reference.loss_path
    report.findings.extend(_loss_findings(model, reference))
    if reference.backward_done:
        report.findings.extend(_unused_parameter_findings(reference, target))
    if split.error is not None:
        report.findings.append(_split_failed(split.error, replicas))
        return _sorted(report)
    report.comparisons = _compare(reference, split, atol, rtol)
    differing = [comparison for comparison in report.comparisons if not comparison.same]
    if differing:
        with _quiet_unattached_logging():
            reseeded = _run_reference(model, batch, seed + 1)
        random_at = _first_difference(reference, reseeded, atol, rtol)
        if random_at is not None:
            report.findings.append(_random_finding(random_at))
        batchnorms = _batchnorm_names(model)
        report.findings.extend(_batch_dependent_findings(differing, report, batchnorms, random_at is not None))
    return _sorted(report)


@dataclass
class _Run:
    output: Any = None
    loss_path: str | None = None
    loss: torch.Tensor | None = None
    backward_done: bool = False
    grads: dict[str, torch.Tensor | None] = field(default_factory=dict)
    requires_grad: dict[str, bool] = field(default_factory=dict)
    error: BaseException | None = None


def _run_reference(model: pl.LightningModule, batch: Any, seed: int) -> _Run:
    module = _fresh_copy(model)
    _seed(seed)
    try:
        with caller_runs_step_end(module):
            output = call_step_end(module, "training_step", module.training_step(copy.deepcopy(batch), 0))
        return _finish(module, output)
    except Exception as error:
        return _Run(error=error)


def _run_split(model: pl.LightningModule, batch: Any, seed: int, replicas: int) -> _Run:
    module = _fresh_copy(model)
    wrapper = DataParallel(module, [torch.device("cpu")] * replicas)
    _seed(seed)
    try:
        with caller_runs_step_end(module):
            output = run_replica_step(wrapper, module, "training_step", (copy.deepcopy(batch), 0), {})
        return _finish(module, output)
    except Exception as error:
        return _Run(error=error)
    finally:
        wrapper.close()


def _fresh_copy(model: pl.LightningModule) -> pl.LightningModule:
    module = copy.deepcopy(model)
    module.train()
    for submodule in module.modules():
        if isinstance(submodule, _DROPOUT):
            submodule.eval()
    # Outside the replicas the module is "replica 0 of 1", as DataParallelStrategy.setup makes it.
    setattr(module, "replica_index", 0)  # noqa: B010 - nn.Module's typed __setattr__ rejects an int
    setattr(module, "num_replicas", 1)  # noqa: B010
    return module


def _finish(module: pl.LightningModule, output: Any) -> _Run:
    run = _Run(output=output)
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


def _compare(reference: _Run, split: _Run, atol: float, rtol: float) -> list[Comparison]:
    comparisons: list[Comparison] = []
    ours = dict(_leaves(reference.output, "output"))
    theirs = dict(_leaves(split.output, "output"))
    for path in [*ours, *(path for path in theirs if path not in ours)]:
        if path not in theirs:
            comparisons.append(Comparison(path, "output", None, False, "missing from the split run's output"))
        elif path not in ours:
            comparisons.append(Comparison(path, "output", None, False, "only in the split run's output"))
        elif ours[path] is not None or theirs[path] is not None:
            comparisons.append(_compare_values(path, "output", ours[path], theirs[path], atol, rtol))
    for name, grad in reference.grads.items():
        other = split.grads.get(name)
        if grad is None and other is None:
            continue
        what = f"{name}.grad"
        if grad is None:
            comparisons.append(Comparison(what, "gradient", None, False, "no gradient on one device"))
        elif other is None:
            comparisons.append(Comparison(what, "gradient", None, False, "no gradient in the split run"))
        else:
            comparisons.append(_compare_values(what, "gradient", grad, other, atol, rtol))
    return comparisons


def _compare_values(
    what: str, kind: Literal["output", "gradient"], ours: Any, theirs: Any, atol: float, rtol: float
) -> Comparison:
    if not isinstance(ours, torch.Tensor) or not isinstance(theirs, torch.Tensor):
        if isinstance(ours, torch.Tensor) or isinstance(theirs, torch.Tensor):
            note = f"{_describe(ours)} on one device, {_describe(theirs)} in the split run"
            return Comparison(what, kind, None, False, note)
        if isinstance(ours, numbers.Number) and isinstance(theirs, numbers.Number):
            ours, theirs = torch.tensor(ours), torch.tensor(theirs)
        else:
            same = bool(ours == theirs)
            return Comparison(what, kind, 0.0 if same else None, same, "" if same else f"{ours!r} vs {theirs!r}")
    if ours.shape != theirs.shape:
        note = f"shape {tuple(ours.shape)} on one device, {tuple(theirs.shape)} in the split run"
        return Comparison(what, kind, None, False, note)
    a = ours.detach().to("cpu", torch.float64)
    b = theirs.detach().to("cpu", torch.float64)
    same = bool(torch.allclose(b, a, rtol=rtol, atol=atol, equal_nan=True))
    if a.numel() == 0:
        return Comparison(what, kind, 0.0, same)
    difference = torch.where(a == b, torch.zeros_like(a), (a - b).abs())
    difference = torch.where(torch.isnan(a) & torch.isnan(b), torch.zeros_like(a), difference)
    largest = float(difference.max())
    if not math.isfinite(largest):
        return Comparison(what, kind, None, same, "NaN or inf in one run only")
    return Comparison(what, kind, largest, same)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"{type(value).__name__} {value!r}"


def _leaves(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield from _leaves(item, f"{path}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _leaves(item, f"{path}[{index}]")
    else:
        yield path, value


def _first_difference(reference: _Run, other: _Run, atol: float, rtol: float) -> str | None:
    if other.error is not None:
        return None
    for comparison in _compare(reference, other, atol, rtol):
        if not comparison.same:
            return comparison.what
    return None


def _batchnorm_names(model: nn.Module) -> list[str]:
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, nn.SyncBatchNorm)
    ]


def _batchnorm_findings(model: nn.Module, target: Target, replicas: int) -> list[Finding]:
    findings: list[Finding] = []
    for name in _batchnorm_names(model):
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


def _loss_findings(model: pl.LightningModule, reference: _Run) -> list[Finding]:
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


def _unused_parameter_findings(reference: _Run, target: Target) -> list[Finding]:
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


def _batch_dependent_findings(
    differing: list[Comparison], report: DoctorReport, batchnorms: list[str], random: bool
) -> list[Finding]:
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


def _random_finding(where: str) -> Finding:
    return Finding(
        "warning",
        "random-step",
        where,
        f"`{where}` changes with the seed on one device: the step draws random numbers outside nn.Dropout modules"
        " (F.dropout, torch.randn, sampling), which replicas draw in a different order, so differences between the"
        " runs may be that randomness and are reported as warnings. Make the randomness an nn.Dropout module, or"
        " switch it off while checking, to compare exactly.",
    )


def _step_failed(error: BaseException) -> Finding:
    return Finding(
        "error",
        "step-failed",
        "training_step",
        f"training_step raised on one device, before any split: {_describe_error(error)}. The doctor runs the step"
        " outside a Trainer, so a step that needs self.trainer or self.optimizers() cannot be checked.",
    )


def _split_failed(error: BaseException, replicas: int) -> Finding:
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


def _sorted(report: DoctorReport) -> DoctorReport:
    report.findings.sort(key=lambda finding: finding.level != "error")
    return report


def _resolve(
    section: str,
    spec: str | None,
    init_args: Mapping[str, Any] | None,
    configured: Any,
    base: type,
    option: str,
    args_option: str,
) -> tuple[type, dict[str, Any]]:
    config_spec, config_args = _config_section(section, configured)
    spec = spec or config_spec
    if spec is None:
        raise DoctorError(
            f"No {section} class: pass {option} as {_SPEC_HELP}, or a {section}: section with class_path in --config."
        )
    cls = load_class(spec, option)
    if not issubclass(cls, base):
        raise DoctorError(f"{option} {spec!r} is a {cls.__name__}, not a {base.__name__}; pass a {base.__name__}.")
    return cls, {**config_args, **dict(init_args or {})}


def _config_section(section: str, configured: Any) -> tuple[str | None, dict[str, Any]]:
    if configured is None:
        return None, {}
    if isinstance(configured, str):
        return configured, {}
    if not isinstance(configured, Mapping):
        raise DoctorError(
            f"The config's {section}: section is a {type(configured).__name__}; write it as init args, or as"
            " class_path: and init_args:."
        )
    if "class_path" in configured:
        return str(configured["class_path"]), dict(configured.get("init_args") or {})
    return None, dict(configured)


def _import_file(path: Path, spec: str, option: str) -> Any:
    if not path.is_file():
        raise DoctorError(f"{option} {spec!r}: no file {str(path)!r}. Pass {option} as {_SPEC_HELP}.")
    resolved = path.resolve()
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:8]
    stem = re.sub(r"\W", "_", resolved.stem)
    name = f"_mgpu_doctor_{stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    if str(resolved.parent) not in sys.path:
        sys.path.insert(0, str(resolved.parent))
    loader_spec = importlib.util.spec_from_file_location(name, resolved)
    if loader_spec is None or loader_spec.loader is None:
        raise DoctorError(f"{option} {spec!r}: {str(path)!r} cannot be imported as Python.")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name while it runs
    try:
        loader_spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[name]
        raise DoctorError(
            f"{option} {spec!r}: importing {str(path)!r} raised {type(error).__name__}: {error}"
        ) from error
    return module


def _overrides(obj: Any, base: type, name: str) -> bool:
    return getattr(type(obj), name, None) is not getattr(base, name, None)


def _check_options(replicas: int, target: str, atol: float, rtol: float) -> None:
    if replicas < 2:
        raise DoctorError(f"--replicas {replicas} splits nothing; pass 2 or more.")
    if target not in TARGETS:
        raise DoctorError(f"--target {target!r} is not one of {', '.join(TARGETS)}.")
    if atol < 0 or rtol < 0:
        raise DoctorError(f"--atol {atol} and --rtol {rtol} must not be negative.")


def _seed(seed: int) -> None:
    """Seed what ``seed_everything`` seeds, without its environment variable (the doctor runs inside processes)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@contextmanager
def _quiet_unattached_logging() -> Iterator[None]:
    """Silence Lightning's warning that ``self.log`` does nothing without a Trainer: the doctor has none."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*`self\.log\(\)` but the `self\.trainer` reference")
        yield
