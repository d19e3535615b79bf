"""What exact BatchNorm costs under ``mgpu_dp``: ``sync_batchnorm=True`` against ``False``, per layer, in one run.

``python -m benchmarks.batchnorm [--quick|--smoke]`` runs, on 2 virtual CPU replicas with one intra-op thread, a
forward and a backward of small convolution networks (3x3 convolutions with 8 channels on 8x8 inputs, batch 8):
8 or 16 convolutions with one BatchNorm layer or one after each, and a ResNet-style stack of residual blocks (two
convolutions and two BatchNorm layers each), the same with timm's ``BatchNormAct2d`` (normalisation and activation
in one layer) where timm is installed. Per model the variants take turns in every repeat, the order alternating:

- ``single``: the plain module on the whole batch;
- ``in_turn``: the same two chunks run one after the other on the plain module (each normalised on its own);
- ``sync_off``: ``MGPUDataParallel(sync_batchnorm=False)``, each chunk normalised by its own statistics;
- ``sync_on``: ``MGPUDataParallel(sync_batchnorm=True)``, every chunk by the whole batch's;
- ``forward_off``, ``forward_on``: the last two's forward alone (without autograd), to tell forward from backward.

Beside them, ``handoff`` times the replica threads doing nothing but meeting, through the same rendezvous as the
exchange, as many times as the exchange meets per layer (once): the floor a hand-off between these threads sets.
And ``work_alone`` times, in the calling thread and without replicas, what the exchange computes for one layer (both
chunks of this benchmark's BatchNorm layers normalised by the whole batch, forward and backward) against each chunk
normalised by its own statistics: the exchange's own work, apart from threads and meetings. A row reports medians
over repeats of the step times, the ratio ``sync_on / sync_off`` with its min and max, the exchange's cost per
BatchNorm layer per step (the difference over the layers), its forward's share, and that cost above the hand-offs.

``profile`` runs ``torch.profiler`` over steps of ``sync_on`` on the 16-layer model, the replica threads included,
with labels on the exchange's parts (put on for the profiled steps only): where a step goes between the function
mode's dispatch of every torch call, the meetings (waiting included), the whole batch's statistics and
normalisation, and the backward. ``--trace FILE`` also writes it as a Chrome trace.
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - torch's own spelling
from torch import nn

from lightning_mgpu.engine import MGPUDataParallel
from lightning_mgpu.engine.parallel_apply import ParallelApply
from lightning_mgpu.replica_state import batchnorm as exchange
from lightning_mgpu.replica_state.batchnorm import ReplicaRendezvous

REPLICAS = 2
ROWS, CHANNELS, SIZE = 8, 8, 8
EXCHANGES_PER_LAYER = 1
"""How often the replicas meet per BatchNorm call (the last to arrive does the work of every chunk)."""
_SETTINGS = {"smoke": (1, 1, 1), "quick": (10, 7, 3), "full": (30, 15, 5)}
"""Per mode: steps per timed loop, repeats, warm-up steps."""
_MEETINGS = 32
"""Meetings per timed hand-off call."""
VARIANTS = ("single", "in_turn", "sync_off", "sync_on", "forward_off", "forward_on")


class _Block(nn.Module):
    """A residual block: two convolutions, each followed by BatchNorm, added to its input.

    With ``timm``, the first BatchNorm and its ReLU are timm's ``BatchNormAct2d``, one layer, as timm's ResNets have
    it.
    """

    def __init__(self, timm: bool = False) -> None:
        super().__init__()
        if timm:
            from timm.layers import BatchNormAct2d

            first: list[nn.Module] = [BatchNormAct2d(CHANNELS, act_layer=nn.ReLU)]
        else:
            first = [nn.BatchNorm2d(CHANNELS), nn.ReLU()]
        self.body = nn.Sequential(
            nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1, bias=False),
            *first,
            nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1, bias=False),
            nn.BatchNorm2d(CHANNELS),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.body(x))


def _convolutions(depth: int, every: int) -> nn.Module:
    """``depth`` convolutions with ReLU, a BatchNorm layer after every ``every``-th."""
    layers: list[nn.Module] = []
    for index in range(depth):
        layers.append(nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1))
        if (index + 1) % every == 0:
            layers.append(nn.BatchNorm2d(CHANNELS))
        layers.append(nn.ReLU())
    return nn.Sequential(*layers)


MODELS: dict[str, Callable[[], nn.Module]] = {
    "conv8_bn1": lambda: _convolutions(8, 8),
    "conv8_bn8": lambda: _convolutions(8, 1),
    "conv16_bn1": lambda: _convolutions(16, 16),
    "conv16_bn16": lambda: _convolutions(16, 1),
    "resnet4": lambda: nn.Sequential(*[_Block() for _ in range(4)]),
}
if importlib.util.find_spec("timm") is not None:
    MODELS["timm_resnet4"] = lambda: nn.Sequential(*[_Block(timm=True) for _ in range(4)])
PROFILED = "conv16_bn16"
PROFILE_LABELS = (
    ("lightning_mgpu.replica_state.batchnorm", "WholeBatchNorm.__torch_function__", "mgpu::function_mode"),
    ("lightning_mgpu.replica_state.batchnorm", "WholeBatchNorm._normalise", "mgpu::bn_call"),
    ("lightning_mgpu.replica_state.batchnorm", "ReplicaRendezvous.combine", "mgpu::bn_meeting"),
    ("lightning_mgpu.replica_state.batchnorm", "_normalise_every_chunk", "mgpu::bn_whole_batch"),
    ("lightning_mgpu.replica_state.batchnorm", "_whole_batch_statistics", "mgpu::bn_statistics"),
    ("lightning_mgpu.replica_state.batchnorm", "_fused_backward", "mgpu::bn_backward"),
    ("lightning_mgpu.engine.parallel_apply", "_Job.run", "mgpu::replica_thread"),
)
"""(module, attribute path, label): the exchange's parts, in the order a step reaches them."""


def _layers(model: nn.Module) -> int:
    return sum(isinstance(module, nn.BatchNorm2d) for module in model.modules())


class _Case:
    """One model's four variants, each a forward and a backward of the same batch."""

    def __init__(self, name: str) -> None:
        torch.manual_seed(0)
        self.name = name
        self.model = MODELS[name]()
        self.layers = _layers(self.model)
        self.x = torch.randn(ROWS, CHANNELS, SIZE, SIZE, generator=torch.Generator().manual_seed(1))
        devices = [torch.device("cpu")] * REPLICAS
        self.wrappers = {sync: MGPUDataParallel(self.model, devices, sync_batchnorm=sync) for sync in (False, True)}

    def single(self) -> None:
        self.model(self.x).sum().backward()

    def in_turn(self) -> None:
        torch.cat([self.model(chunk) for chunk in self.x.chunk(REPLICAS)]).sum().backward()

    def sync_off(self) -> None:
        self.wrappers[False](self.x).sum().backward()

    def sync_on(self) -> None:
        self.wrappers[True](self.x).sum().backward()

    @torch.no_grad()
    def forward_off(self) -> None:
        self.wrappers[False](self.x)

    @torch.no_grad()
    def forward_on(self) -> None:
        self.wrappers[True](self.x)

    def close(self) -> None:
        for wrapper in self.wrappers.values():
            wrapper.close()


class _LayerWork:
    """One BatchNorm layer's work on this benchmark's two chunks, forward and backward, in the calling thread."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(2)
        self.chunks = [
            torch.randn(ROWS // REPLICAS, CHANNELS, SIZE, SIZE, generator=generator).requires_grad_()
            for _ in range(REPLICAS)
        ]
        self.layer = nn.BatchNorm2d(CHANNELS)

    def own(self) -> None:
        """Each chunk normalised by its own statistics, as ``sync_off`` does."""
        torch.autograd.backward([self.layer(chunk).sum() for chunk in self.chunks])

    def whole(self) -> None:
        """Every chunk normalised by the whole batch's statistics: the work of the exchange's last arriver."""
        layer = self.layer
        chunks = []
        for chunk in self.chunks:
            arguments = (chunk, layer.running_mean, layer.running_var, layer.weight, layer.bias, True, 0.1, layer.eps)
            call = exchange._BatchNormCall.parse(F.batch_norm, arguments, {})
            assert call is not None, "a batch-norm call in training mode"
            chunks.append(exchange._Chunk(call, chunk, None))
        torch.autograd.backward([output.sum() for output in exchange._normalise_every_chunk(chunks)])


class _Handoffs:
    """The replica threads meeting ``meetings`` times in one call and nothing else: the floor of the exchange."""

    def __init__(self) -> None:
        self.threads = ParallelApply(REPLICAS)
        self.devices = [torch.device("cpu")] * REPLICAS

    def __call__(self, meetings: int) -> None:
        rendezvous = ReplicaRendezvous(REPLICAS)

        def meet(index: int) -> Callable[[], None]:
            def call() -> None:
                for key in range(meetings):
                    rendezvous.combine(index, key, None, "a hand-off", list)

            return call

        self.threads([meet(index) for index in range(REPLICAS)], self.devices)

    def close(self) -> None:
        self.threads.close()


def _seconds(function: Callable[[], None], loops: int) -> float:
    started = time.perf_counter()
    for _ in range(loops):
        function()
    return (time.perf_counter() - started) / loops


def measure(mode: str) -> dict[str, Any]:
    """Per model, every variant's seconds per step in every repeat; and the hand-off's seconds per meeting."""
    loops, repeats, warmup = _SETTINGS[mode]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cases = [_Case(name) for name in MODELS]
    handoffs = _Handoffs()
    work = _LayerWork()
    times: dict[str, dict[str, list[float]]] = {case.name: {variant: [] for variant in VARIANTS} for case in cases}
    meeting: list[float] = []
    alone: dict[str, list[float]] = {"own": [], "whole": []}
    gc_was_enabled = gc.isenabled()
    try:
        for case in cases:
            for _ in range(warmup):
                for variant in VARIANTS:
                    getattr(case, variant)()
        gc.collect()
        gc.disable()
        for repeat in range(repeats):
            for case in cases:
                order = VARIANTS if repeat % 2 == 0 else tuple(reversed(VARIANTS))
                for variant in order:
                    times[case.name][variant].append(_seconds(getattr(case, variant), loops))
            met = _seconds(functools.partial(handoffs, _MEETINGS), loops)
            meeting.append((met - _seconds(functools.partial(handoffs, 0), loops)) / _MEETINGS)
            for name in ("own", "whole") if repeat % 2 == 0 else ("whole", "own"):
                alone[name].append(_seconds(getattr(work, name), _MEETINGS * loops))
    finally:
        if gc_was_enabled:
            gc.enable()
        for case in cases:
            case.close()
        handoffs.close()
        torch.set_num_threads(threads)
    layers = {case.name: case.layers for case in cases}
    return {"models": times, "layers": layers, "handoff_s": meeting, "work_alone_s": alone}


def above_handoffs_s(result: dict[str, Any], model: str) -> list[float]:
    """Per repeat, ``model``'s cost per BatchNorm layer per step (sync on - off) above that repeat's hand-offs."""
    times, layers = result["models"][model], result["layers"][model]
    return [
        (on - off) / layers - EXCHANGES_PER_LAYER * handoff
        for on, off, handoff in zip(times["sync_on"], times["sync_off"], result["handoff_s"], strict=True)
    ]


def summary(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per model: medians, the on/off ratio with its range, and the cost per layer above the hand-offs."""
    handoff = statistics.median(result["handoff_s"])
    alone = result["work_alone_s"]
    work_alone = statistics.median(whole - own for whole, own in zip(alone["whole"], alone["own"], strict=True))
    rows = []
    for name, times in result["models"].items():
        ratios = [on / off for on, off in zip(times["sync_on"], times["sync_off"], strict=True)]
        layers = result["layers"][name]
        per_layer = statistics.median(
            (on - off) / layers for on, off in zip(times["sync_on"], times["sync_off"], strict=True)
        )
        forward = statistics.median(
            (on - off) / layers for on, off in zip(times["forward_on"], times["forward_off"], strict=True)
        )
        rows.append(
            {
                "model": name,
                "layers": result["layers"][name],
                **{f"{variant}_ms": statistics.median(times[variant]) * 1e3 for variant in VARIANTS},
                "ratio": statistics.median(ratios),
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
                "per_layer_us": per_layer * 1e6,
                "forward_per_layer_us": forward * 1e6,
                "above_handoffs_us": statistics.median(above_handoffs_s(result, name)) * 1e6,
                "handoff_us": handoff * 1e6,
                "work_alone_us": work_alone * 1e6,
            }
        )
    return rows


def profile(mode: str, trace: Path | None = None) -> dict[str, Any]:
    """``torch.profiler`` over steps of ``sync_on`` on ``PROFILED``: per label its time and calls, the most self time.

    ``waiting_us_per_step`` is the meetings' time less the whole-batch work done inside them: the replicas' waits
    for each other (and for the GIL). With ``trace``, the profile is also written there as a Chrome trace.
    """
    from benchmarks.profiling import every_thread_profiler, label_and_self_rows, labelled

    loops, _, warmup = _SETTINGS[mode]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    case = _Case(PROFILED)
    profiler, config = every_thread_profiler()
    try:
        for _ in range(warmup):
            case.sync_on()
        with labelled(PROFILE_LABELS):
            started = time.perf_counter()
            with profiler:
                for _ in range(loops):
                    case.sync_on()
            wall = time.perf_counter() - started
    finally:
        case.close()
        torch.set_num_threads(threads)
    if trace is not None:
        trace.parent.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(trace))
    rows = label_and_self_rows(profiler, PROFILE_LABELS, wall, loops)
    by_label = {entry["name"]: entry for entry in rows["labels"]}
    return {
        "model": PROFILED,
        "layers": case.layers,
        "profiled_step_ms": wall / loops * 1e3,
        "steps": loops,
        "replica_threads_profiled": config is not None,
        "waiting_us_per_step": by_label["mgpu::bn_meeting"]["us_per_step"]
        - by_label["mgpu::bn_whole_batch"]["us_per_step"],
        **rows,
    }


def main(argv: list[str] | None = None) -> int:
    """Measure and print one line per model."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.batchnorm", description=__doc__.split("\n\n")[0])
    speed = parser.add_mutually_exclusive_group()
    speed.add_argument("--quick", action="store_true")
    speed.add_argument("--smoke", action="store_true")
    parser.add_argument("--trace", type=Path, help=f"also profile {PROFILED}'s sync_on steps, as a Chrome trace here")
    args = parser.parse_args(argv)
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    rows = summary(measure(mode))
    print(
        f"2 CPU replicas, 1 intra-op thread; a hand-off between the replica threads: {rows[0]['handoff_us']:.0f} us;"
        f" one layer's exchange work alone (calling thread, both chunks, forward and backward) over each chunk's own"
        f" batch norm: {rows[0]['work_alone_us']:+.0f} us"
    )
    for row in rows:
        print(
            f"{row['model']:12s} {row['layers']:2d} BatchNorm: one device {row['single_ms']:.2f} ms, in turn"
            f" {row['in_turn_ms']:.2f} ms, sync off {row['sync_off_ms']:.2f} ms, sync on {row['sync_on_ms']:.2f} ms;"
            f" ratio {row['ratio']:.2f} [{row['ratio_min']:.2f}, {row['ratio_max']:.2f}]; per layer"
            f" {row['per_layer_us']:+.0f} us (forward {row['forward_per_layer_us']:+.0f} us),"
            f" {row['above_handoffs_us']:+.0f} us above the hand-off"
        )
    if args.trace is not None:
        profiled = profile(mode, args.trace)
        print(f"profile of {PROFILED}, sync on ({profiled['profiled_step_ms']:.2f} ms per step under the profiler):")
        for entry in profiled["labels"]:
            print(f"  {entry['name']:22s} {entry['calls_per_step']:6.1f} calls {entry['us_per_step']:8.0f} us per step")
        print(f"  waiting in the meetings: {profiled['waiting_us_per_step']:.0f} us per step; trace: {args.trace}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
