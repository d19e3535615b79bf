"""``lightning-mgpu``: the command line. One subcommand per entry of ``_COMMANDS``, dispatched on the first argument.

``fit``, ``validate``, ``test`` and ``predict`` are LightningCLI's (see ``lightning_cli``); ``doctor`` is ours.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import textwrap
from collections.abc import Callable, Sequence
from typing import Any

from lightning_mgpu.doctor import TARGETS, DoctorError, DoctorReport, run_doctor

PROG = "lightning-mgpu"
EXIT_OK, EXIT_FOUND_ERRORS, EXIT_USAGE = 0, 1, 2
_MAX_GRADIENT_ROWS = 30

Command = Callable[[list[str]], int]


def main(argv: list[str] | None = None) -> int:
    """Run ``lightning-mgpu <command> ...`` and return its exit code; ``argv`` replaces ``sys.argv[1:]``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print(_help())
        return EXIT_OK
    if not args or args[0] not in _COMMANDS:
        problem = f"unknown command {args[0]!r}" if args else "no command given"
        print(f"{PROG}: {problem}.\n\n{_help()}", file=sys.stderr)
        return EXIT_USAGE
    command, _ = _COMMANDS[args[0]]
    return command(args[1:])


def doctor(argv: list[str]) -> int:
    """``lightning-mgpu doctor``: 0 when clean, 1 when there is an error finding, 2 when it cannot start."""
    try:
        args = _doctor_parser().parse_args(argv)
    except SystemExit as exit_:  # argparse exits on --help (0) and on bad arguments (2, after printing why)
        return exit_.code if isinstance(exit_.code, int) else EXIT_USAGE
    try:
        report = run_doctor(
            args.model,
            args.init_args,
            args.data,
            args.data_init_args,
            args.config,
            seed=args.seed,
            replicas=args.replicas,
            target=args.target,
            atol=args.atol,
            rtol=args.rtol,
        )
    except DoctorError as error:
        print(f"{PROG} doctor: {error}", file=sys.stderr)
        return EXIT_USAGE
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_report(report))
    return EXIT_FOUND_ERRORS if report.errors else EXIT_OK


def _lightning(subcommand: str) -> Command:
    def command(argv: list[str]) -> int:
        from lightning_mgpu.lightning_cli import run  # imported on use: doctor alone needs no LightningCLI

        return run(subcommand, argv)

    return command


_COMMANDS: dict[str, tuple[Command, str]] = {
    "fit": (_lightning("fit"), "train a model from a YAML config and command-line overrides (LightningCLI)"),
    "validate": (_lightning("validate"), "run the validation loop once"),
    "test": (_lightning("test"), "run the test loop once"),
    "predict": (_lightning("predict"), "run prediction"),
    "doctor": (doctor, "find a LightningModule's multi-GPU traps on the CPU, before GPU hours are spent"),
}


def _help() -> str:
    width = max(len(name) for name in _COMMANDS)
    listing = "\n".join(f"  {name:<{width}}  {summary}" for name, (_, summary) in _COMMANDS.items())
    return (
        f"usage: {PROG} <command> [options]\n\ncommands:\n{listing}\n\n"
        f"Run '{PROG} <command> --help' for the options of a command."
    )


_EXAMPLE = (
    "example:\n  lightning-mgpu doctor --model examples/density.py:DensityModel"
    " --data examples/density.py:GaussianMixtureData --config configs/quickstart.yaml\n\n"
    "exit codes: 0 no error found, 1 error findings, 2 bad arguments or a class that cannot be loaded."
)


def _doctor_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"{PROG} doctor",
        description=textwrap.fill(
            "Run one training step on the first batch of the datamodule, on one device and split across virtual CPU"
            " replicas as mgpu_dp splits it, and compare outputs, loss and gradients; report them with the"
            " structural multi-GPU traps, unused parameters and BatchNorm layers.",
            width=88,
        ),
        epilog=_EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    spec = "package.module.ClassName or path/to/file.py:ClassName"
    parser.add_argument("--model", help=f"the LightningModule: {spec}; overrides the config's model.class_path")
    parser.add_argument("--init-args", type=_json_object, help="the model's init args as a JSON object")
    parser.add_argument("--data", help=f"the LightningDataModule: {spec}; overrides the config's data.class_path")
    parser.add_argument("--data-init-args", type=_json_object, help="the datamodule's init args as a JSON object")
    parser.add_argument(
        "--config",
        help="a LightningCLI YAML file; its model: and data: sections ({class_path, init_args} or plain init args)"
        " and seed_everything are used, the rest ignored; --init-args and --data-init-args override it",
    )
    parser.add_argument("--replicas", type=int, default=2, help="virtual replicas of the split run (default 2)")
    parser.add_argument(
        "--target", choices=TARGETS, default="mgpu_dp", help="the strategy to judge findings for (default mgpu_dp)"
    )
    parser.add_argument("--seed", type=int, help="seed of the model, batch and runs (default: the config's, or 0)")
    parser.add_argument("--atol", type=float, default=1e-5, help="absolute tolerance of comparisons (default 1e-5)")
    parser.add_argument("--rtol", type=float, default=1e-4, help="relative tolerance of comparisons (default 1e-4)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    return parser


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON ({error}); pass an object such as '{{\"lr\": 0.01}}'") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON {type(value).__name__}; pass an object such as '{{\"lr\": 0.01}}'")
    return value


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
    comparisons = report.comparisons
    gradients = [comparison for comparison in comparisons if comparison.kind == "gradient"]
    hidden = 0
    if len(gradients) > _MAX_GRADIENT_ROWS:
        shown = [comparison for comparison in comparisons if comparison.kind == "output" or not comparison.same]
        hidden = len(comparisons) - len(shown)
        comparisons = shown
    with_notes = any(comparison.note for comparison in comparisons)
    headers = ["what", "max abs diff", "verdict", *(["note"] if with_notes else [])]
    rows = [
        [
            comparison.what,
            "-" if comparison.max_abs_diff is None else f"{comparison.max_abs_diff:.3g}",
            comparison.verdict,
            *([comparison.note] if with_notes else []),
        ]
        for comparison in comparisons
    ]
    lines = _table(headers, rows, width)
    if hidden:
        lines.append(f"... and {hidden} more gradients, all the same (--json lists them)")
    return lines


def _table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], width: int, caps: Sequence[int | None] = ()
) -> list[str]:
    """Columns as wide as their longest cell, or ``caps[i]``; cells wrap, the last column to fit ``width``."""
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows, strict=True)]
    for index, cap in enumerate(caps):
        if cap is not None:
            widths[index] = min(widths[index], cap)
    widths[-1] = min(widths[-1], max(40, width - sum(widths[:-1]) - 2 * (len(widths) - 1)))
    lines = [_row(headers, widths), _row(["-" * size for size in widths], widths)]
    for row in rows:
        cells = [textwrap.wrap(cell, size) or [""] for cell, size in zip(row, widths, strict=True)]
        for line in range(max(len(cell) for cell in cells)):
            lines.append(_row([cell[line] if line < len(cell) else "" for cell in cells], widths))
    return lines


def _row(cells: Sequence[str], widths: Sequence[int]) -> str:
    return "  ".join(f"{cell:<{size}}" for cell, size in zip(cells, widths, strict=True)).rstrip()


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"
