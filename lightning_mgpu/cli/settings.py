"""What a setting of the command takes, and which Trainer settings are refused before or while a Trainer is built.

jsonargparse checks a value against its key's annotation; the Trainer checks some values itself, names the setting it
refuses only in its message, and accepts others it cannot run (``accumulate_grad_batches: 0`` divides by zero in the
training loop). ``cli/lightning_cli.py`` turns each of these into one line; this module says what a key takes, read
from the annotations at run time (``precision``'s choices are Lightning's own ``Literal``), and what the Trainer
leaves unchecked.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
import traceback
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from lightning_mgpu.errors import ConfigurationError
from lightning_mgpu.namespaces import Namespace

_LOWEST: dict[str, tuple[float, bool]] = {
    # 0 divides by zero in the training loop; a negative count runs, meaning nothing
    "accumulate_grad_batches": (1, True),
    "check_val_every_n_epoch": (1, True),  # likewise
    "val_check_interval": (0, False),  # 0 divides by zero
    "num_nodes": (1, True),
    "max_epochs": (-1, True),
    "min_epochs": (0, True),
    "max_steps": (-1, True),
    "min_steps": (0, True),
    "num_sanity_val_steps": (-1, True),
    "log_every_n_steps": (0, True),
    "reload_dataloaders_every_n_epochs": (0, True),
    "gradient_clip_val": (0, True),
    "fast_dev_run": (0, True),
}
"""The lowest value of each numeric Trainer setting that can run, and whether it is allowed itself.

Lightning checks some of these in its constructor and none of the others anywhere; all are checked here, so that each
says the same thing, before anything is built.
"""

_BATCHES = "an int >= 0 (batches) or a float in [0.0, 1.0] (a fraction of them), or null"
_TAKES = {
    "devices": "an int > 0, -1 for every device, 'auto', or a list of device indices such as [0, 1]",
    **{f"limit_{stage}_batches": _BATCHES for stage in ("train", "val", "test", "predict")},
    "overfit_batches": _BATCHES,
}
"""What a Trainer setting takes where its annotation (``devices: list[int] | str | int``) says less than the Trainer."""

_LIBRARIES = ("lightning", "pytorch_lightning", "lightning_fabric", "lightning_utilities", "torch", "lightning_mgpu")
"""The packages whose frames a Trainer's refusal of its settings passes through, beside the standard library's."""


def describe(annotation: Any) -> str:
    """A type annotation as a config is written: ``int or null``; a ``Literal``'s choices, its words first."""
    parts: list[str] = []
    choices: list[str] = []
    for member in _members(annotation):
        if typing.get_origin(member) is typing.Literal:
            choices += [str(choice) for choice in typing.get_args(member)]
        elif member is type(None):
            continue
        elif member is bool:
            parts += ["true", "false"]
        else:
            parts.append(_type_name(member))
    if choices:
        unique = list(dict.fromkeys(choices))
        parts.insert(0, "one of " + ", ".join(sorted(unique, key=lambda choice: choice.isdigit())))
    if type(None) in _members(annotation):
        parts.append("null")
    return _either(parts)


def describe_types(names: Sequence[str]) -> str:
    """Types as jsonargparse's messages name them (``int``, ``NoneType``, ``Literal['a', 'b']``), as ``describe``."""
    words = {"NoneType": ["null"], "bool": ["true", "false"]}
    return _either(
        [part for name in names for part in words.get(name, [name if "[" in name else name.rpartition(".")[2]])]
    )


def imported(class_path: str) -> Any:
    """What ``module.name`` names, imported; ``ImportError`` or ``AttributeError`` when it does not import."""
    module_name, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module_name), name)


def init_argument_takes(class_path: str, name: str) -> str | None:
    """What the init argument ``name`` of the class at ``class_path`` takes; ``None`` when its annotation is unknown.

    Looked up the class's bases too, as jsonargparse follows ``**kwargs`` into them (``MGPUDDPStrategy`` takes
    ``DDPStrategy``'s arguments).
    """
    try:
        cls = imported(class_path)
    except (ImportError, AttributeError, ValueError):
        return None
    for klass in getattr(cls, "__mro__", ()):
        init = klass.__dict__.get("__init__")
        if init is None or name not in inspect.signature(init).parameters:
            continue
        try:
            return describe(typing.get_type_hints(init)[name])
        except Exception:  # an annotation that does not resolve here (a name imported only for type checkers)
            return None
    return None


def trainer_takes(name: str, namespace: Namespace) -> str:
    """What the Trainer's setting ``name`` takes: its annotation, with the accelerators and the bounds it accepts."""
    if name in _TAKES:
        return _TAKES[name]
    if name == "accelerator":
        names = sorted({*namespace.AcceleratorRegistry.available_accelerators(), "gpu", "auto"})
        return f"one of {', '.join(names)}, or an Accelerator's class_path"
    annotation = typing.get_type_hints(namespace.Trainer.__init__).get(name)
    if name in _LOWEST:
        lowest, allowed = _LOWEST[name]
        number = "an int" if int in _members(annotation) and float not in _members(annotation) else "a number"
        nullable = " or null" if type(None) in _members(annotation) else ""
        return f"{number} {'>=' if allowed else '>'} {lowest:g}{nullable}"
    return describe(annotation) if annotation is not None else "a value"


def check_trainer_values(trainer: Mapping[str, Any], namespace: Namespace) -> None:
    """Refuse, before the Trainer is built, an accelerator this machine lacks or a number below what can run.

    Raises:
        ConfigurationError: the first such setting, with what it takes.
    """
    accelerator = trainer.get("accelerator")
    registry = namespace.AcceleratorRegistry
    if isinstance(accelerator, str) and accelerator.lower() in registry.available_accelerators():
        accelerator_class = registry[accelerator.lower()]["accelerator"]
        if not accelerator_class.is_available():
            here = sorted(name for name in registry.available_accelerators() if _available(registry, name))
            raise ConfigurationError(
                f"trainer.accelerator takes {' or '.join([*here, 'auto'])} on this machine, not {accelerator!r}:"
                f" {accelerator_class.__name__} is not available here. Use --trainer.accelerator {here[0]}, or run"
                f" on a machine with a {accelerator} device.",
                setting="Trainer.accelerator",
            )
    for name, (lowest, allowed) in _LOWEST.items():
        value = trainer.get(name)
        if isinstance(value, (int, float)) and (value < lowest or (value == lowest and not allowed)):
            raise ConfigurationError(
                f"trainer.{name} takes {trainer_takes(name, namespace)}, not {shown(value)}.", setting=f"Trainer.{name}"
            )


def refused_by_the_trainer(error: BaseException) -> bool:
    """Whether ``error``, raised while a Trainer was built, is the Trainer refusing its settings.

    It is when every frame it passed through runs Lightning's, torch's, this package's or the standard library's
    code, and the frame that raised it is not this package's: a frame of any other code (a callback or plugin of the
    project's own) makes it that code's error, and a raise of this package's own other than ``ConfigurationError`` a
    fault of the package; both keep their traceback.
    """
    modules = [str(frame.f_globals.get("__name__", "")) for frame, _ in traceback.walk_tb(error.__traceback__)]
    tops = [module.partition(".")[0] for module in modules]
    known = all(top in _LIBRARIES or top in sys.stdlib_module_names for top in tops)
    return known and bool(tops) and tops[-1] != "lightning_mgpu"


def settings_named(message: str, trainer: Mapping[str, Any], namespace: Namespace) -> list[str]:
    """The Trainer settings that the config changes and a message of the Trainer names, in the Trainer's order.

    Lightning's messages name what they refuse as code (```num_nodes```, ``Trainer(devices='0')``,
    ``enable_progress_bar=False``); a setting named only as a word (``in callbacks list``, ``using cpu
    accelerator``) is taken where none is named as code.
    """
    parameters = inspect.signature(namespace.Trainer.__init__).parameters
    changed = [
        name
        for name, parameter in parameters.items()
        if name in trainer and not _same(trainer[name], parameter.default)
    ]
    as_code = [name for name in changed if re.search(rf"`{re.escape(name)}`|(?<![\w.]){re.escape(name)}=", message)]
    return as_code or [name for name in changed if re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", message)]


def shown(value: Any) -> str:
    """``value`` as a config writes it: ``'two'``, ``0``, ``false``, ``null``, ``[0, 1]``, an object by its class."""
    if isinstance(value, str):
        return repr(value)
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, Sequence):
        return "[" + ", ".join(shown(item) for item in value) + "]"
    return type(value).__name__


def _either(parts: Sequence[str]) -> str:
    """``a, b or c``, each part once."""
    unique = list(dict.fromkeys(parts))
    return (
        " or ".join([", ".join(unique[:-1]), unique[-1]]) if len(unique) > 1 else (unique[0] if unique else "a value")
    )


def _members(annotation: Any) -> tuple[Any, ...]:
    return typing.get_args(annotation) if _is_union(annotation) else (annotation,)


def _is_union(annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    return origin is typing.Union or (origin is not None and getattr(origin, "__name__", "") == "UnionType")


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is not None and isinstance(origin, type) and issubclass(origin, Sequence) and origin is not str:
        items = typing.get_args(annotation)
        return f"list of {_type_name(items[0])}" if items else "list"
    if origin is not None and isinstance(origin, type) and issubclass(origin, Mapping):
        return "dict"
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def _available(registry: Any, name: str) -> bool:
    return bool(registry[name]["accelerator"].is_available())


def _same(value: Any, default: Any) -> bool:
    try:
        return bool(value == default)
    except Exception:  # a tensor or an object whose comparison does not give one bool
        return False
