"""Micro-benchmarks of the per-step pieces that the profile points at, each against the alternative it suggests.

- ``replicate``: the engine's ``replicate`` (new shells every call, as ``torch.nn.DataParallel`` does) and its
  ``ReplicaCache`` (shells kept, refreshed every call: what ``DataParallel`` uses per step) against a
  prototype that builds the shells once and per step only refreshes the parameter aliases (and, in a safer variant,
  re-syncs each shell's attributes from its original), checked to give the same gradients; on CUDA also
  ``torch.nn.parallel.replicate``.
- ``dispatch``: one round trip of the engine's ``ParallelApply`` with no-op calls against calling them inline, and
  against running the first replica on the calling thread.
- ``per_step``: what the package adds to every step outside the replicas: ``MGPUMixin``'s wrapper, the
  ``*_step_end`` lookup, the finiteness check of the loss, the weighted mean of the replicas' losses, the device
  context that replica threads enter on CUDA (a ``TorchFunctionMode`` that every torch call inside the replica then
  goes through).

Each number is the median over repeats of the mean time of a loop; the prototypes live here, not in the package.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import lightning as L
import torch
from torch import nn
from typing_extensions import override

from benchmarks.models import ModelSpec
from benchmarks.modules import BenchModule
from lightning_mgpu import MGPUMixin
from lightning_mgpu.engine import ParallelApply, replicate, weighted_mean
from lightning_mgpu.engine.replicate import ReplicaCache
from lightning_mgpu.hooks import call_step_end


def _time_us(function: Callable[[], Any], loops: int, repeats: int) -> dict[str, float]:
    function()
    means = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(loops):
            function()
        means.append((time.perf_counter() - started) / loops * 1e6)
    return {"median_us": statistics.median(means), "min_us": min(means), "max_us": max(means)}


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


class CachedReplicas:
    """Prototype: the replica shells are built once; each step refreshes only what can change.

    ``refresh(resync=False)`` re-points every parameter alias at its original (a fresh ``view_as``, so autograd
    records this step's use) and re-copies the private buffers of replicas after the first. ``resync=True`` also
    replaces each shell's attribute dict by a copy of its original's (keeping the shell's own children, aliases and
    buffers), so attributes set on the module between steps (``training``, user state) reach the replicas too.
    """

    def __init__(self, module: nn.Module, devices: list[torch.device]) -> None:
        self.originals = list(module.modules())
        self.replicas = replicate(module, devices)
        self.devices = devices
        self.shells = [list(replica.modules()) for replica in self.replicas]
        if any(len(shells) != len(self.originals) for shells in self.shells):
            raise RuntimeError("CachedReplicas needs a module tree without shared submodules")
        self.params = [
            [(shell, name, param) for original, shell in zip(self.originals, shells, strict=True)
             for name, param in original._parameters.items() if param is not None]
            for shells in self.shells
        ]  # fmt: skip
        self.fixed = [
            [{"_parameters": {}, "_buffers": shell._buffers, "_modules": shell._modules, "_is_replica": True}
             for shell in shells]
            for shells in self.shells
        ]  # fmt: skip

    def refresh(self, resync: bool = False) -> list[nn.Module]:
        """Make the cached replicas ready for one more step and return them."""
        for index, (shells, fixed, params, device) in enumerate(
            zip(self.shells, self.fixed, self.params, self.devices, strict=True)
        ):
            if resync:
                for original, shell, own in zip(self.originals, shells, fixed, strict=True):
                    state = original.__dict__.copy()
                    state.update(own)
                    shell.__dict__ = state
            for shell, name, param in params:
                shell.__dict__[name] = param.view_as(param) if param.device == device else param.to(device)
            if index:
                for original, shell in zip(self.originals, shells, strict=True):
                    for name, buffer in original._buffers.items():
                        private = shell._buffers[name]
                        if buffer is not None and private is not None:
                            private.copy_(buffer)
        return self.replicas


class _Deep(L.LightningModule):
    """Many small modules (50 blocks of Linear, LayerNorm, ReLU: 152 modules, 150 parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32), nn.ReLU()) for _ in range(50)])

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _same_gradients(module: nn.Module, devices: list[torch.device], x: torch.Tensor) -> bool:
    """Whether a backward through the prototype's replicas gives the gradients of one through the engine's."""
    chunks = [chunk.to(device) for chunk, device in zip(x.chunk(len(devices)), devices, strict=True)]

    def grads(replicas: list[nn.Module]) -> list[torch.Tensor]:
        module.zero_grad(set_to_none=True)
        losses = [replica(chunk).square().sum().to(devices[0]) for replica, chunk in zip(replicas, chunks, strict=True)]
        torch.stack(losses).sum().backward()
        return [param.grad.clone() for param in module.parameters()]  # type: ignore[union-attr]

    cached = CachedReplicas(module, devices)
    cached.refresh()  # a second step on the cached shells, as in training
    expected = grads(replicate(module, devices))
    got = grads(cached.refresh())
    module.zero_grad(set_to_none=True)
    return all(torch.allclose(a, b) for a, b in zip(expected, got, strict=True))


def replicate_costs(specs: list[ModelSpec], devices: list[torch.device], repeats: int) -> list[dict[str, Any]]:
    """Per-call cost of building replicas anew against refreshing cached ones, per model."""
    models: list[tuple[str, nn.Module, torch.Tensor]] = []
    for spec in specs:
        bench = BenchModule(spec).to(devices[0])
        shape = (len(devices) * 2, spec.features) if spec.name == "mlp" else (len(devices) * 2, 3, 8, 8)
        models.append((spec.name, bench.net, torch.randn(*shape, device=devices[0])))
    deep = _Deep().to(devices[0])
    models.append(("deep (152 modules)", deep, torch.randn(len(devices) * 2, 32, device=devices[0])))
    rows = []
    for name, module, x in models:
        cached = CachedReplicas(module, devices)
        functions: dict[str, Callable[[], Any]] = {
            "engine_replicate": functools.partial(replicate, module, devices),
            "engine_cache": functools.partial(ReplicaCache(), module, devices),
            "cached_refresh": cached.refresh,
            "cached_resync": functools.partial(cached.refresh, resync=True),
        }
        if devices[0].type == "cuda" and len({device.index for device in devices}) == len(devices):
            functions["torch_replicate"] = functools.partial(torch.nn.parallel.replicate, module, devices)
        timings = _paired(functions, loops=50, repeats=repeats)
        rows.append(
            {
                "model": name,
                "modules": len(list(module.modules())),
                "parameters": len(list(module.parameters())),
                "timings": timings,
                "prototype_same_gradients": _same_gradients(module, devices, x),
            }
        )
    return rows


def dispatch_costs(devices: list[torch.device], repeats: int) -> dict[str, Any]:
    """One round trip through the replica threads, against inline calls and against caller-runs-replica-0."""
    apply = ParallelApply(len(devices))
    helper = ThreadPoolExecutor(max(1, len(devices) - 1))
    calls = [lambda: None for _ in devices]

    def inline() -> None:
        for call in calls:
            call()

    def caller_runs_first() -> None:
        futures = [helper.submit(call) for call in calls[1:]]
        calls[0]()
        for future in futures:
            future.result()

    try:
        timings = _paired(
            {
                "engine_parallel_apply": lambda: apply(calls, devices),
                "caller_runs_first_prototype": caller_runs_first,
                "inline": inline,
            },
            loops=200,
            repeats=repeats,
        )
    finally:
        apply.close()
        helper.shutdown()
    return {"replicas": len(devices), "timings": timings}


class _Plain(L.LightningModule):
    @override
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return batch


class _WithMixin(MGPUMixin, _Plain):
    pass


def per_step_costs(spec: ModelSpec, device: torch.device, repeats: int) -> dict[str, dict[str, float]]:
    """Microseconds per step of the package's per-step work outside the replicas, and of what it replaces."""
    plain, mixed = _Plain(), _WithMixin()
    loss = torch.tensor(1.5, device=device)
    values = torch.tensor([1.0, 2.0], device=device)
    net = BenchModule(spec).net.to(device)
    shape = (spec.batch, spec.features) if spec.name == "mlp" else (spec.batch, 3, spec.features, spec.features)
    x = torch.randn(*shape, device=device)

    def forward() -> None:
        with torch.no_grad():
            net(x)

    def forward_in_device_context() -> None:
        with torch.no_grad(), torch.device(device):
            net(x)

    def grad_contexts() -> None:
        with torch.inference_mode(False), torch.set_grad_enabled(True):
            pass

    costs = _paired(
        {
            "training_step_plain": lambda: plain.training_step(loss, 0),
            "training_step_with_mixin": lambda: mixed.training_step(loss, 0),
            "call_step_end_without_hook": lambda: call_step_end(plain, "training_step", loss),
            "loss_isfinite_check": lambda: bool(torch.isfinite(loss).all()),
            "weighted_mean_of_2": lambda: weighted_mean(values, [3.0, 3.0]),
            "plain_mean_of_2": lambda: values.mean(),
            "get_default_device": torch.get_default_device,
            "grad_mode_contexts": grad_contexts,
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
