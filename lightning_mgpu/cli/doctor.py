"""``lightning-mgpu doctor``: its arguments, and the report printed as tables or JSON."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from typing import Any

from lightning_mgpu.doctor import TARGETS, DoctorError, format_report, run_doctor
from lightning_mgpu.program import EXIT_FOUND_ERRORS, EXIT_OK, EXIT_USAGE, PROG


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
