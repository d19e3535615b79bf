"""What the doctor reports: one ``Comparison`` per value compared, and the ``DoctorReport`` that holds them all.

Plain data with no behaviour beyond ``to_dict``, so that ``--json`` and the tables of ``format`` read the same thing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from lightning_mgpu.errors import Finding

Target = Literal["mgpu_dp", "mgpu_ddp"]
TARGETS: tuple[Target, ...] = ("mgpu_dp", "mgpu_ddp")
Kind = Literal["step-output", "output", "gradient", "buffer", "per-rank"]


@dataclass(frozen=True)
class Comparison:
    """One value compared between the one-device run and the split run.

    Attributes:
        what: the key path of a value: what ``training_step_end`` received (``"step output['pred']"``), what
            Lightning receives (``"output['loss']"``), a parameter's gradient (``"layer.weight.grad"``) or a buffer
            after the step (``"bn.running_mean"``).
        kind: the stage, in the order the step runs them: ``"step-output"`` (only for modules that define
            ``training_step_end``: ``training_step``'s output on one device, the replicas' outputs gathered when
            split), ``"output"`` (the hook's result, or the step's output without one), ``"gradient"``, ``"buffer"``,
            and for ``mgpu_ddp`` ``"per-rank"``: a ``*_step_end`` hook on every rank's rows (as with
            ``MGPUDDPStrategy(gather_step_end=True)``) against the same hook on each rank's own, combined over the
            ranks as DDP combines them (``what`` starts with the hook's name).
        max_abs_diff: the largest absolute difference; ``None`` when shapes differ, a value is missing, or a
            difference is not finite (NaN or inf in one run only).
        same: within ``atol + rtol * |one-device value|`` everywhere, with equal shapes.
        note: why ``max_abs_diff`` is ``None``, or anything else the numbers do not say.
    """

    what: str
    kind: Kind
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
        step_end: whether the module defines ``training_step_end``, so that what it receives was compared too.
        findings: the problems, errors first.
        comparisons: the values compared, stage by stage: step outputs, outputs, gradients (in parameter order),
            buffers.
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
    step_end: bool = False
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
            "step_end": self.step_end,
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
