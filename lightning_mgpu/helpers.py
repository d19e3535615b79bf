"""Helpers for model code that runs on several devices, all public.

Where intermediate tensors go (``to_device_of``), which parameters replicate (``register_parameters``), how to
reach the model inside a wrapper (``unwrap``) and how a script reads the local rank that ``torch.distributed.launch``
passes (``add_local_rank_argument``, ``parse_local_rank``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from lightning.fabric.utilities import move_data_to_device
from torch import nn
from torch.nn.parallel import DataParallel as TorchDataParallel
from torch.nn.parallel import DistributedDataParallel

from lightning_mgpu._compat import compiled_original, is_compiled_wrapper
from lightning_mgpu.engine import MGPUDataParallel
from lightning_mgpu.errors import ConfigurationError

# Create and move intermediate tensors on the device of the data they go with, which differs per replica.


def device_of(related: torch.Tensor | nn.Module | torch.device | str) -> torch.device:
    """The device of a tensor, a module (its ``device``, else its first parameter, buffer or tensor) or a spec."""
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
            " Pass the tensor the data goes with instead: to_device_of(obj, x).",
            setting="to_device_of.related",
        )
    raise TypeError(f"to_device_of needs a tensor, a module or a device as `related`, not {type(related).__name__}")


def to_device_of(obj: Any, related: torch.Tensor | nn.Module | torch.device | str) -> Any:
    """Move ``obj`` (a tensor or any nested collection of them) to the device of ``related``.

    Under data parallelism each replica computes on its own device, so a tensor made in the step must follow the data:
    ``mask = to_device_of(mask, x)``, never a fixed ``.cuda()``.
    """
    return move_data_to_device(obj, device_of(related))


def _tensors_of(module: nn.Module) -> Any:
    yield from module.parameters()
    yield from module.buffers()
    for value in vars(module).values():  # plain tensor attributes, for a module with no parameter or buffer
        if isinstance(value, torch.Tensor):
            yield value


# Parameters kept in a plain list are not replicated (or trained, saved, moved): register each one instead.


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
                " prefix.",
                setting="register_parameters.prefix",
            )
        parameter = tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor)
        module.register_parameter(name, parameter)
        names.append(name)
    return names


# Wrappers (DataParallel, DDP, torch.compile) hide the model's own attributes; ``unwrap`` finds the model again.


def unwrap(model: nn.Module) -> nn.Module:
    """The innermost module inside any stack of DataParallel (torch's or ours), DDP and ``torch.compile`` wrappers.

    Reach attributes through the result (``unwrap(model).encoder``) but call ``forward`` through the wrapper, or the
    other devices are not used.
    """
    while True:
        if isinstance(model, (TorchDataParallel, DistributedDataParallel, MGPUDataParallel)):
            model = model.module
        elif is_compiled_wrapper(model):
            model = compiled_original(model)
        else:
            return model


# Helpers for scripts started by ``python -m torch.distributed.launch``, which passes the local rank as a flag.


def add_local_rank_argument(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Let ``parser`` accept the local rank however the launcher spells it.

    ``torch.distributed.launch`` passes ``--local-rank=N`` since torch 2.0 and ``--local_rank N`` before; a script
    that parses its own arguments dies on the spelling it does not know. Both land in ``args.local_rank``, which
    defaults to the ``LOCAL_RANK`` environment variable (torchrun) or 0.
    """
    parser.add_argument(
        "--local-rank",
        "--local_rank",
        dest="local_rank",
        type=int,
        default=int(os.environ.get("LOCAL_RANK", 0)),
        help="set by torch.distributed.launch; Lightning reads the rank from the environment",
    )
    return parser


def parse_local_rank(argv: Sequence[str] | None = None) -> int:
    """Take the local rank out of ``argv`` (default ``sys.argv``), leaving the script's other arguments alone.

    Accepts ``--local-rank=N``, ``--local-rank N``, ``--local_rank=N`` and ``--local_rank N``; falls back to
    ``LOCAL_RANK`` and then 0. When ``argv`` is ``sys.argv`` the flag is removed from it, so a LightningCLI or
    argparse parser that runs afterwards never sees it.

    Only a rank passed as a flag is written to ``LOCAL_RANK`` (where the legacy launcher does not set it): outside
    any launcher the variable stays unset, since Lightning takes a set ``LOCAL_RANK`` to mean that another program
    started the processes, and would then wait for ranks that nobody starts.
    """
    in_place = argv is None
    arguments = sys.argv if argv is None else list(argv)
    parser = add_local_rank_argument(argparse.ArgumentParser(add_help=False, allow_abbrev=False))
    parser.set_defaults(local_rank=None)
    known, rest = parser.parse_known_args(arguments[1:])
    if in_place:
        sys.argv[1:] = rest
    if known.local_rank is None:
        return int(os.environ.get("LOCAL_RANK", 0))
    os.environ.setdefault("LOCAL_RANK", str(known.local_rank))
    return int(known.local_rank)
