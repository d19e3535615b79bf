"""Make one replica of a module per device whose parameters stay differentiable views of the originals.

The backward pass of every replica therefore accumulates into the original parameters, so the optimizer sees the
gradient of the whole batch. Replicas own no parameters (as in ``torch.nn.DataParallel``): a replica built on the
CPU behaves exactly like one built on a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def replicate(module: nn.Module, devices: Sequence[torch.device]) -> list[nn.Module]:
    """One shallow replica of ``module`` per entry of ``devices``, in order.

    Parameters reach a replica on the parameter's own device as an alias (``view_as``), and a replica on another
    device as a differentiable copy. Buffers of the first replica are the original buffers, so in-place updates
    (BatchNorm running statistics) made there persist, as in ``torch.nn.DataParallel``; the other replicas get
    private copies, so concurrent replicas never write to the same buffer.
    """
    originals = list(module.modules())
    replicas_per_device = [[_shell(original) for original in originals] for _ in devices]
    position = {id(original): index for index, original in enumerate(originals)}
    for shells, device, first in zip(replicas_per_device, devices, _first_flags(len(devices)), strict=True):
        for original, shell in zip(originals, shells, strict=True):
            _wire(original, shell, shells, position, device, first)
    return [shells[0] for shells in replicas_per_device]


def _first_flags(count: int) -> list[bool]:
    return [index == 0 for index in range(count)]


def _shell(original: nn.Module) -> nn.Module:
    # ``_replicate_for_data_parallel`` is nn.Module's own hook for DataParallel replicas: a shallow copy with fresh
    # ``_parameters``/``_buffers``/``_modules`` dicts, overridden by modules that need it (RNNs reset their flat
    # weight caches there). It is private, so this is the only call to it; tests/test_replicate.py covers it.
    return original._replicate_for_data_parallel()


def _wire(
    original: nn.Module,
    shell: nn.Module,
    shells: list[nn.Module],
    position: dict[int, int],
    device: torch.device,
    first: bool,
) -> None:
    for name, child in original._modules.items():
        shell._modules[name] = None if child is None else shells[position[id(child)]]
    for name, param in original._parameters.items():
        # Replicas are views, not leaves: set them as plain attributes, as torch's replicate does.
        setattr(shell, name, None if param is None else _parameter_alias(param, device))
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
