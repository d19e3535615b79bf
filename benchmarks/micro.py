"""Micro-benchmarks of two per-step costs that the step-time rows cannot isolate.

- ``MGPUMixin``'s wrapper around the step methods, against the same method without it (the ``mixin/per_step_share``
  rows divide it by a step).
- The forward of the benchmark model inside ``with torch.device(device)``, against without: replica threads enter
  that context on CUDA (a ``TorchFunctionMode``, which every torch call inside the replica then goes through), so
  this is what it costs where it applies.

Each number is the median over repeats of the mean time of a loop, the variants alternating (A B A B ...).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from typing_extensions import override

from benchmarks.models import ModelSpec
from benchmarks.modules import BenchModule
from lightning_mgpu import MGPUMixin


def _paired(functions: dict[str, Callable[[], Any]], loops: int, repeats: int) -> dict[str, dict[str, float]]:
    """Time several functions in alternation (A B A B ...), so that drift hits them alike."""
    samples: dict[str, list[float]] = {name: [] for name in functions}
    for function in functions.values():
        function()
    for _ in range(repeats):
        for name, function in functions.items():
            started = time.perf_counter()
            for _ in range(loops):
                function()
            samples[name].append((time.perf_counter() - started) / loops * 1e6)
    return {
        name: {"median_us": statistics.median(values), "min_us": min(values), "max_us": max(values)}
        for name, values in samples.items()
    }


class _Plain(L.LightningModule):
    @override
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return batch


class _WithMixin(MGPUMixin, _Plain):
    pass


def per_step_costs(spec: ModelSpec, device: torch.device, repeats: int) -> dict[str, dict[str, float]]:
    """Microseconds per call of ``MGPUMixin``'s wrapper and of the model's forward inside a device context."""
    plain, mixed = _Plain(), _WithMixin()
    loss = torch.tensor(1.5, device=device)
    net = BenchModule(spec).net.to(device)
    shape = (spec.batch, spec.features) if spec.name == "mlp" else (spec.batch, 3, spec.features, spec.features)
    x = torch.randn(*shape, device=device)

    def forward() -> None:
        with torch.no_grad():
            net(x)

    def forward_in_device_context() -> None:
        with torch.no_grad(), torch.device(device):
            net(x)

    costs = _paired(
        {
            "training_step_plain": lambda: plain.training_step(loss, 0),
            "training_step_with_mixin": lambda: mixed.training_step(loss, 0),
        },
        loops=2000,
        repeats=repeats,
    )
    costs.update(
        {
            f"{spec.name}_forward_{key}": value
            for key, value in _paired(
                {"plain": forward, "in_device_context": forward_in_device_context}, loops=20, repeats=repeats
            ).items()
        }
    )
    return costs
