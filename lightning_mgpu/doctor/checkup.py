"""The doctor's two entry points: ``run_doctor`` from class names and a config, ``diagnose`` from a model and a batch.

``diagnose`` runs the step on one device and split (``runs``), for ``mgpu_ddp`` each ``*_step_end`` hook on each
rank's rows too (``ranks``), compares the runs stage by stage (``compare``) and gathers the findings (``findings``)
with the structural model checks of ``lightning_mgpu.checks`` into a ``DoctorReport``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_mgpu.checks import check_model
from lightning_mgpu.doctor.compare import compare_ranks, compare_runs, differing
from lightning_mgpu.doctor.findings import (
    Differences,
    batchnorm_findings,
    batchnorm_names,
    difference_findings,
    loss_findings,
    random_finding,
    rank_findings,
    split_failed,
    step_failed,
    unused_parameter_findings,
)
from lightning_mgpu.doctor.inputs import DoctorError, instantiate, probe_batch, read_config, resolve
from lightning_mgpu.doctor.ranks import run_ranks
from lightning_mgpu.doctor.report import TARGETS, DoctorReport, Target
from lightning_mgpu.doctor.runs import (
    DROPOUT,
    Run,
    quiet_unattached_logging,
    run_chunks,
    run_reference,
    run_split,
    seed_all,
)
from lightning_mgpu.engine.scatter import scatter
from lightning_mgpu.errors import BatchSplitError, Finding
from lightning_mgpu.namespaces import LIGHTNING, mixed, namespace_of
from lightning_mgpu.step.hooks import has_step_end


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
    sync_batchnorm: bool = True,
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
        sync_batchnorm: split as ``MGPUDPStrategy(sync_batchnorm=...)`` does: ``True`` (its default) gives
            BatchNorm layers the whole batch's statistics, ``False`` normalises each chunk by its own.

    Raises:
        DoctorError: the inputs do not give a model and a probe batch; the message says what to pass.
    """
    sections = read_config(config) if config is not None else {}
    model_class, model_args = resolve(
        "model", model, init_args, sections.get("model"), "LightningModule", "--model", "--init-args"
    )
    data_class, data_args = resolve(
        "data", data, data_init_args, sections.get("data"), "LightningDataModule", "--data", "--data-init-args"
    )
    problem = mixed(
        {f"the model {model_class.__name__}": model_class, f"the datamodule {data_class.__name__}": data_class}
    )
    if problem is not None:
        raise DoctorError(problem)
    if seed is None:
        configured = sections.get("seed_everything")
        seed = configured if isinstance(configured, int) and not isinstance(configured, bool) else 0
    _check_options(replicas, target, atol, rtol)
    seed_all(seed)
    module = instantiate(model_class, model_args, "model", "--init-args")
    datamodule = instantiate(data_class, data_args, "data", "--data-init-args")
    batch = probe_batch(datamodule, module)
    return diagnose(
        module,
        batch,
        replicas=replicas,
        target=target,
        seed=seed,
        atol=atol,
        rtol=rtol,
        sync_batchnorm=sync_batchnorm,
    )


def diagnose(
    model: pl.LightningModule,
    batch: Any,
    *,
    replicas: int = 2,
    target: Target = "mgpu_dp",
    seed: int = 0,
    atol: float = 1e-5,
    rtol: float = 1e-4,
    sync_batchnorm: bool = True,
) -> DoctorReport:
    """Check ``model`` for multi-GPU traps with ``batch`` as the probe; ``model`` itself is left untouched.

    Both runs work on deep copies in training mode, with every ``nn.Dropout*`` module in eval mode so that dropout's
    randomness does not look like a difference. When something differs, two more runs tell the causes apart: one
    device with another seed shows randomness in the step, and one replica running the whole batch shows what
    batch-wise work cannot explain (a replica doing something differently from the module itself).
    ``sync_batchnorm`` splits as ``MGPUDPStrategy(sync_batchnorm=...)`` does; for ``mgpu_ddp`` each chunk
    stands for a rank, whose BatchNorm layers see only its own rows and whose ``*_step_end`` hooks are also run on
    its rows alone.
    """
    _check_options(replicas, target, atol, rtol)
    report = DoctorReport(type(model).__name__, target, replicas, seed, atol, rtol)
    report.findings.extend(check_model(model))
    if target == "mgpu_ddp":
        report.findings.extend(batchnorm_findings(model))
        sync_batchnorm = False
    if not sync_batchnorm and batchnorm_names(model):
        report.notes.append(
            "BatchNorm layers normalise each chunk by its own statistics in the split run, as"
            + (" each mgpu_ddp rank does." if target == "mgpu_ddp" else " MGPUDPStrategy(sync_batchnorm=False) does.")
        )
    dropouts = [name for name, module in model.named_modules() if isinstance(module, DROPOUT)]
    if dropouts:
        report.notes.append(
            f"Dropout modules in eval mode in both runs, so their randomness does not count as a difference:"
            f" {', '.join(dropouts)}."
        )
    try:  # before any run: the probe batch is the first, so a list that reads both ways has no earlier batch to ask
        _, report.chunk_sizes = scatter(batch, [torch.device("cpu")] * replicas)
    except BatchSplitError as error:
        report.findings.append(Finding("error", "not-splittable", error.path, str(error)))
        return _sorted(report)
    report.batch_rows = sum(report.chunk_sizes)
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
    with quiet_unattached_logging():
        reference = run_reference(model, batch, seed)
        if reference.error is not None:
            report.findings.append(step_failed(reference.error))
            return _sorted(report)
        split = run_split(model, batch, seed, replicas, sync_batchnorm)
    report.loss = reference.loss_path
    report.step_end = reference.step_end
    report.findings.extend(loss_findings(model, reference))
    if reference.backward_done:
        report.findings.extend(unused_parameter_findings(reference, target))
    if split.error is not None:
        report.findings.append(split_failed(split.error, replicas, target))
        return _sorted(report)
    report.comparisons = compare_runs(reference, split, atol, rtol)
    changed = [comparison for comparison in report.comparisons if not comparison.same]
    if changed:
        with quiet_unattached_logging():
            random_at = differing(reference, run_reference(model, batch, seed + 1), atol, rtol)
            whole_batch = differing(reference, run_split(model, batch, seed, replicas=1), atol, rtol)
        if random_at:
            report.findings.append(random_finding(random_at[0]))
        differences = Differences(
            changed,
            whole_batch=frozenset(whole_batch),
            random=bool(random_at),
            step_end=reference.step_end,
            assigned=tuple(reference.assigned),
            batchnorms=tuple(batchnorm_names(model)),
            statistics_exchanged=sync_batchnorm,
            chunk_weights=_chunk_weights(model, batch, seed, replicas, reference, atol, rtol),
        )
        report.findings.extend(difference_findings(differences, report))
    if target == "mgpu_ddp":
        _step_end_on_ranks(model, batch, seed, replicas, report)
    return _sorted(report)


_RANK_STEPS = ("training_step", "validation_step", "test_step")
"""The steps whose ``*_step_end`` hook is run on each rank's rows; predictions are per row."""


def _step_end_on_ranks(model: pl.LightningModule, batch: Any, seed: int, ranks: int, report: DoctorReport) -> None:
    """For mgpu_ddp: each ``*_step_end`` hook on every rank's rows against each rank's own (``ranks``).

    Evaluation steps run on the probe batch too, in eval mode without gradients; a step the model does not define,
    or one that cannot take the training batch, is left out with a note.
    """
    base = (namespace_of(type(model)) or LIGHTNING).LightningModule
    cut = ""
    for step in _RANK_STEPS:
        if not has_step_end(model, step) or getattr(type(model), step) is getattr(base, step, None):
            continue
        runs = run_ranks(model, batch, step, seed, ranks)
        if isinstance(runs, str):
            report.notes.append(runs)
            continue
        if sum(runs.rows) != report.batch_rows:
            cut = (
                f"The *_step_end hooks ran on each rank's rows with the first {sum(runs.rows)} of the"
                f" {report.batch_rows} rows, {runs.rows[0]} per rank, as DDP's sampler gives every rank as many."
            )
        comparisons = compare_ranks(runs, report.atol, report.rtol)
        report.comparisons.extend(comparisons)
        report.findings.extend(rank_findings(runs, comparisons))
    if cut:
        report.notes.append(cut)


def _chunk_weights(
    model: pl.LightningModule, batch: Any, seed: int, replicas: int, reference: Run, atol: float, rtol: float
) -> tuple[float, ...] | None:
    """The weights that make the whole batch's loss and gradients the mean of its chunks' own, if there are any.

    Each chunk runs on one device on its own. A loss that is a mean of per-row or per-token terms is the mean of the
    chunks' losses weighted by their counts, and so are its gradients: the least-squares weights reproduce both.
    A loss that compares rows across the batch (in-batch negatives) is no such mean: ``()``. ``None`` where there is
    nothing to weigh (a ``training_step_end``, a loss that is not a scalar with gradients).
    """
    if reference.step_end or not reference.backward_done:
        return None
    with quiet_unattached_logging():
        chunks = run_chunks(model, batch, seed, replicas)
    if any(not chunk.backward_done for chunk in chunks):
        return None
    target = _loss_and_gradients(reference, reference)
    columns = torch.stack([_loss_and_gradients(chunk, reference) for chunk in chunks], dim=1)
    weights = torch.linalg.lstsq(columns, target.unsqueeze(1)).solution.squeeze(1)
    missed = (columns @ weights - target).abs().max()
    if missed > atol + rtol * target.abs().max() or bool((weights < 0).any()):
        return ()
    return tuple((weights / weights.sum()).tolist())


def _loss_and_gradients(run: Run, like: Run) -> torch.Tensor:
    """``run``'s loss and every gradient of the parameters ``like`` has, as one float64 vector (no gradient: 0)."""
    assert run.loss is not None
    parts = [run.loss.detach().reshape(1)]
    for name, expected in like.grads.items():
        grad = run.grads.get(name)
        if expected is not None:
            parts.append((torch.zeros_like(expected) if grad is None else grad).reshape(-1))
    return torch.cat([part.double() for part in parts])


def _check_options(replicas: int, target: str, atol: float, rtol: float) -> None:
    if replicas < 2:
        raise DoctorError(f"--replicas {replicas} splits nothing; pass 2 or more.")
    if target not in TARGETS:
        raise DoctorError(f"--target {target!r} is not one of {', '.join(TARGETS)}.")
    if atol < 0 or rtol < 0:
        raise DoctorError(f"--atol {atol} and --rtol {rtol} must not be negative.")


def _sorted(report: DoctorReport) -> DoctorReport:
    report.findings.sort(key=lambda finding: finding.level != "error")
    return report
