"""Entry point: ``python -m benchmarks.run [--quick|--smoke] [--device cpu|cuda] [--out DIR]``.

Runs every benchmark of ``benchmarks/README.md`` (the multi-process jobs, the single-process variants, the engine
overhead cases, exact BatchNorm, the profiles) and writes ``results.json`` and ``results.md`` under ``--out``.
Without ``--quick`` or ``--smoke`` it runs the full mode.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import batchnorm, ddp_suite, local_suite, overhead, report
from benchmarks.models import intra_op_threads, mode_settings

ROOT = Path(os.path.abspath(__file__)).parents[1]
RESULTS = ROOT / "runs" / "benchmarks"
"""Where a run writes unless ``--out`` says otherwise: git ignores it. The reference results kept in the repository
(``benchmarks/results/<device>-<mode>``) are written by asking for that folder with ``--out``."""


def _say(message: str) -> None:
    print(message, flush=True)


def _git_revision() -> str:
    command = ["git", "describe", "--always", "--dirty=+uncommitted", "--exclude=*"]
    try:
        return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown revision"


def main(argv: list[str] | None = None) -> int:
    """Run the benchmarks and write the results; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[1])
    speed = parser.add_mutually_exclusive_group()
    speed.add_argument("--quick", action="store_true", help="a few minutes on 2 CPU cores")
    speed.add_argument("--smoke", action="store_true", help="seconds: checks that everything runs, measures nothing")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--out", type=Path, help=f"output folder (default: {RESULTS}{os.sep}<device>-<mode>)")
    parser.add_argument("--isolated", action="store_true", help="each multi-process variant as its own job (default:"
                        " the variants of one world size take turns in the same processes)")  # fmt: skip
    parser.add_argument("--skip-ddp", action="store_true", help="leave out the multi-process jobs")
    parser.add_argument("--traces", action="store_true", help="also write the mgpu_dp profiles as Chrome traces")
    args = parser.parse_args(argv)

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    mode = mode_settings("smoke" if args.smoke else "quick" if args.quick else "full", args.device)
    out: Path = args.out or RESULTS / f"{args.device}-{mode.name}"
    out.mkdir(parents=True, exist_ok=True)
    devices = local_suite.replica_devices(args.device)
    # One DDP process per GPU (NCCL refuses two on one card); on the CPU, one per virtual replica.
    world_size = len(devices) if args.device == "cpu" else len(set(devices))
    started, load_before = time.perf_counter(), os.getloadavg()  # other jobs on the machine skew every number
    _say(f"lightning_mgpu benchmarks: {mode.name} mode on {args.device}, {world_size} devices/processes -> {out}")

    ddp: dict[str, Any] = {}
    if not args.skip_ddp:
        _say("multi-process jobs (hand-written DDP, Lightning ddp, mgpu_ddp):")
        ddp = ddp_suite.run_suite(mode, args.device, world_size, _say, args.isolated)
    _say("single-process variants (one device, mgpu_dp, engine, MGPUMixin):")
    local = local_suite.run_suite(mode, args.device, _say)
    _say("engine overhead (CPU proxy, 1 thread):")
    overhead_cases = overhead.measure(mode.overhead_loops, mode.overhead_repeats, warmup=min(20, mode.overhead_loops))
    _say("exact BatchNorm under mgpu_dp (CPU proxy, 2 replicas, 1 thread):")
    batchnorm_times = batchnorm.measure(mode.name)
    batchnorm_profile = batchnorm.profile(mode.name, out / "profile-batchnorm.trace.json" if args.traces else None)
    _say("MGPUMixin's wrapper and the mgpu_dp profiles:")
    from benchmarks.profiling import profile_mgpu_dp

    with intra_op_threads(args.device):
        mixin_us = local_suite.mixin_wrapper_us(mode.local_repeats)
        profiles = {spec.name: profile_mgpu_dp(dataclasses.replace(spec, steps=mode.profile_steps), devices, out,
                                               args.traces) for spec in mode.models}  # fmt: skip

    rows = (report.ddp_rows(ddp) if ddp else []) + report.local_rows(local, args.device, mixin_us)
    import lightning

    results = {
        "meta": {
            "mode": mode.name, "device": args.device, "world_size": world_size, "torch": torch.__version__,
            "lightning": lightning.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
            "gpus": ", ".join(torch.cuda.get_device_name(d) for d in devices) if args.device == "cuda" else "",
            "git": _git_revision(), "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "duration_s": time.perf_counter() - started,
            "load_average": {"before": load_before, "after": os.getloadavg()},
            "ddp_repeats": mode.ddp_repeats, "ddp_layout": ddp.get("layout", "not run"),
            "local_repeats": mode.local_repeats, "models": [dataclasses.asdict(spec) for spec in mode.models],
            "command": " ".join([Path(sys.executable).name, "-m", "benchmarks.run", *(argv or sys.argv[1:])]),
        },
        "rows": rows + report.overhead_rows(overhead_cases) + report.batchnorm_rows(batchnorm_times),
        "phases": report.phase_table(local),
        "overhead": overhead.summary(overhead_cases),
        "batchnorm": batchnorm.summary(batchnorm_times),
        "mixin_wrapper_us": mixin_us,
        "profile_dp": profiles,
        "profile_batchnorm": batchnorm_profile,
        "profile_ddp": ddp.get("profiles", {}),
        "raw": {"ddp": ddp, "local": local, "overhead": overhead_cases, "batchnorm": batchnorm_times},
    }  # fmt: skip
    report.write(results, out)
    _say((out / "results.md").read_text())
    _say(f"wrote {out / 'results.json'} and {out / 'results.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
