"""Multi-process benchmarks: hand-written DDP vs Lightning ``ddp`` vs ``mgpu_ddp``, and ``mgpu_ddp``'s scaling.

A job is a group of fresh processes (``python -m benchmarks.ddp_worker``), one per rank, with
``OMP_NUM_THREADS=1``, a free port and the ranks in the environment, so Lightning treats the processes as externally
launched and the hand-written loop reads them with ``init_method="env://"``.

By default a job runs every variant of one world size in turn, ``rounds`` times (torch, ddp, mgpu_ddp, torch, ddp,
mgpu_ddp, ...), each variant a fresh model and Trainer with its own warm-up: on a shared machine a neighbour's burst
of load lasts seconds, so variants a second apart see the same machine, where separate jobs (tens of seconds apart)
often do not. ``isolated=True`` runs each variant as its own job instead (A B C A B C ...). Either way repeats
alternate the jobs, and every ratio is taken between measurements of the same repeat and round.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.ddp_worker import PROFILE_SUFFIX
from benchmarks.models import Mode, typical_step

ROOT = Path(os.path.abspath(__file__)).parents[1]
JOB_TIMEOUT_S = 900


@dataclass(frozen=True)
class Job:
    """One group of processes: the variants it runs in turn, how many rounds, and its number of processes."""

    variants: tuple[str, ...]
    world_size: int
    rounds: int = 1

    @property
    def label(self) -> str:
        """For progress messages."""
        return f"{'+'.join(self.variants)} x{self.world_size} proc., {self.rounds} round(s)"


def variant_key(variant: str, world_size: int) -> str:
    """The name of a variant at a world size in ``results.json``, e.g. ``mgpu_ddp@2``."""
    return f"{variant}@{world_size}"


def jobs(mode: Mode, world_size: int, isolated: bool) -> tuple[list[Job], list[Job]]:
    """The jobs of one repeat, and the jobs run once after the repeats (the cProfile run of ``mgpu_ddp``).

    A repeat runs ``torch``, ``ddp`` and ``mgpu_ddp`` at ``world_size``, and again on one process, for the scaling
    rows and for a comparison that no other process's timing disturbs.
    """
    full = ("torch", "ddp", "mgpu_ddp")
    single = full if world_size > 1 else ()
    profile = Job(("mgpu_ddp" + PROFILE_SUFFIX,), 1)
    if isolated:
        repeat = [Job((variant,), world_size) for variant in full] + [Job((variant,), 1) for variant in single]
        return repeat, [profile]
    repeat = [Job(full, world_size, mode.ddp_rounds)] + ([Job(single, 1, mode.ddp_rounds)] if single else [])
    if mode.name == "smoke":  # one process start fewer
        return [*repeat[:-1], Job((*repeat[-1].variants, *profile.variants), repeat[-1].world_size)], []
    return repeat, [profile]


def run_suite(
    mode: Mode, device: str, world_size: int, say: Callable[[str], None], isolated: bool = False
) -> dict[str, Any]:
    """Run every job ``mode.ddp_repeats`` times, alternating; returns samples/s per model, variant and measurement.

    The lists of measurements line up: entry ``i`` of every variant comes from the same repeat and round.
    """
    models = [spec.name for spec in mode.models]
    samples_per_s: dict[str, dict[str, list[float]]] = {model: {} for model in models}
    step_s: dict[str, dict[str, list[float]]] = {model: {} for model in models}
    cpu_step_s: dict[str, dict[str, list[float]]] = {model: {} for model in models}
    profiles: dict[str, Any] = {}
    repeat_jobs, once_jobs = jobs(mode, world_size, isolated)
    schedule = [(f"repeat {r + 1}/{mode.ddp_repeats}", job) for r in range(mode.ddp_repeats) for job in repeat_jobs]
    schedule += [("once", job) for job in once_jobs]
    for label, job in schedule:
        started = time.perf_counter()
        for result in run_job(job, models, mode, device):
            if result["profile"] is not None:
                profiles[result["model"]] = result["profile"]
                continue
            key = variant_key(result["variant"], result["world_size"])
            samples_per_s[result["model"]].setdefault(key, []).append(result["samples_per_s"])
            step_s[result["model"]].setdefault(key, []).append(result["step_s"])
            cpu_step_s[result["model"]].setdefault(key, []).append(result["cpu_step_s"])
        say(f"  multi-process {label}: {job.label} ({time.perf_counter() - started:.1f} s)")
    layout = "isolated" if isolated else f"shared, {mode.ddp_rounds} round(s) per job"
    return {
        "samples_per_s": samples_per_s,
        "step_s": step_s,
        "cpu_step_s": cpu_step_s,
        "world_size": world_size,
        "profiles": profiles,
        "layout": layout,
    }


def run_job(job: Job, models: list[str], mode: Mode, device: str) -> list[dict[str, Any]]:
    """Start the job's processes, wait for them, and combine the ranks' timings (the slowest rank counts)."""
    with tempfile.TemporaryDirectory(prefix="mgpu-bench-") as tmp:
        out = Path(tmp)
        port = free_port()
        command = [
            sys.executable, "-m", "benchmarks.ddp_worker", "--variants", ",".join(job.variants),
            "--models", ",".join(models), "--mode", mode.name, "--device", device, "--out", str(out),
            "--rounds", str(job.rounds),
        ]  # fmt: skip
        logs = [out / f"rank{rank}.log" for rank in range(job.world_size)]
        processes = []
        for rank, log in enumerate(logs):
            with log.open("w") as sink:
                processes.append(
                    subprocess.Popen(
                        command,
                        cwd=ROOT,
                        env=rank_env(rank, job.world_size, port),
                        stdout=sink,
                        stderr=subprocess.STDOUT,
                    )
                )
        _wait(processes, logs, job)
        reports = [json.loads((out / f"rank{rank}.json").read_text())["results"] for rank in range(job.world_size)]
    combined = []
    for per_rank in zip(*reports, strict=True):
        first = per_rank[0]
        # Ranks meet in every step's all-reduce, so a step lasts as long as its slowest rank says.
        durations = [max(ranks) for ranks in zip(*(result["durations"] for result in per_rank), strict=True)]
        step = typical_step(durations, device == "cuda")
        cpu = [max(ranks) for ranks in zip(*(result["cpu_durations"] for result in per_rank), strict=True)]
        combined.append(
            {
                "variant": first["variant"],
                "model": first["model"],
                "world_size": first["world_size"],
                "samples_per_s": sum(result["batch"] for result in per_rank) / step,
                "step_s": step,
                "cpu_step_s": statistics.median(cpu),
                "profile": first.get("profile"),
            }
        )
    return combined


def _wait(processes: list[subprocess.Popen[bytes]], logs: list[Path], job: Job) -> None:
    """Wait for every rank; as soon as one fails or time runs out, stop the others and raise with its output."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    try:
        while any(process.poll() is None for process in processes):
            failed = [rank for rank, process in enumerate(processes) if process.returncode not in (None, 0)]
            if failed:
                rank = failed[0]
                raise RuntimeError(
                    f"benchmark job {job.label}: rank {rank} exited with {processes[rank].returncode}.\n"
                    f"{logs[rank].read_text()[-4000:]}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"benchmark job {job.label} ran past {JOB_TIMEOUT_S} s.\n{logs[0].read_text()[-4000:]}"
                )
            time.sleep(0.05)
        for rank, process in enumerate(processes):
            if process.returncode != 0:
                raise RuntimeError(
                    f"benchmark job {job.label}: rank {rank} exited with {process.returncode}.\n"
                    f"{logs[rank].read_text()[-4000:]}"
                )
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()


def rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The environment of one rank: the parent's, minus launcher variables, plus this job's ranks and one thread."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("SLURM_", "TORCHELASTIC_", "PL_"))}
    for key in ("GROUP_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK"):
        env.pop(key, None)
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
    )
    return env


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
