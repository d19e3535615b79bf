"""The doctor's report as plain-text tables: the findings, the comparisons, the notes and the verdict.

Columns are as wide as their longest cell and the last one wraps to the terminal, so long messages stay readable.
"""

from __future__ import annotations

import shutil
import textwrap
from collections.abc import Mapping, Sequence

from lightning_mgpu.doctor.report import Comparison, DoctorReport
from lightning_mgpu.program import EXIT_FOUND_ERRORS, EXIT_OK, PROG

_MAX_ROWS = 30
_LONG = ("gradient", "buffer")
"""The stages that can run to thousands of rows: past ``_MAX_ROWS``, the table lists only their differing rows."""


def format_report(report: DoctorReport, width: int | None = None) -> str:
    """The report as plain-text tables: the findings, then the comparisons, then the notes and the verdict."""
    width = width or shutil.get_terminal_size(fallback=(120, 24)).columns
    split = " + ".join(str(size) for size in report.chunk_sizes) or "not split"
    rows = "" if report.batch_rows is None else f" of {_count(report.batch_rows, 'row')}"
    lines = [
        f"{PROG} doctor: {report.model}, probe batch{rows} split {split} across {report.replicas} virtual"
        f" replicas, judged for {report.target}, seed {report.seed}",
        "",
    ]
    if report.findings:
        lines.append("Findings")
        table = [[finding.level, finding.check, finding.where, finding.message] for finding in report.findings]
        lines.extend(_table(["level", "check", "where", "message"], table, width, caps=(None, None, 32)))
    else:
        lines.append("Findings: none")
    lines.append("")
    if report.comparisons:
        loss = f"; the loss is {report.loss}" if report.loss else ""
        lines.append(
            f"Comparisons: one device vs {_count(len(report.chunk_sizes), 'replica')} (atol {report.atol:g},"
            f" rtol {report.rtol:g}){loss}"
        )
        lines.extend(_comparison_table(report, width))
        lines.append("")
    lines.extend(f"Note: {note}" for note in report.notes)
    errors, warnings = len(report.errors), len(report.warnings)
    verdict = f"{_count(errors, 'error')}, {_count(warnings, 'warning')}"
    lines.append(f"{verdict}: exit {EXIT_FOUND_ERRORS if errors else EXIT_OK}")
    return "\n".join(lines)


def _comparison_table(report: DoctorReport, width: int) -> list[str]:
    """One table, in stages under their own headings; when a stage is long, only its differing rows are listed."""
    stages = {
        "step-output": "training_step's output, gathered from the replicas: what training_step_end receives",
        "output": (
            "training_step_end's result: what Lightning receives"
            if report.step_end
            else "training_step's output: what Lightning receives (chunk losses averaged by chunk size)"
        ),
        "gradient": "gradients",
        "buffer": "buffers after the step",
        "per-rank": (
            "mgpu_ddp: each *_step_end hook on every rank's rows (gather_step_end=True) vs on each rank's own,"
            " combined over the ranks (the default)"
        ),
    }
    shown: list[Comparison] = []
    hidden: list[str] = []
    for kind in stages:
        of_kind = [comparison for comparison in report.comparisons if comparison.kind == kind]
        if kind in _LONG and len(of_kind) > _MAX_ROWS:
            listed = [comparison for comparison in of_kind if not comparison.same]
            hidden.append(_count(len(of_kind) - len(listed), f"more {kind}"))
            of_kind = listed
        shown.extend(of_kind)
    with_notes = any(comparison.note for comparison in shown)
    headers = ["what", "max abs diff", "verdict", *(["note"] if with_notes else [])]
    rows = [
        [
            f"  {comparison.what}",
            "-" if comparison.max_abs_diff is None else f"{comparison.max_abs_diff:.3g}",
            comparison.verdict,
            *([comparison.note] if with_notes else []),
        ]
        for comparison in shown
    ]
    headings: dict[int, str] = {}
    for index, comparison in enumerate(shown):
        if index == 0 or shown[index - 1].kind != comparison.kind:
            headings[index] = stages[comparison.kind]
    lines = _table(headers, rows, width, headings=headings)
    if hidden:
        lines.append(f"... and {' and '.join(hidden)}, all the same (--json lists them)")
    return lines


def _table(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    width: int,
    caps: Sequence[int | None] = (),
    headings: Mapping[int, str] | None = None,
) -> list[str]:
    """Columns as wide as their longest cell, or ``caps[i]``; cells wrap, the last column to fit ``width``.

    ``headings`` puts a line of its own before the row of that index, outside the columns.
    """
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows, strict=True)]
    for index, cap in enumerate(caps):
        if cap is not None:
            widths[index] = min(widths[index], cap)
    widths[-1] = min(widths[-1], max(40, width - sum(widths[:-1]) - 2 * (len(widths) - 1)))
    lines = [_row(headers, widths), _row(["-" * size for size in widths], widths)]
    for index, row in enumerate(rows):
        if headings and index in headings:
            lines.append(headings[index])
        cells = [textwrap.wrap(cell, size) or [""] for cell, size in zip(row, widths, strict=True)]
        for line in range(max(len(cell) for cell in cells)):
            lines.append(_row([cell[line] if line < len(cell) else "" for cell in cells], widths))
    return lines


def _row(cells: Sequence[str], widths: Sequence[int]) -> str:
    return "  ".join(f"{cell:<{size}}" for cell, size in zip(cells, widths, strict=True)).rstrip()


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"
