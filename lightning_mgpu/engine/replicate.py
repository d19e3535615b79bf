"""Make one replica of a module per device whose parameters stay differentiable views of the originals.

The backward pass of every replica therefore accumulates into the original parameters, so the optimizer sees the
gradient of the whole batch. Replicas own no parameters (as in ``torch.nn.DataParallel``): a replica built on the
CPU behaves exactly like one built on a GPU.

``torch.nn.DataParallel`` builds every replica module anew on every step. ``ReplicaCache`` keeps the replica objects
between steps and only re-points them at the module's current attributes, parameters and buffers, which costs a
fraction of rebuilding them (see benchmarks/README.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class ReplicaCache:
    """Replica shells kept between calls, refreshed from the module on every call.

    Modules that customise ``__setattr__`` or their own replication (RNNs, torchmetrics) get a fresh shell each call,
    built the way torch builds it; every other module reuses its shell.
    """

    def __init__(self) -> None:
        self._key: tuple[tuple[int, ...], tuple[torch.device, ...]] | None = None
        self._shells: list[list[nn.Module]] = []

    def __getstate__(self) -> dict[str, object]:
        """The shells hold views with autograd history, which cannot be copied; a copy starts with no shells."""
        return {}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__()  # type: ignore[misc]

    def __call__(self, module: nn.Module, devices: Sequence[torch.device]) -> list[nn.Module]:
        """One replica of ``module`` per entry of ``devices``, in order.

        Parameters reach a replica on the parameter's own device as an alias (``view_as``), and a replica on another
        device as a differentiable copy. Buffers of the first replica are the original buffers, so in-place updates
        (BatchNorm running statistics) made there persist, as in ``torch.nn.DataParallel``; the other replicas get
        private copies, so concurrent replicas never write to the same buffer.
        """
        originals = list(module.modules())
        key = (tuple(id(original) for original in originals), tuple(devices))
        if key != self._key:
            self._key = key
            self._shells = [[_shell(original) for original in originals] for _ in devices]
        reusable = [_reusable(original) for original in originals]
        position = {id(original): index for index, original in enumerate(originals)}
        replicas = []
        for index, (kept, device) in enumerate(zip(self._shells, devices, strict=True)):
            shells = [
                shell if reuse else _shell(original)
                for original, shell, reuse in zip(originals, kept, reusable, strict=True)
            ]
            for original, shell, reuse in zip(originals, shells, reusable, strict=True):
                if reuse:
                    _refresh(original, shell)
                _wire(original, shell, shells, position, device, first=index == 0, direct=reuse)
            replicas.append(shells[0])
        return replicas


def replicate(module: nn.Module, devices: Sequence[torch.device]) -> list[nn.Module]:
    """Fresh replicas of ``module``, one per device (see ``ReplicaCache`` for what a replica holds)."""
    return ReplicaCache()(module, devices)


def _reusable(original: nn.Module) -> bool:
    cls = type(original)
    return (
        cls.__setattr__ is nn.Module.__setattr__
        and cls._replicate_for_data_parallel is nn.Module._replicate_for_data_parallel
    )


def _shell(original: nn.Module) -> nn.Module:
    # ``_replicate_for_data_parallel`` is nn.Module's own hook for DataParallel replicas: a shallow copy with fresh
    # ``_parameters``/``_buffers``/``_modules`` dicts, overridden by modules that need it (RNNs reset their flat
    # weight caches there). It is private, so this is the only call to it; tests/test_replicate.py covers it.
    return original._replicate_for_data_parallel()


def _refresh(original: nn.Module, shell: nn.Module) -> None:
    """What ``nn.Module._replicate_for_data_parallel`` does, into an existing shell (only for reusable modules)."""
    state = shell.__dict__
    state.clear()
    state.update(original.__dict__)
    state["_parameters"] = {}
    state["_buffers"] = dict(original._buffers)
    state["_modules"] = dict(original._modules)
    state["_is_replica"] = True


def _wire(
    original: nn.Module,
    shell: nn.Module,
    shells: list[nn.Module],
    position: dict[int, int],
    device: torch.device,
    first: bool,
    direct: bool,
) -> None:
    for name, child in original._modules.items():
        shell._modules[name] = None if child is None else shells[position[id(child)]]
    for name, param in original._parameters.items():
        alias = None if param is None else _parameter_alias(param, device)
        # Replicas are views, not leaves: plain attributes, as torch's replicate sets them. For modules with
        # nn.Module's own __setattr__ that is a plain instance attribute, written directly to skip its checks.
        if direct:
            shell.__dict__[name] = alias
        else:
            setattr(shell, name, alias)
    for name, buffer in original._buffers.items():
        shell._buffers[name] = None if buffer is None else _buffer_copy(buffer, device, first)


def _parameter_alias(param: torch.Tensor, device: torch.device) -> torch.Tensor:
    if param.device == device:
        return param.view_as(param)
    return param.to(device, non_blocking=True)


def _buffer_copy(buffer: torch.Tensor, device: torch.device, first: bool) -> torch.Tensor:
    if buffer.device == device:
        return buffer if first else buffer.clone()
    return buffer.to(device, non_blocking=True, copy=True)
