"""Entry point: ``python -m benchmarks.run [--quick|--smoke] [--device cpu|cuda] [--out DIR]``.

Runs, in one go and on one machine, every benchmark of ``benchmarks/README.md``: the multi-process jobs (hand-written
DDP, Lightning ``ddp``, ``mgpu_ddp``, and ``mgpu_ddp`` on one process), the single-process variants (``mgpu_dp``,
its engine, one device, ``MGPUMixin``), the engine-overhead cases, the micro-benchmarks and the profiles, then writes
``results.json``, ``results.md`` and ``results.png`` under ``--out``. Without ``--quick`` or ``--smoke`` it runs the
full mode.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import ddp_suite, local_suite, micro, overhead, report
from benchmarks.models import mode_settings

RESULTS = Path(os.path.abspath(__file__)).parent / "results"


def _say(message: str) -> None:
    print(message, flush=True)


def _git_revision() -> str:
    root = Path(os.path.abspath(__file__)).parents[1]
    try:
        revision = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "lightning_mgpu"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown revision"
    return f"{revision}{' + uncommitted changes' if dirty else ''}"


def _absolute(ddp: dict[str, Any], local: dict[str, Any]) -> dict[str, dict[str, dict[str, float]]]:
    table: dict[str, dict[str, dict[str, float]]] = {}
    for model, per_variant in ddp.get("samples_per_s", {}).items():
        for variant, values in per_variant.items():
            steps = ddp["step_s"][model][variant]
            table.setdefault(model, {})[variant] = {
                "step_ms": statistics.median(steps) * 1e3,
                "samples_per_s": statistics.median(values),
            }
    for model, per_variant in local.get("measurements", {}).items():
        for variant, runs in per_variant.items():
            table.setdefault(model, {})[variant] = {
                "step_ms": statistics.median(run["step_s"] for run in runs) * 1e3,
                "samples_per_s": statistics.median(run["samples_per_s"] for run in runs),
            }
    return table


def main(argv: list[str] | None = None) -> int:
    """Run the benchmarks and write the results; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[1])
    speed = parser.add_mutually_exclusive_group()
    speed.add_argument("--quick", action="store_true", help="a few minutes on 2 CPU cores")
    speed.add_argument("--smoke", action="store_true", help="seconds: checks that everything runs, measures nothing")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--out", type=Path, help=f"output folder (default: {RESULTS}{os.sep}<device>-<mode>, e.g. cpu-quick)"
    )
    parser.add_argument(
        "--isolated",
        action="store_true",
        help="run each multi-process variant as its own job (default: the variants of one world size take turns in"
        " the same processes, which a busy machine disturbs less)",
    )
    parser.add_argument("--skip-ddp", action="store_true", help="leave out the multi-process jobs")
    parser.add_argument(
        "--traces",
        action="store_true",
        help="also write the mgpu_dp profiles as Chrome traces (profile-<model>.trace.json)",
    )
    args = parser.parse_args(argv)

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    mode = mode_settings("smoke" if args.smoke else "quick" if args.quick else "full", args.device)
    if args.out is None:
        args.out = RESULTS / f"{args.device}-{mode.name}"
    devices = local_suite.replica_devices(args.device)
    # One DDP process per GPU (NCCL refuses two on one card); on the CPU, one per virtual replica.
    world_size = len(devices) if args.device == "cpu" else len(set(devices))
    started = time.perf_counter()
    load_before = _load()
    _say(f"lightning_mgpu benchmarks: {mode.name} mode on {args.device}, {world_size} devices/processes -> {args.out}")

    ddp: dict[str, Any] = {}
    if not args.skip_ddp:
        _say("multi-process jobs (hand-written DDP, Lightning ddp, mgpu_ddp):")
        ddp = ddp_suite.run_suite(mode, args.device, world_size, _say, isolated=args.isolated)
    _say("single-process variants (one device, mgpu_dp, engine, MGPUMixin):")
    local = local_suite.run_suite(mode, args.device, _say)

    from benchmarks.profiling import profile_mgpu_dp  # imports Lightning; after the suites, like the rest

    _say("engine overhead (CPU proxy, 1 thread):")
    overhead_cases = overhead.measure(mode.overhead_loops, mode.overhead_repeats, warmup=min(20, mode.overhead_loops))
    _say("micro-benchmarks and profiles:")
    threads = torch.get_num_threads()
    if args.device == "cpu":
        torch.set_num_threads(1)
    try:
        micro_repeats = max(3, mode.local_repeats)
        per_step = micro.per_step_costs(mode.models[0], devices[0], micro_repeats)
        results_micro = {"per_step": per_step}
        args.out.mkdir(parents=True, exist_ok=True)
        profiles = {}
        for spec in mode.models:
            profiled = dataclasses.replace(spec, steps=mode.profile_steps)
            profiles[spec.name] = profile_mgpu_dp(profiled, devices, args.out, trace=args.traces)
    finally:
        torch.set_num_threads(threads)

    mixin_us = per_step["training_step_with_mixin"]["median_us"] - per_step["training_step_plain"]["median_us"]
    rows = (
        ([] if not ddp else report.ddp_rows(ddp))
        + report.local_rows(local, args.device, mixin_us)
        + report.overhead_rows(overhead_cases)
    )
    results = {
        "meta": {
            "mode": mode.name,
            "device": args.device,
            "world_size": world_size,
            "torch": torch.__version__,
            "lightning": _lightning_version(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "gpus": ", ".join(torch.cuda.get_device_name(d) for d in devices) if args.device == "cuda" else "",
            "git": _git_revision(),
            "when": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "duration_s": time.perf_counter() - started,
            "load_average": {"before": load_before, "after": _load()},
            "ddp_repeats": mode.ddp_repeats,
            "ddp_layout": ddp.get("layout", "not run"),
            "local_repeats": mode.local_repeats,
            "models": [dataclasses.asdict(spec) for spec in mode.models],
            "command": " ".join([Path(sys.executable).name, "-m", "benchmarks.run", *(argv or sys.argv[1:])]),
        },
        "rows": [row.as_dict() for row in rows],
        "phases": report.phase_table(local),
        "overhead": overhead.summary(overhead_cases),
        "absolute": _absolute(ddp, local),
        "micro": results_micro,
        "profile_dp": profiles,
        "profile_ddp": ddp.get("profiles", {}),
        "raw": {"ddp": ddp, "local": local, "overhead": overhead_cases},
    }
    report.write(results, args.out)
    _say((args.out / "results.md").read_text())
    _say(f"wrote {args.out / 'results.json'}, {args.out / 'results.md'} ({results['plot']})")
    return 0


def _load() -> list[float] | None:
    """The 1, 5 and 15 minute load averages: how busy the machine was (other jobs skew every number)."""
    try:
        return [round(value, 2) for value in os.getloadavg()]
    except OSError:
        return None


def _lightning_version() -> str:
    import lightning

    return str(lightning.__version__)


if __name__ == "__main__":
    sys.exit(main())
