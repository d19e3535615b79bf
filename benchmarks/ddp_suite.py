"""Multi-process jobs: hand-written DDP vs Lightning ``ddp`` vs ``mgpu_ddp``, on ``world_size`` processes and on 1.

A job is one process per rank (``python -m benchmarks.ddp_worker``), by default running every variant of its world
size in turn, ``rounds`` times (variants a second apart see the same machine; ``isolated``: a job per variant).
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from benchmarks.ddp_worker import PROFILE_SUFFIX
from benchmarks.models import Mode, typical_step

ROOT = Path(os.path.abspath(__file__)).parents[1]
JOB_TIMEOUT_S = 900
VARIANTS = ("torch", "ddp", "mgpu_ddp")


class Job(NamedTuple):
    """One group of processes: the variants it runs in turn, its number of processes, and how many rounds."""

    variants: tuple[str, ...]
    world_size: int
    rounds: int = 1


def variant_key(variant: str, world_size: int) -> str:
    """A variant at a world size in ``results.json``, e.g. ``mgpu_ddp@2``."""
    return f"{variant}@{world_size}"


def jobs(mode: Mode, world_size: int, isolated: bool) -> list[tuple[str, Job]]:
    """Every job of the run, labelled: the repeats (``world_size`` processes and 1), then ``mgpu_ddp`` profiled."""
    sizes = (world_size, 1) if world_size > 1 else (world_size,)
    if isolated:
        repeat = [Job((variant,), size) for size in sizes for variant in VARIANTS]
    else:
        repeat = [Job(VARIANTS, size, mode.ddp_rounds) for size in sizes]
    profile = Job(("mgpu_ddp" + PROFILE_SUFFIX,), 1)
    if mode.name == "smoke":  # one process start fewer
        repeat[-1] = Job((*repeat[-1].variants, *profile.variants), repeat[-1].world_size)
        return [("smoke", job) for job in repeat]
    return [(f"repeat {r + 1}/{mode.ddp_repeats}", job) for r in range(mode.ddp_repeats) for job in repeat] + [
        ("once", profile)
    ]


def run_suite(mode: Mode, device: str, world_size: int, say: Callable[[str], None], isolated: bool) -> dict[str, Any]:
    """Run every job; per model and variant, aligned lists (entry ``i``: the same repeat and round)."""
    models = [spec.name for spec in mode.models]
    results: dict[str, Any] = {
        key: {model: {} for model in models} for key in ("samples_per_s", "step_s", "cpu_step_s")
    }
    profiles: dict[str, Any] = {}
    for label, job in jobs(mode, world_size, isolated):
        started = time.perf_counter()
        for result in run_job(job, models, mode, device):
            if result["profile"] is not None:
                profiles[result["model"]] = result["profile"]
                continue
            for key in ("samples_per_s", "step_s", "cpu_step_s"):
                results[key][result["model"]].setdefault(result["variant"], []).append(result[key])
        seconds = time.perf_counter() - started
        say(f"  multi-process {label}: {'+'.join(job.variants)} x{job.world_size} proc. ({seconds:.1f} s)")
    layout = "isolated" if isolated else f"shared, {mode.ddp_rounds} round(s) per job"
    return {**results, "world_size": world_size, "profiles": profiles, "layout": layout}


def run_job(job: Job, models: list[str], mode: Mode, device: str) -> list[dict[str, Any]]:
    """Start the job's processes, wait for them, and combine the ranks' timings (the slowest rank counts)."""
    with tempfile.TemporaryDirectory(prefix="mgpu-bench-") as tmp:
        out = Path(tmp)
        port = free_port()
        command = [sys.executable, "-m", "benchmarks.ddp_worker", "--variants", ",".join(job.variants), "--models",
                   ",".join(models), "--mode", mode.name, "--device", device, "--out", tmp,
                   "--rounds", str(job.rounds)]  # fmt: skip
        logs = [out / f"rank{rank}.log" for rank in range(job.world_size)]
        processes = []
        for rank, log in enumerate(logs):
            with log.open("w") as sink:
                env = rank_env(rank, job.world_size, port)
                processes.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT))
        _wait(processes, logs, job)
        reports = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(job.world_size)]
    combined = []
    for per_rank in zip(*reports, strict=True):
        first = per_rank[0]
        # Ranks meet in every step's all-reduce, so a step lasts as long as its slowest rank.
        wall, cpu = ([max(ranks) for ranks in zip(*(r[key] for r in per_rank), strict=True)]
                     for key in ("durations", "cpu_durations"))  # fmt: skip
        step = typical_step(wall, device == "cuda")
        combined.append({
            "variant": variant_key(first["variant"], job.world_size), "model": first["model"],
            "samples_per_s": sum(r["batch"] for r in per_rank) / step, "step_s": step,
            "cpu_step_s": statistics.median(cpu), "profile": first["profile"],
        })  # fmt: skip
    return combined


def _wait(processes: list[subprocess.Popen[bytes]], logs: list[Path], job: Job) -> None:
    """Wait for every rank; as soon as one fails or time runs out, stop the others and raise with its output."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    try:
        while time.monotonic() < deadline and all(process.poll() in (None, 0) for process in processes):
            if all(process.returncode == 0 for process in processes):
                return
            time.sleep(0.05)
        rank = next((r for r, process in enumerate(processes) if process.returncode not in (None, 0)), 0)
        code = processes[rank].returncode
        state = f"exited with {code}" if code else f"ran past {JOB_TIMEOUT_S} s"
        raise RuntimeError(f"benchmark job {job}: rank {rank} {state}.\n{logs[rank].read_text()[-4000:]}")
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()


def rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The parent's environment minus launcher variables, plus this job's ranks and one intra-op thread."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("SLURM_", "TORCHELASTIC_", "PL_"))}
    for key in ("GROUP_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK"):
        env.pop(key, None)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
               WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))  # fmt: skip
    return env


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
