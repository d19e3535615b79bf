"""Turning the runs and their comparisons into findings: what is wrong for the target strategy, and how to fix it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import lightning.pytorch as pl
from torch import nn

from lightning_mgpu._compat import BatchNorm
from lightning_mgpu.checks import Finding
from lightning_mgpu.doctor.ranks import RankRuns
from lightning_mgpu.doctor.report import Comparison, DoctorReport, Kind, Target
from lightning_mgpu.doctor.runs import Run
from lightning_mgpu.errors import BatchSplitError, GatherError, ReplicaStateError
from lightning_mgpu.step.hooks import has_step_end


def batchnorm_names(model: nn.Module) -> list[str]:
    """The BatchNorm layers that normalise by their own batch; SyncBatchNorm's statistics already span the ranks."""
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, BatchNorm) and not isinstance(module, nn.SyncBatchNorm)
    ]


def batchnorm_findings(model: nn.Module) -> list[Finding]:
    """A warning per BatchNorm layer under mgpu_ddp, where each rank normalises by its own batch.

    Under mgpu_dp the split run shows what BatchNorm does (see ``difference_findings``), so no warning is given
    before it.
    """
    findings: list[Finding] = []
    for name in batchnorm_names(model):
        kind = type(model.get_submodule(name)).__name__
        message = (
            f"`{name}` ({kind}) normalises with each rank's own batch under mgpu_ddp, and keeps per-rank running"
            " statistics (mgpu_ddp does not broadcast buffers). Pass Trainer(sync_batchnorm=True): mgpu_ddp then"
            " gives it the statistics of every rank's rows, as one device's, on GPUs (torch's SyncBatchNorm) and"
            " on CPU processes alike."
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
                    " strategy=lightning_mgpu.MGPUDDPStrategy(find_unused_parameters=True) (static_graph=True if the"
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
                    " mgpu_dp runs anyway; mgpu_ddp would fail unless MGPUDDPStrategy(find_unused_parameters=True)."
                    " Freeze it with requires_grad_(False), or remove it, if it is not meant to be used.",
                )
            )
    return findings


@dataclass(frozen=True)
class Differences:
    """What the split run changed, and what the doctor's extra runs say about it.

    Attributes:
        differing: the comparisons that differ between one device and the split run, in stage order.
        whole_batch: the key paths that differ also when one replica runs the whole batch, which batch-wise work
            cannot explain: a replica does something differently from the module itself.
        random: whether the step draws random numbers outside ``nn.Dropout``, so differences may be that.
        step_end: whether the module defines ``training_step_end``.
        assigned: the attributes that ``training_step`` assigned on the module on one device.
        batchnorms: the BatchNorm layers of the model that normalise by their own batch.
        statistics_exchanged: whether the split run gave BatchNorm the whole batch's statistics
            (``sync_batchnorm=True``), so a BatchNorm layer that still differs is not fixed by that option.
        chunk_weights: the weights (summing to 1) that make the whole batch's loss and gradients the mean of those
            of each replica's chunk run on its own; ``()`` when no weights do, ``None`` when not measured.
    """

    differing: list[Comparison]
    whole_batch: frozenset[str] = frozenset()
    random: bool = False
    step_end: bool = False
    assigned: tuple[str, ...] = ()
    batchnorms: tuple[str, ...] = ()
    statistics_exchanged: bool = False
    chunk_weights: tuple[float, ...] | None = None

    def of(self, kind: Kind) -> list[Comparison]:
        """The differing comparisons of one stage."""
        return [comparison for comparison in self.differing if comparison.kind == kind]

    @property
    def per_replica_batchnorms(self) -> list[str]:
        """The BatchNorm layers whose running statistics differ: they normalised each chunk by its own statistics.

        Judged from the run, not assumed, since the engine may give every replica the whole batch's statistics.
        """
        changed = {_owner(comparison.what) for comparison in self.of("buffer")}
        return [layer for layer in self.batchnorms if layer in changed]


def difference_findings(differences: Differences, report: DoctorReport) -> list[Finding]:
    """The findings that explain the differences, each naming its key paths, the likely cause and the fix.

    A difference is blamed on the first stage it shows in: what ``training_step`` returned (batch-wise work in the
    step), else ``training_step_end``'s result (state the replicas did not hand back), else the gradients (the
    backward depends on something the outputs do not show); later stages that follow from it say so. Buffers are
    judged on their own, since replicas update them from their chunks whatever the outputs do.
    """
    text = _Wording.of(differences, report)
    roots = differences.of("step-output" if differences.step_end else "output")
    results = differences.of("output") if differences.step_end else []
    gradients = differences.of("gradient")
    findings = [_root_finding(comparison, differences, text, bool(results or gradients)) for comparison in roots]
    if results:
        if roots:
            findings.append(_follow_on(results, roots, differences, text))
        else:
            findings.append(_step_end_finding(results, differences, text))
    if gradients:
        if roots or results:
            findings.append(_follow_on(gradients, roots or results, differences, text))
        else:
            findings.append(_backward_finding(gradients, differences, text))
    findings.extend(_buffer_findings(differences.of("buffer"), differences, text, report))
    return findings


@dataclass(frozen=True)
class _Wording:
    """The phrases the difference findings share."""

    level: Literal["error", "warning"]
    between: str
    cause: str
    fix: str
    doubt: str
    target: Target

    @classmethod
    def of(cls, differences: Differences, report: DoctorReport) -> _Wording:
        chunks = " + ".join(str(size) for size in report.chunk_sizes)
        batchnorms = ", ".join(differences.per_replica_batchnorms)
        return cls(
            level="warning" if differences.random else "error",
            between=f"between one device and {chunks} rows on {len(report.chunk_sizes)} replicas",
            cause=f", here BatchNorm ({batchnorms}) normalising each chunk by its own statistics" if batchnorms else "",
            fix=_batch_dependent_fix(report.target, bool(batchnorms), differences.statistics_exchanged),
            doubt=(
                " The step is random outside nn.Dropout (see random-step), so this may be that randomness only."
                if differences.random
                else ""
            ),
            target=report.target,
        )

    @property
    def replica_level(self) -> Literal["error", "warning"]:
        """Only mgpu_dp has replicas: what only a replica does is a warning when judging for mgpu_ddp."""
        return "warning" if self.target == "mgpu_ddp" else self.level

    @property
    def dp_only(self) -> str:
        if self.target != "mgpu_ddp":
            return ""
        return " mgpu_ddp runs the step on the module itself, so this concerns mgpu_dp only."


def _root_finding(comparison: Comparison, differences: Differences, text: _Wording, downstream: bool) -> Finding:
    what = f"`{comparison.what}`"
    if comparison.kind == "step-output":
        what += ", which training_step_end receives,"
    differs = f"{what} differs {text.between} ({_size([comparison])})"
    if comparison.what in differences.whole_batch:
        return Finding(
            text.replica_level,
            "replica-state",
            comparison.what,
            f"{differs}, and also when one replica runs the whole batch, so it is not batch-wise work: training_step"
            " reads something that is not the same inside a replica as on the module itself, such as state kept on"
            " self or a module's parameters read other than through its forward. Compute it from the step's inputs"
            " through the modules' forward, or in training_step_end, where self is the module itself."
            f"{text.dp_only}{text.doubt}",
        )
    batch_wise = (
        f"{differs}: training_step does batch-wise work that each replica does on its own chunk only{text.cause}."
    )
    if differences.step_end and not downstream:
        return Finding(
            "warning",
            "batch-dependent",
            comparison.what,
            f"{batch_wise} training_step_end's result and the gradients are the same here, so the hook absorbs the"
            " difference for this batch; it may not for chunks of unequal size, such as a smaller last batch."
            f" {text.fix}{text.doubt}",
        )
    return Finding(
        text.level,
        "batch-dependent",
        comparison.what,
        f"{batch_wise} {_loss_hint(comparison, differences, text)}{text.fix}{text.doubt}",
    )


def _loss_hint(comparison: Comparison, differences: Differences, text: _Wording) -> str:
    """For a loss combined by weights, what the chunks' own losses show, which decides the first fix to offer.

    A mean over a count other than the rows (tokens, unmasked positions) lies between its chunks' losses, and
    ``loss_weight`` makes the combination exact; a loss outside them compares rows across the batch, which only
    moving the work into ``training_step_end`` fixes.
    """
    if differences.step_end or text.target == "mgpu_ddp" or comparison.what not in ("output", "output['loss']"):
        return ""
    weights = differences.chunk_weights
    if weights == ():
        return (
            "No weighting of the chunks' own losses gives the whole batch's loss and gradients, so loss_weight"
            " cannot fix it: the step compares rows across the batch, as in-batch negatives or a ranking over the"
            " batch do. "
        )
    found = (
        f" (here the whole batch's loss and gradients are the chunks' own weighted {_ratio(weights)}, not by rows)"
        if weights
        else ""
    )
    return (
        "If the loss is a mean over a count other than the rows (tokens, unmasked positions, pairs), return"
        " {'loss': loss, 'loss_weight': count} from training_step: mgpu_dp then weighs each replica's loss by its"
        f" count instead of its rows, which equals one device's mean{found}. Otherwise: "
    )


def _ratio(weights: tuple[float, ...]) -> str:
    return " : ".join(f"{weight:.3g}" for weight in weights)


def _follow_on(
    comparisons: list[Comparison], sources: list[Comparison], differences: Differences, text: _Wording
) -> Finding:
    """The finding for a later stage that differs because ``sources`` do: their check, their cause, their fix."""
    named = _quoted([source.what for source in sources])
    if sources[0].kind == "output" and differences.step_end:
        check, level = "step-end-state", text.replica_level
        cause = f"{named}, where training_step_end reads state the replicas did not hand back"
    elif all(source.what in differences.whole_batch for source in sources):
        check, level = "replica-state", text.replica_level
        cause = f"{named}, which {_verb(sources, 'differs', 'differ')} even when one replica runs the whole batch"
    else:
        check, level = "batch-dependent", text.level
        cause = f"{named}, which training_step computes batch-wise on each replica's chunk{text.cause}"
    paths = [comparison.what for comparison in comparisons]
    if comparisons[0].kind == "gradient":
        stage = _gradients([path.removesuffix(".grad") for path in paths])
        where = _short_list([path.removesuffix(".grad") for path in paths])
    else:
        stage = f"training_step_end's result {_quoted(paths)}"
        where = _short_list(paths)
    return Finding(
        level,
        check,
        where,
        f"{stage} {_verb(comparisons, 'differs', 'differ')} {text.between} ({_size(comparisons)}), a consequence of"
        f" {cause} (see above). The fix above applies.{text.doubt}",
    )


def _step_end_finding(results: list[Comparison], differences: Differences, text: _Wording) -> Finding:
    paths = [comparison.what for comparison in results]
    if differences.assigned:
        state = (
            f" training_step assigns {_quoted(['self.' + name for name in differences.assigned])}; inside a replica"
            " it is computed from that replica's chunk of the batch, so training_step_end reads a chunk's value,"
            " not the batch's."
        )
    else:
        state = (
            " It reads state that the replicas changed in training_step (an attribute, or an object such as a list or"
            " dict that every replica mutates), which is not what one device leaves."
        )
    return Finding(
        text.replica_level,
        "step-end-state",
        _short_list(paths),
        f"training_step_end's result {_quoted(paths)} {_verb(results, 'differs', 'differ')} {text.between}"
        f" ({_size(results)}) although every step output it receives is the same: training_step_end depends on"
        f" something the replicas did not hand back.{state}"
        " Return what training_step_end needs from training_step, so that it is gathered from every replica."
        f"{text.dp_only}{text.doubt}",
    )


def _backward_finding(gradients: list[Comparison], differences: Differences, text: _Wording) -> Finding:
    names = [comparison.what.removesuffix(".grad") for comparison in gradients]
    if any(comparison.what in differences.whole_batch for comparison in gradients):
        cause = (
            " They differ also when one replica runs the whole batch, so a replica reads something differently from"
            " the module: parameters used inside training_step other than through the modules' forward, or state"
            f" kept on self. Compute such terms in training_step_end, where self is the module.{text.dp_only}"
        )
        level = text.replica_level
    else:
        cause = (
            " The backward pass depends on the chunk in a way the returned values do not show: a gradient scaled or"
            " replaced by a statistic of the chunk (a straight-through estimator such as x.detach() + ..., a custom"
            " autograd Function, a gradient hook), or a term of the loss computed per replica that is not returned."
            " Compute the batch statistic in training_step_end, on the outputs gathered from every replica."
        )
        level = text.level
    return Finding(
        level,
        "backward-dependent",
        _short_list(names),
        f"{_gradients(names)} {_verb(gradients, 'differs', 'differ')} {text.between} ({_size(gradients)})"
        f" although every output of the step is the same.{cause}{text.doubt}",
    )


def _buffer_findings(
    buffers: list[Comparison], differences: Differences, text: _Wording, report: DoctorReport
) -> list[Finding]:
    """Buffers whose update in a replica is lost, BatchNorm statistics, other buffers updated per chunk."""
    lost = [comparison for comparison in buffers if comparison.what in differences.whole_batch]
    per_chunk = [comparison for comparison in buffers if comparison not in lost]
    statistics = [comparison for comparison in per_chunk if _owner(comparison.what) in differences.batchnorms]
    others = [comparison for comparison in per_chunk if comparison not in statistics]
    first_chunk = f"replica 0's chunk of {report.chunk_sizes[0]} rows" if report.chunk_sizes else "replica 0's chunk"
    findings: list[Finding] = []
    if lost:
        names = [comparison.what for comparison in lost]
        findings.append(
            Finding(
                text.replica_level,
                "buffer-update",
                _short_list(names),
                f"{_buffers(names)} {_verb(lost, 'differs', 'differ')} after the step {text.between} ({_size(lost)}),"
                " and also when one replica runs the whole batch: the update training_step makes inside a replica does"
                " not reach the module, as when a buffer is reassigned (self.count = self.count + 1) instead of"
                " updated in place. Update it in place (self.count += 1, self.mean.copy_(...)), or in"
                f" training_step_end, where self is the module itself.{text.dp_only}{text.doubt}",
            )
        )
    if statistics and report.target == "mgpu_dp":
        # Under mgpu_ddp the up-front batchnorm warning already says what to do.
        for layer in differences.per_replica_batchnorms:
            of_layer = [comparison for comparison in statistics if _owner(comparison.what) == layer]
            findings.append(_per_replica_batchnorm(layer, of_layer, text, first_chunk))
    if others:
        names = [comparison.what for comparison in others]
        if text.target == "mgpu_ddp":
            fix = (
                "Under mgpu_ddp each rank updates its own copy from its own batch and the ranks drift apart (buffers"
                " are not broadcast unless MGPUDDPStrategy(broadcast_buffers=True)); combine the update over the ranks"
                " (self.all_gather) before applying it."
            )
        else:
            fix = (
                "Under mgpu_dp every replica left it at the same value, each from its own chunk (a count of its"
                " rows, say), and the module keeps that value once. Return what the update needs from training_step"
                " and update the buffer in training_step_end, from the outputs of every replica."
            )
        findings.append(
            Finding(
                text.level,
                "buffer-update",
                _short_list(names),
                f"{_buffers(names)} {_verb(others, 'differs', 'differ')} after the step {text.between}"
                f" ({_size(others)}): training_step updates {_verb(others, 'it', 'them')} in each replica from that"
                f" replica's chunk. {fix}{text.doubt}",
            )
        )
    return findings


def _per_replica_batchnorm(layer: str, statistics: list[Comparison], text: _Wording, first_chunk: str) -> Finding:
    names = [comparison.what for comparison in statistics]
    return Finding(
        "warning",
        "batchnorm",
        layer,
        f"`{layer}` (BatchNorm) normalises with per-replica statistics under mgpu_dp: its running statistics"
        f" {_quoted(names)} {_verb(statistics, 'differs', 'differ')} after the step {text.between}"
        f" ({_size(statistics)}), as each replica uses the mean and variance of its own chunk, not of the whole"
        f" batch, and only replica 0's running statistics are kept, computed from {first_chunk}. Keep"
        " MGPUDPStrategy's default sync_batchnorm=True, which gives every replica the whole batch's"
        " statistics, or accept per-replica statistics (with enough rows per replica); under mgpu_ddp, use"
        f" SyncBatchNorm (Trainer(sync_batchnorm=True)).{text.doubt}",
    )


def _batch_dependent_fix(target: Target, batchnorm: bool, statistics_exchanged: bool) -> str:
    if target == "mgpu_ddp":
        return (
            "Move the batch-wise computation (means over the batch, in-batch negatives, top-k across the batch) into"
            " training_step_end and construct MGPUDDPStrategy(gather_step_end=True), under which the hook receives"
            " every rank's outputs gathered in global batch order, differentiably (by default it receives only the"
            " rank's own)" + ("; for BatchNorm, pass Trainer(sync_batchnorm=True)." if batchnorm else ".")
        )
    if not batchnorm:
        batchnorm_fix = "."
    elif statistics_exchanged:
        batchnorm_fix = (
            "; the BatchNorm layers differ although every call of torch's batch-norm function (F.batch_norm)"
            " received the whole batch's statistics, so they normalise some other way: compute the normalisation"
            " with F.batch_norm, or replace them by GroupNorm or LayerNorm."
        )
    else:
        batchnorm_fix = (
            "; for BatchNorm, leave MGPUDPStrategy's sync_batchnorm at its default, True, which gives every replica"
            " the whole batch's statistics."
        )
    return (
        "Move the batch-wise computation (means over the batch, in-batch negatives, top-k across the batch) into"
        " training_step_end, which receives the outputs of every replica gathered" + batchnorm_fix
    )


def _size(comparisons: list[Comparison]) -> str:
    """The largest difference among ``comparisons``, and where it is when there are several."""
    worst = max(
        comparisons, key=lambda comparison: -1.0 if comparison.max_abs_diff is None else comparison.max_abs_diff
    )
    if worst.max_abs_diff is None:
        return worst.note if len(comparisons) == 1 else f"{worst.note} at {worst.what}"
    at = f" at {worst.what}" if len(comparisons) > 1 else ""
    return f"max abs diff {worst.max_abs_diff:.3g}{at}"


def _owner(buffer: str) -> str:
    return buffer.rpartition(".")[0]


def _quoted(paths: list[str], shown: int | None = None) -> str:
    """The paths in backticks, all of them unless ``shown`` limits them."""
    listed = ", ".join(f"`{path}`" for path in paths[:shown])
    return listed if shown is None or len(paths) <= shown else f"{listed} and {len(paths) - shown} more"


def _verb(items: list[Any], one: str, more: str) -> str:
    return one if len(items) == 1 else more


def _gradients(names: list[str]) -> str:
    if len(names) == 1:
        return f"The gradient of `{names[0]}`"
    return f"The gradients of {len(names)} parameters ({_quoted(names, 8)})"


def _buffers(names: list[str]) -> str:
    return f"The buffer{'' if len(names) == 1 else 's'} {_quoted(names)}"


def _gather_step_end(hook: str, what: str, training: bool = False) -> str:
    """The fix for a ``*_step_end`` hook that needs every rank's rows under mgpu_ddp: ``gather_step_end=True``."""
    how = ", differentiably," if training else ""
    scaling = ", with no world-size scaling to write" if training else ""
    return (
        f"Construct MGPUDDPStrategy(gather_step_end=True): every rank's {hook} then receives the outputs of every"
        f" rank gathered in global batch order{how} and computes {what} over the global batch as one device does"
        f"{scaling} (in a config: trainer.strategy: {{class_path: lightning_mgpu.MGPUDDPStrategy, init_args:"
        " {gather_step_end: true}}). Under mgpu_dp the hook already receives every row."
    )


def rank_findings(runs: RankRuns, comparisons: list[Comparison]) -> list[Finding]:
    """The finding for a ``*_step_end`` hook whose result under mgpu_ddp depends on rows of more than one rank.

    An error when the training loss or its gradients differ, or when the hook raises on a rank's rows only; a
    warning when only logged values differ (a metric reported over a rank's rows instead of the global batch).
    """
    hook, share, rows, ranks = runs.hook, runs.rows[0], sum(runs.rows), len(runs.rows)
    alone = f"Under mgpu_ddp, by default, each rank's {hook} receives only that rank's output."
    if runs.failed:
        rank, error = runs.failed[0]
        return [
            Finding(
                "error",
                "step-end-needs-every-rank",
                hook,
                f"{hook} raises on rank {rank}'s {share} rows ({_describe_error(error)}) but not on all {rows} rows"
                f" of the {ranks} ranks: it needs rows of more than one rank (a top-k over more rows than a rank"
                f" holds, say). {alone} {_gather_step_end(hook, 'its result')}",
            )
        ]
    differing = [comparison for comparison in comparisons if not comparison.same]
    by_name = {f"{hook}: self.log({name!r})": name for name in runs.gathered.logged}
    logged = [comparison for comparison in differing if comparison.what in by_name]
    training = [comparison for comparison in differing if comparison not in logged]
    names = [by_name[comparison.what] for comparison in logged]
    on_ranks = f"on each rank's {share} rows, combined over the {ranks} ranks as"
    if training and runs.loss_path is not None:
        loss = [comparison for comparison in training if comparison.what == f"{hook}: {runs.loss_path}"]
        gradients = [comparison for comparison in training if comparison not in loss]
        passed_back = _quoted(
            [comparison.what.removeprefix(f"{hook}: ").removesuffix(".grad") for comparison in gradients], 8
        )
        if loss:
            differs = f"it differs from the loss on all {rows} rows ({_size(loss)})"
            differs += f", and so do the gradients it passes back to {passed_back}" if gradients else ""
        else:
            differs = (
                f"its value equals the loss on all {rows} rows, but the gradients it passes back to {passed_back}"
                f" differ ({_size(gradients)})"
            )
        also = (
            f" It also logs {_quoted(names)}, which {_verb(names, 'differs', 'differ')} the same way." if names else ""
        )
        return [
            Finding(
                "error",
                "step-end-needs-every-rank",
                f"{hook}: {runs.loss_path}",
                f"{hook}'s loss `{runs.loss_path}` depends on rows of more than one rank: {on_ranks} DDP averages"
                f" their gradients (what mgpu_ddp trains on), {differs}. {alone} A loss over the batch (in-batch"
                " negatives, as in CLIP or SimCLR; a softmax or a statistic over the batch; a sum where a mean over"
                f" the rows is meant) then covers the rank's rows only.{also}"
                f" {_gather_step_end(hook, 'the loss', training=True)}",
            )
        ]
    if not logged:
        return []
    return [
        Finding(
            "warning",
            "step-end-needs-every-rank",
            f"{hook}: {_short_list([f'self.log({name!r})' for name in names])}",
            f"{hook} logs {_quoted(names)} with values that depend on rows of more than one rank: {on_ranks}"
            f" self.log(..., sync_dist=True) combines them, they differ from the values on all {rows} rows"
            f" ({_size(logged)}). {alone} A metric over the batch (a retrieval recall, a ranking, a statistic over"
            f" the batch) is then computed over the rank's rows and reported so."
            f" {_gather_step_end(hook, 'them')}",
        )
    ]


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


def split_failed(error: BaseException, replicas: int, target: str) -> Finding:
    """The error for a step that raised only when split: not splittable, not gatherable, or a replica's own error."""
    if isinstance(error, GatherError):
        return Finding("error", "not-gatherable", error.path, str(error))
    if isinstance(error, BatchSplitError):
        return Finding("error", "not-splittable", error.path, str(error))
    if isinstance(error, ReplicaStateError) and error.buffer:
        name = error.path.removeprefix("self.")
        if target == "mgpu_ddp":
            message = (
                f"The buffer `{name}` is updated in training_step from each replica's chunk, so each rank would update"
                f" its own copy from its own batch and the ranks drift apart (buffers are not broadcast unless"
                " MGPUDDPStrategy(broadcast_buffers=True)); combine the update over the ranks (self.all_gather) before"
                " applying it."
            )
        else:
            message = f"Under mgpu_dp: {error}"
        return Finding("error", "buffer-update", name, message)
    return Finding(
        "error",
        "replica-error",
        "training_step",
        f"training_step runs on one device but raised when split across {replicas} replicas: {_describe_error(error)}",
    )


def _describe_error(error: BaseException) -> str:
    notes = " ".join(getattr(error, "__notes__", []))
    return f"{type(error).__name__}: {error}" + (f" ({notes})" if notes else "")


def _short_list(names: list[str], shown: int = 4) -> str:
    if len(names) <= shown:
        return ", ".join(names)
    return f"{', '.join(names[:shown])} (+{len(names) - shown} more)"
