"""Create and move intermediate tensors on the device of the data they go with, which differs per replica."""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.utilities import move_data_to_device
from torch import nn

from lightning_mgpu.errors import ConfigurationError


def device_of(related: torch.Tensor | nn.Module | torch.device | str) -> torch.device:
    """The device of a tensor, a module (a replica too, which owns no parameters) or a device spec."""
    if isinstance(related, torch.Tensor):
        return related.device
    if isinstance(related, (torch.device, str)):
        return torch.device(related)
    if isinstance(related, nn.Module):
        declared = getattr(related, "device", None)  # LightningModule: the replica's device inside a replica
        if isinstance(declared, torch.device):
            return declared
        for tensor in _tensors_of(related):
            return tensor.device
        raise ConfigurationError(
            f"{type(related).__name__} holds no parameter, buffer or tensor, so it has no device to move data to."
            " Pass the tensor the data goes with instead: to_device_of(obj, x)."
        )
    raise TypeError(f"to_device_of needs a tensor, a module or a device as `related`, not {type(related).__name__}")


def to_device_of(obj: Any, related: torch.Tensor | nn.Module | torch.device | str) -> Any:
    """Move ``obj`` (a tensor or any nested collection of them) to the device of ``related``.

    Under DataParallel each replica computes on its own device, so a tensor made in the step must follow the data:
    ``mask = to_device_of(mask, x)``, never a fixed ``.cuda()``.
    """
    return move_data_to_device(obj, device_of(related))


def _tensors_of(module: nn.Module) -> Any:
    yield from module.parameters()
    yield from module.buffers()
    for value in vars(module).values():  # replicas keep their parameter views as plain attributes
        if isinstance(value, torch.Tensor):
            yield value
