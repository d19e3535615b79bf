"""Make one replica of a module per device whose parameters stay differentiable aliases of the originals.

The backward pass of every replica therefore accumulates into the original parameters, so the optimizer sees the
gradient of the whole batch. A replica behaves like the module on one device: ``parameters()``,
``named_parameters()`` and ``buffers()`` of the replica and of every module inside it yield the replica's own
tensors (so weight penalties and ``next(self.parameters()).device`` work and are exact), tied weights stay tied, and
compiled submodules run compiled on the replica's own tensors. A replica built on the CPU behaves exactly like one
built on a GPU.

``torch.nn.DataParallel`` builds every replica module anew on every step. ``ReplicaCache`` keeps the replica objects
between steps and only re-points them at the module's current attributes, parameters and buffers, which costs a
fraction of rebuilding them (see benchmarks/README.md).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from torch import nn

from lightning_mgpu.engine import _torch_private


class ReplicaCache:
    """Replica shells kept between calls, refreshed from the module on every call.

    Modules that customise ``__setattr__`` or their own replication (RNNs, torch.compile's wrapper, torchmetrics)
    get a fresh shell each call; every other module reuses its shell.
    """

    def __init__(self) -> None:
        self._key: tuple[tuple[int, ...], tuple[torch.device, ...]] | None = None
        self._shells: list[list[nn.Module]] = []

    @property
    def structure(self) -> object:
        """Changes whenever the module's structure or the devices change, so callers can cache what depends on it."""
        return self._key

    def __getstate__(self) -> dict[str, object]:
        """The shells hold views with autograd history, which cannot be copied; a copy starts with no shells."""
        return {}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__()  # type: ignore[misc]

    def __call__(self, module: nn.Module, devices: Sequence[torch.device]) -> list[nn.Module]:
        """One replica of ``module`` per entry of ``devices``, in order.

        Parameters reach a replica on the parameter's own device as an alias, and a replica on another device as a
        differentiable copy; one parameter used by several modules is one tensor in the replica too. Buffers of the
        first replica are the original buffers, so in-place updates (BatchNorm running statistics) made there
        persist, as in ``torch.nn.DataParallel``; the other replicas get private copies, so concurrent replicas
        never write to the same buffer.
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
            aliases: dict[int, torch.Tensor] = {}
            for original, shell, reuse in zip(originals, shells, reusable, strict=True):
                if reuse:
                    _refresh(original, shell)
                _wire(original, shell, shells, position, device, aliases, first=index == 0, direct=reuse)
            for original, shell in zip(originals, shells, strict=True):
                _bind_compiled(original, shell)
            replicas.append(shells[0])
        return replicas


def replicate(module: nn.Module, devices: Sequence[torch.device]) -> list[nn.Module]:
    """Fresh replicas of ``module``, one per device (see ``ReplicaCache`` for what a replica holds)."""
    return ReplicaCache()(module, devices)


def keep_reassigned_buffers(module: nn.Module, first_replica: nn.Module) -> None:
    """Store on ``module`` the buffers that replica 0 reassigned (``self.count = self.count + 1``).

    Replica 0 works on the module's own buffers, so its in-place updates persist; a reassignment only rebinds the
    replica's name, and without this it would be lost at the end of the call.
    """
    for original, shell in zip(module.modules(), first_replica.modules(), strict=True):
        for name, buffer in shell._buffers.items():
            if original._buffers.get(name, buffer) is not buffer:
                original._buffers[name] = buffer


def assigned_attributes(module: nn.Module, replica: nn.Module, ignore: frozenset[str]) -> list[str]:
    """The public plain attributes that ``replica`` (or a module inside it) assigned, as dotted paths.

    They live on the replica only and are gone after the call; names starting with ``_`` and those in ``ignore``
    are bookkeeping of torch, Lightning or the caller, not state the model meant to keep.
    """
    assigned: list[str] = []
    for (prefix, original), shell in zip(module.named_modules(), replica.modules(), strict=True):
        state = original.__dict__
        changed = [
            name
            for name, value in shell.__dict__.items()
            if name[0] != "_" and name not in ignore and state.get(name, _MISSING) is not value
        ]
        if changed:  # what torch's own hooks recompute before every forward (weight_norm's weight) is not lost
            rewritten = _torch_private.names_rewritten_by_hooks(original, _torch_private.is_torch_class)
            assigned.extend(f"{prefix}.{name}" if prefix else name for name in changed if name not in rewritten)
    return assigned


_MISSING = object()


def _reusable(original: nn.Module) -> bool:
    # A class's own __setattr__ may keep caches that only a fresh shell gets right; torch.compile's wrapper holds no
    # parameters of its own, so its __setattr__ never runs on a replica.
    custom = type(original).__setattr__ is not nn.Module.__setattr__
    if custom and not _torch_private.is_compiled_wrapper(original):
        return False
    return not _torch_private.has_own_replication(original)


def _shell(original: nn.Module) -> nn.Module:
    """A shallow copy of ``original`` with its own ``_parameters``/``_buffers``/``_modules`` dicts.

    Built by writing the instance dict directly, never through the class's ``__setattr__``, which modules such as
    torch.compile's wrapper redirect into the module they wrap; classes with their own replication hook use it.
    """
    if _torch_private.has_own_replication(original):
        return _torch_private.own_replica(original)
    shell = type(original).__new__(type(original))
    object.__setattr__(shell, "__dict__", {})
    _refresh(original, shell)
    return shell


def _refresh(original: nn.Module, shell: nn.Module) -> None:
    """What ``nn.Module._replicate_for_data_parallel`` does, into an existing shell."""
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
    aliases: dict[int, torch.Tensor],
    first: bool,
    direct: bool,
) -> None:
    for name, child in original._modules.items():
        shell._modules[name] = None if child is None else shells[position[id(child)]]
    parameters: dict[str, torch.Tensor | None] = shell._parameters  # type: ignore[assignment]
    for name, param in original._parameters.items():
        if param is None:
            parameters[name] = None
            continue
        alias = aliases.get(id(param))
        if alias is None:
            alias = aliases[id(param)] = _parameter_alias(param, device)
        if not direct:
            # A class with its own __setattr__ may keep caches of its weights (RNNs' flat weights): setting the
            # attribute keeps them in step, as torch's replicate does, before the alias moves to ``_parameters``.
            setattr(shell, name, alias)
            shell.__dict__.pop(name, None)
        parameters[name] = alias
    for name, buffer in original._buffers.items():
        shell._buffers[name] = None if buffer is None else _buffer_copy(buffer, device, first)


def _bind_compiled(original: nn.Module, shell: nn.Module) -> None:
    """Make a replica of a compiled module run compiled on the replica's own tensors, not the original's."""
    if _torch_private.is_compiled_wrapper(original):
        _torch_private.bind_compiled_wrapper(shell)
    compiled = _torch_private.compiled_call(original)
    if compiled is None:
        return
    rebound = _torch_private.recompile_call(compiled, shell)
    if rebound is None:
        warnings.warn(
            f"{type(original).__name__} was compiled in place with .compile(), and this torch does not let its"
            " replicas be compiled the same way, so they run it uncompiled (same results, without the speed-up)."
            " Use torch.compile(module) instead of module.compile() to keep replicas compiled.",
            UserWarning,
            stacklevel=4,
        )
    shell.__dict__["_compiled_call_impl"] = rebound


def _parameter_alias(param: torch.Tensor, device: torch.device) -> torch.Tensor:
    if param.device == device:
        # ``alias`` rather than ``view_as``: its backward passes the gradient through untouched, so sparse gradients
        # (nn.Embedding(sparse=True)) reach the parameter as they do on one device.
        return torch.ops.aten.alias.default(param)
    return param.to(device, non_blocking=True)


def _buffer_copy(buffer: torch.Tensor, device: torch.device, first: bool) -> torch.Tensor:
    if buffer.device == device:
        return buffer if first else buffer.clone()
    return buffer.to(device, non_blocking=True, copy=True)
