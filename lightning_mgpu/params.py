"""Parameters kept in a plain list are not replicated (or trained, saved, moved): register each one instead."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from lightning_mgpu.errors import ConfigurationError


def register_parameters(module: nn.Module, prefix: str, params: Iterable[torch.Tensor]) -> list[str]:
    """Register each tensor of ``params`` on ``module`` as ``f"{prefix}_{i}"`` and return the names.

    The ``self.register_parameter('H_{}'.format(k), H_k)`` pattern in one call: each parameter is an
    attribute of the module, so it is trained, saved, moved and replicated like any other. Tensors that are not yet
    parameters are wrapped in ``nn.Parameter``.
    """
    names = []
    for index, tensor in enumerate(params):
        name = f"{prefix}_{index}"
        if hasattr(module, name):
            raise ConfigurationError(
                f"register_parameters: {type(module).__name__} already has an attribute {name!r}; choose another"
                " prefix."
            )
        parameter = tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor)
        module.register_parameter(name, parameter)
        names.append(name)
    return names
