"""Checks run before any process starts or any step runs: the configuration's devices and the model's structure.

Each finding names the attribute and the fix. Errors stop ``fit`` under the ``mgpu_*`` strategies; warnings are
shown once. The doctor runs the same model checks.

The checks judge only the model's own code: what torch, torchmetrics, Lightning and the model libraries keep in plain
attributes they handle themselves (``lightning_mgpu.library_code``), and what Lightning puts on every module, is
theirs; flagging it would refuse stock models and give advice that breaks them.

Only what is certainly wrong is an error: parameters and modules in plain containers that are registered nowhere else
in the model, which are never trained or replicated, and lazy parameters. A plain container that only indexes
modules, parameters and buffers registered elsewhere (a dict of metrics by name) loses nothing: each replica gets a
copy of it holding the replica's own. Tensors outside parameters and buffers are warnings, because code that moves
them to its input's device works; ``allow_plain_tensors`` says so per attribute and silences them.
"""

from __future__ import annotations

import functools
import types
import warnings
from collections.abc import Generator, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torchmetrics import Metric

from lightning_mgpu.errors import ConfigurationError, Finding, ModelCheckError
from lightning_mgpu.library_code import kept_by_library
from lightning_mgpu.namespaces import Namespace, imported


def check_devices_exist(devices: Sequence[object], strategy_name: str) -> None:
    """Refuse CUDA devices that this machine does not have, naming them and the fix.

    Only CUDA ``torch.device`` entries are checked. A custom Lightning accelerator may describe its devices with
    anything (strings, integers, objects of its own), and Lightning hands them to the strategy as they are; what they
    mean is that accelerator's business.
    """
    cuda_indices = [
        device.index or 0 for device in devices if isinstance(device, torch.device) and device.type == "cuda"
    ]
    if not cuda_indices:
        return
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    missing = sorted({index for index in cuda_indices if index >= available})
    if missing:
        raise ConfigurationError(
            f"{strategy_name} was asked for CUDA devices {sorted(set(cuda_indices))}, but this machine has"
            f" {available} CUDA device(s), so {missing} do not exist. Ask for at most devices={available}, or use"
            " accelerator='cpu' to run on the CPU.",
            setting="Trainer.devices",
        )


def check_gpus_exist(accelerator: object, devices: object) -> None:
    """Refuse ``accelerator="gpu"`` or ``"cuda"`` asking for more CUDA devices than exist, before a Trainer is built.

    Lightning's own refusal comes from deep inside the Trainer's constructor ("No supported gpu backend found!") and
    names neither the count asked for nor a way out. ``devices`` is read as the Trainer reads it: a count, ``-1`` or
    ``"auto"`` for every device, or a list (or comma-separated string) of indices. ``accelerator="gpu"`` on a Mac
    with MPS is left to Lightning, which picks MPS there, and so is any ``devices`` value it would refuse itself.
    """
    if not isinstance(accelerator, str) or accelerator.lower() not in ("gpu", "cuda"):
        return
    if accelerator.lower() == "gpu" and torch.backends.mps.is_available():
        return
    asked = _gpus_asked_for(devices)
    if asked is None:
        return
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if isinstance(asked, list):
        if all(index < available for index in asked):
            return
        wanted = f"{len(asked)} GPU(s), with indices {asked}"
    elif asked == -1:
        if available:
            return
        wanted = "every GPU (at least 1)"
    else:
        if asked <= available:
            return
        wanted = f"{asked} GPU(s)"
    fewer = f" Or ask for at most --trainer.devices {available}." if available else ""
    raise ConfigurationError(
        f"trainer.accelerator {accelerator!r} with trainer.devices {devices!r} asks for {wanted}, but this machine"
        f" has {available} CUDA device(s). Run on the CPU with --trainer.accelerator cpu (with --trainer.devices 2"
        f" for 2 virtual replicas or processes), or use a CPU config such as configs/quickstart.yaml.{fewer}",
        setting="Trainer.accelerator",
    )


def _gpus_asked_for(devices: object) -> int | list[int] | None:
    """What ``Trainer(devices=...)`` asks for: a count, -1 for every device, indices, or ``None`` if it is invalid."""
    if isinstance(devices, str):
        text = devices.strip()
        if text == "auto":
            return -1
        try:
            if "," in text:
                return sorted({int(part) for part in text.split(",") if part.strip()}) or None
            return _gpus_asked_for(int(text))
        except ValueError:
            return None
    if isinstance(devices, int) and not isinstance(devices, bool):
        return devices if devices == -1 or devices > 0 else None
    if isinstance(devices, (list, tuple)) and devices and all(isinstance(index, int) for index in devices):
        return sorted(set(devices))
    return None


# Model checks: multi-GPU traps that show in a model's structure.
_PLAIN_TENSORS_ALLOWED = "_mgpu_plain_tensors_allowed"
"""The instance attribute where ``allow_plain_tensors`` keeps the names it was given."""


def allow_plain_tensors(module: nn.Module, *names: str) -> None:
    """Tell the model checks that these attributes of ``module`` hold plain tensors on purpose.

    For constants that the module's own code moves to the device of the data it meets (``anchors.to(x.device)``), so
    that every replica computes on its own device: the checks stop warning about a tensor, or a plain list, tuple or
    dict of tensors, kept in these attributes. Parameters and modules in plain containers are still errors: they
    would not be trained, saved or replicated.

    Raises:
        ConfigurationError: for a name that is not a plain attribute of ``module`` (set it first), or one that is a
            registered parameter, buffer or submodule, which needs no permission.
    """
    registered = [name for name in names if name in module._parameters or name in module._buffers]
    registered += [name for name in names if name in module._modules]
    missing = [name for name in names if name not in vars(module) and name not in registered]
    if registered or missing:
        problems = []
        if missing:
            problems.append(f"{', '.join(map(repr, missing))} is not an attribute of it yet (assign it first)")
        if registered:
            problems.append(f"{', '.join(map(repr, registered))} is a registered parameter, buffer or submodule")
        raise ConfigurationError(
            f"allow_plain_tensors({type(module).__name__}, ...): {'; '.join(problems)}. Name the attributes that"
            " hold plain tensors, after assigning them: allow_plain_tensors(self, 'anchors').",
            setting="allow_plain_tensors.names",
        )
    allowed = vars(module).get(_PLAIN_TENSORS_ALLOWED, frozenset())
    module.__dict__[_PLAIN_TENSORS_ALLOWED] = allowed | frozenset(names)


def check_model(module: nn.Module) -> list[Finding]:
    """Every structural multi-GPU trap that your code put in ``module`` and its submodules.

    Where an attribute came from is only worked out for the few attributes that would be findings, so a clean model
    costs one pass over its modules' attributes.
    """
    findings: list[Finding] = []
    baseline = _baseline()
    registered = _Registered(module)
    for prefix, submodule in module.named_modules():
        if isinstance(submodule, Metric):
            continue  # torchmetrics keeps its states as attributes on purpose and moves them itself
        state = vars(submodule)
        allowed = state.get(_PLAIN_TENSORS_ALLOWED, frozenset())
        for name, value in state.items():
            if name in baseline or name == _PLAIN_TENSORS_ALLOWED:
                continue
            where = f"{prefix}.{name}" if prefix else name
            found = [
                finding
                for finding in _check_attribute(where, value, registered)
                if not (name in allowed and finding.check in _ONLY_TENSORS)
            ]
            if found and not kept_by_library(submodule, name):
                findings.extend(found)
    findings.extend(
        Finding(
            "error",
            "uninitialized-parameter",
            name,
            f"`{name}` belongs to a lazy module that has not run yet, so it has no shape to replicate or all-reduce."
            " Run one forward pass on a batch before fit (in __init__ or setup, e.g. self(example_batch)), or give"
            " the layer its input size (nn.Linear(in_features, ...) instead of nn.LazyLinear).",
        )
        for name, parameter in module.named_parameters()
        if nn.parameter.is_lazy(parameter)
    )
    return findings


def report(findings: list[Finding], strategy_name: str) -> None:
    """Raise one error listing every error-level finding; warn once per warning-level finding."""
    for finding in findings:
        if finding.level == "warning":
            warnings.warn(f"{strategy_name}: {finding.message}", UserWarning, stacklevel=3)
    errors = [finding for finding in findings if finding.level == "error"]
    if errors:
        listing = "\n".join(f"- {finding.message}" for finding in errors)
        raise ModelCheckError(
            f"{strategy_name} found {len(errors)} problem(s) in the model before training:\n{listing}",
            findings=errors,
        )


def _baseline() -> frozenset[str]:
    """Attribute names that torch and Lightning give every module, learnt by building one on first use.

    ``save_hyperparameters`` runs too, because Lightning stores part of what it saves (``_hparams_initial``) from a
    function outside the class, where reading the class's source would not find it. The names of every imported
    Lightning namespace's LightningModule count, learnt again once a second one is imported.
    """
    return _baseline_of(imported())


@functools.cache
def _baseline_of(namespaces: tuple[Namespace, ...]) -> frozenset[str]:
    names = frozenset(vars(nn.Module()))
    for namespace in namespaces:
        lightning_module = namespace.LightningModule()
        # A suspended generator's frame has no callers: Lightning, which looks for ``__init__`` arguments in the
        # frames above the one it is given, finds none, instead of taking a method of ours that calls ``super()``.
        lightning_module.save_hyperparameters({"baseline": 0}, frame=_frame_without_callers())
        names |= frozenset(vars(lightning_module))
    return names


def _frame_without_callers() -> types.FrameType | None:
    def suspended() -> Generator[None, None, None]:
        yield

    generator = suspended()
    assert isinstance(generator, types.GeneratorType)
    return generator.gi_frame


class _Registered:
    """The modules, parameters and buffers registered in a model, by identity, worked out on first use."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._ids: set[int] | None = None

    def __contains__(self, value: object) -> bool:
        if not isinstance(value, (nn.Module, torch.Tensor)):
            return False
        if self._ids is None:
            model = self._model
            tensors = (*model.parameters(), *model.buffers())
            self._ids = {id(item) for item in (*model.modules(), *tensors)}
        return id(value) in self._ids


def _check_attribute(where: str, value: Any, registered: _Registered) -> list[Finding]:
    if value in registered:
        return []
    if isinstance(value, torch.Tensor):
        return [
            Finding(
                "warning",
                "unregistered-tensor",
                where,
                f"`{where}` is a tensor but neither a parameter nor a buffer, so `.to()` does not move it and every"
                f" replica shares the one on {value.device}. Register it:"
                f" `self.register_buffer('{where.split('.')[-1]}', tensor)` (or `nn.Parameter` if it is trained),"
                " or create it inside the step on the input's device. If the module's own code moves it to the"
                f" device of its input: `lightning_mgpu.allow_plain_tensors(self, '{where.split('.')[-1]}')`.",
            )
        ]
    if isinstance(value, (list, tuple, set, Mapping)) and not isinstance(value, (nn.Module, str)):
        kinds = sorted({_kind(item) for item in _leaves(value) if item not in registered} - {""})
        container = type(value).__name__
        name = where.split(".")[-1]
        if kinds == ["tensor"]:
            return [
                Finding(
                    "warning",
                    "plain-tensors",
                    where,
                    f"`{where}` is a plain Python {container} holding tensors, which `.to()` does not move, so every"
                    " replica reads the same ones, on the device where they were made. Register each one with"
                    f" `self.register_buffer(...)`, or create them inside the step on the input's device. If the"
                    " module's own code moves them to the device of its input, say so and this warning goes:"
                    f" `lightning_mgpu.allow_plain_tensors(self, '{name}')`.",
                )
            ]
        if kinds:
            modules = "module" in kinds
            suggestion = "nn.ModuleList / nn.ModuleDict" if modules else "nn.ParameterList / nn.ParameterDict"
            return [
                Finding(
                    "error",
                    "plain-container",
                    where,
                    f"`{where}` is a plain Python {container} holding {' and '.join(kinds)}s, which are not trained,"
                    f" saved, moved to the device or replicated. Use {suggestion}, or register each one with"
                    f" `lightning_mgpu.register_parameters(self, '{name}', params)` /"
                    " `self.register_buffer(...)`.",
                )
            ]
    return []


_ONLY_TENSORS = frozenset({"unregistered-tensor", "plain-tensors"})
"""The findings that ``allow_plain_tensors`` silences: tensors that are neither parameters nor buffers."""


def _kind(value: Any) -> str:
    if isinstance(value, nn.Parameter):
        return "parameter"
    if isinstance(value, nn.Module):
        # A module with neither parameters nor buffers (a function wrapped as a module, as Hugging Face's kernel
        # hub attaches them) has nothing to train, save, move or replicate.
        return "module" if _has_state(value) else ""
    if isinstance(value, torch.Tensor):
        return "tensor"
    return ""


def _has_state(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None or next(module.buffers(), None) is not None


def _leaves(value: Any, depth: int = 0) -> Iterator[Any]:
    if depth > 4:
        return
    items = value.values() if isinstance(value, Mapping) else value
    for item in items:
        if isinstance(item, (list, tuple, set, Mapping)) and not isinstance(item, (nn.Module, str)):
            yield from _leaves(item, depth + 1)
        else:
            yield item
