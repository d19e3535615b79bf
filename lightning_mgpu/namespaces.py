"""The Lightning namespaces, and what the package takes from each once it is imported.

Lightning installs its trainer twice: as ``lightning.pytorch`` (with ``lightning.fabric``) and as ``pytorch_lightning``
(with ``lightning_fabric``), the same code with separate classes and separate strategy registries. A
``pytorch_lightning.Trainer`` takes only ``pytorch_lightning``'s strategies, modules and callbacks, and an
``isinstance`` check against one namespace's class is false for the other's. So each piece of the integration is
written once without a Lightning base and bound to every namespace found here (``Bindings``), and whatever Lightning
class a piece checks against, raises or filters, it takes from the namespace of the class at hand (``namespace_of``).
Lightning's string enums (``TrainerFn``, ``RunningStage``) compare equal across the namespaces and need none of this.

Importing ``pytorch_lightning`` rebinds the rank-zero logger it shares with ``lightning.pytorch``, so nothing here
imports it: ``pytorch_lightning_namespace`` is ``None`` until something else has, and a class of it at hand means it
has been (``strategies/__init__.py`` binds the package to it then, through ``import_hook.py``).
"""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Generic, TypeVar

C = TypeVar("C", bound=type)


def _from(module: str) -> Any:
    """A field for the class of the field's name in ``module``, ``{pytorch}`` and ``{fabric}`` being the packages."""
    return field(metadata={"module": module}, repr=False)


def _in_packages(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == package or module.startswith(package + ".") for package in packages)


@dataclass(frozen=True, eq=False)
class Namespace:
    """One installed Lightning namespace: its two packages, and the classes of it that the package uses."""

    name: str
    """The trainer's package: ``lightning.pytorch`` or ``pytorch_lightning``."""
    fabric: str
    """Fabric's package that goes with it: ``lightning.fabric`` or ``lightning_fabric``."""
    Trainer: type[Any] = _from("{pytorch}")
    LightningModule: type[Any] = _from("{pytorch}")
    LightningDataModule: type[Any] = _from("{pytorch}")
    Strategy: type[Any] = _from("{pytorch}.strategies")
    ParallelStrategy: type[Any] = _from("{pytorch}.strategies")
    DDPStrategy: type[Any] = _from("{pytorch}.strategies")
    StrategyRegistry: Any = _from("{pytorch}.strategies")
    AcceleratorRegistry: Any = _from("{pytorch}.accelerators")
    TorchSyncBatchNorm: type[Any] = _from("{pytorch}.plugins")
    GradientAccumulationScheduler: type[Any] = _from("{pytorch}.callbacks")
    BasePredictionWriter: type[Any] = _from("{pytorch}.callbacks")
    CombinedLoader: type[Any] = _from("{pytorch}.utilities")
    CSVLogger: type[Any] = _from("{pytorch}.loggers")
    TensorBoardLogger: type[Any] = _from("{pytorch}.loggers")
    PossibleUserWarning: type[Warning] = _from("{pytorch}.utilities.warnings")
    MisconfigurationException: type[Exception] = _from("{pytorch}.utilities.exceptions")
    LightningEnvironment: type[Any] = _from("{fabric}.plugins.environments")
    SLURMEnvironment: type[Any] = _from("{fabric}.plugins.environments")
    TorchElasticEnvironment: type[Any] = _from("{fabric}.plugins.environments")

    def owns(self, module: str) -> bool:
        """Whether the module called ``module`` is part of this namespace."""
        return _in_packages(module, (self.name, self.fabric))

    @property
    def import_line(self) -> str:
        """How code imports this namespace, as Lightning's own documentation writes it."""
        return f"import {self.name} as pl"


def _load(pytorch: str, fabric: str) -> Namespace:
    modules = {spec.name: spec.metadata["module"] for spec in fields(Namespace) if "module" in spec.metadata}
    classes = {
        name: getattr(importlib.import_module(module.format(pytorch=pytorch, fabric=fabric)), name)
        for name, module in modules.items()
    }
    return Namespace(name=pytorch, fabric=fabric, **classes)


def _load_if_installed(pytorch: str, fabric: str) -> Namespace | None:
    try:
        return _load(pytorch, fabric)
    except ImportError:
        return None


LIGHTNING = _load("lightning.pytorch", "lightning.fabric")
"""``lightning.pytorch``, which the package's public classes are bound to."""
PYTORCH_LIGHTNING_PACKAGES = ("pytorch_lightning", "lightning_fabric")
"""The packages of the second namespace, which Lightning 2.x installs next to ``lightning.pytorch``."""

_pytorch_lightning: Namespace | None = None
_loading = threading.Lock()


def pytorch_lightning_namespace() -> Namespace | None:
    """``pytorch_lightning`` once it is imported; ``None`` before, or where it is not installed. Never imports it."""
    global _pytorch_lightning
    if _pytorch_lightning is None and sys.modules.get(PYTORCH_LIGHTNING_PACKAGES[0]) is not None:
        with _loading:
            if _pytorch_lightning is None:
                _pytorch_lightning = _load_if_installed(*PYTORCH_LIGHTNING_PACKAGES)
    return _pytorch_lightning


def imported() -> tuple[Namespace, ...]:
    """The namespaces imported so far: ``lightning.pytorch``, then ``pytorch_lightning`` once something imports it."""
    second = pytorch_lightning_namespace()
    return (LIGHTNING,) if second is None else (LIGHTNING, second)


def namespace_of(cls: type) -> Namespace | None:
    """The namespace of the first Lightning class in the MRO of ``cls``; ``None`` for a class with no Lightning base.

    A class of ``lightning_fabric`` alone, used while ``pytorch_lightning`` is not imported, has none.
    """
    for klass in cls.__mro__:
        module = getattr(klass, "__module__", None) or ""
        if LIGHTNING.owns(module):
            return LIGHTNING
        if _in_packages(module, PYTORCH_LIGHTNING_PACKAGES) and (second := pytorch_lightning_namespace()) is not None:
            return second
    return None


def mixed(classes: Mapping[str, type | None]) -> str | None:
    """Why classes of different namespaces cannot run together, naming each and the fix; ``None`` when they can.

    Args:
        classes: each class by what it is to the run (``"the model DensityModel"``); ``None`` and classes without a
            Lightning base are left out.
    """
    by_namespace: dict[str, list[str]] = {}
    for role, cls in classes.items():
        namespace = None if cls is None else namespace_of(cls)
        if namespace is not None:
            by_namespace.setdefault(namespace.name, []).append(role)
    if len(by_namespace) < 2:
        return None
    described = ", but ".join(
        f"{' and '.join(roles)} {'is' if len(roles) == 1 else 'are'} {name}'s" for name, roles in by_namespace.items()
    )
    imports = " or ".join(f"`{namespace.import_line}`" for namespace in imported())
    return (
        f"{described}: Lightning's two namespaces do not mix, a Trainer of one runs no LightningModule or"
        f" LightningDataModule of the other. Import every Lightning class of the run from one of them ({imports}"
        " everywhere; `import lightning as L` is lightning.pytorch)."
    )


class Bindings(Generic[C]):
    """The classes that bind one piece of the package, written without a Lightning base, to each namespace.

    Use an instance as a class decorator on each binding: ``class MGPUDPStrategy(MGPUDPLogic, ParallelStrategy)``
    binds ``MGPUDPLogic`` to the namespace of ``ParallelStrategy``.
    """

    def __init__(self) -> None:
        self._by_namespace: dict[str, C] = {}

    def __call__(self, bound: C) -> C:
        """Record ``bound`` as the binding to the namespace of its Lightning base."""
        namespace = namespace_of(bound)
        if namespace is None:
            raise TypeError(f"{bound.__qualname__} has no Lightning base, so it binds to no Lightning namespace")
        self._by_namespace[namespace.name] = bound
        return bound

    def __getitem__(self, namespace: Namespace) -> C:
        """The binding to ``namespace``."""
        return self._by_namespace[namespace.name]

    def __contains__(self, cls: object) -> bool:
        """Whether ``cls`` is one of the bindings itself (not a subclass of one)."""
        return any(cls is bound for bound in self._by_namespace.values())

    def __iter__(self) -> Iterator[C]:
        """The bindings made so far, for a namespace imported after them to accept."""
        return iter(list(self._by_namespace.values()))
