"""What the two lightning_mgpu strategies share: device and model checks, exact resume, a module left as given.

Each strategy is written once, as a class without a Lightning base (``MGPUDPLogic``, ``MGPUDDPLogic``), and bound to
each Lightning namespace by a class that adds the namespace's strategy base (``bind_strategy``):
``lightning_mgpu.MGPUDPStrategy`` for ``lightning.pytorch``, ``lightning_mgpu.strategies.pytorch_lightning``'s
classes for ``pytorch_lightning``. An instance given to the other namespace's Trainer becomes that namespace's
binding as soon as the Trainer hands it its accelerator, before any other of its code runs.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn

from lightning_mgpu._compat import drop_forward_left_by_lightning
from lightning_mgpu.checks import check_devices_exist, check_model, report
from lightning_mgpu.errors import ConfigurationError
from lightning_mgpu.namespaces import LIGHTNING, Bindings, Namespace, imported, mixed, namespace_of
from lightning_mgpu.resume import ExactResume

if TYPE_CHECKING:
    _Base = ParallelStrategy
else:
    _Base = object

S = TypeVar("S", bound="type[MGPUStrategyMixin]")
Init = TypeVar("Init", bound=Callable[..., None])


def keyword_hint(name: str, accepted: Sequence[str]) -> str:
    """The sentence that follows a refused keyword ``name``: the accepted keyword closest to it, else all of them."""
    close = difflib.get_close_matches(name, accepted, n=1)
    return f"Did you mean {close[0]}?" if close else f"The keywords it takes: {', '.join(accepted)}."


def suggest_keywords(init: Init) -> Init:
    """Give the ``TypeError`` of a keyword a strategy's ``__init__`` does not take the keyword meant.

    Python refuses such a keyword before ``__init__`` runs (also where Hydra builds the strategy from a config), so
    only a wrapper sees it; ``functools.wraps`` leaves ``inspect.signature`` reading the wrapped ``__init__``, so
    jsonargparse (LightningCLI) sees the same arguments.
    """
    _self, *parameters = inspect.signature(init).parameters.values()
    assert all(parameter.kind is not inspect.Parameter.VAR_KEYWORD for parameter in parameters), "takes any keyword"
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    accepted = sorted(parameter.name for parameter in parameters if parameter.kind in kinds)

    @functools.wraps(init)
    def checked(self: object, *args: Any, **kwargs: Any) -> None:
        for name in kwargs:
            if name not in accepted:
                hint = keyword_hint(name, accepted)
                raise TypeError(f"{type(self).__name__}() got an unexpected keyword argument {name!r}. {hint}")
        init(self, *args, **kwargs)

    return checked  # type: ignore[return-value]


class MGPUStrategyMixin(ExactResume, _Base):
    """Put first among the bases of a strategy's logic, which sets ``strategy_name`` and ``bindings``."""

    strategy_name: str
    bindings: ClassVar[Bindings[Any]]

    @property
    def _namespace(self) -> Namespace:
        """The Lightning namespace this strategy is bound to, read from its class."""
        namespace = namespace_of(type(self))
        assert namespace is not None, "a strategy's binding has a Lightning base"
        return namespace

    @property
    def accelerator(self) -> pl.accelerators.Accelerator | None:
        """The accelerator; the first object a Trainer hands its strategy, so it decides the strategy's namespace."""
        return super().accelerator

    @accelerator.setter
    def accelerator(self, accelerator: pl.accelerators.Accelerator | None) -> None:
        self._move_to_namespace_of(accelerator)
        super(MGPUStrategyMixin, type(self)).accelerator.fset(self, accelerator)  # type: ignore[attr-defined]

    @property
    def parallel_devices(self) -> list[torch.device] | None:
        """The devices of this node; checked when assigned, so a missing CUDA device fails before any step runs."""
        return super().parallel_devices

    @parallel_devices.setter
    def parallel_devices(self, parallel_devices: list[torch.device] | None) -> None:
        if parallel_devices:
            check_devices_exist(parallel_devices, self.strategy_name)
        # Lightning's own property: the strategy's class, looked up past this mixin, gives it unbound.
        super(MGPUStrategyMixin, type(self)).parallel_devices.fset(self, parallel_devices)  # type: ignore[attr-defined]

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``strategy_name`` and the class's paths (never Lightning's own names); again replaces the entries.

        A Trainer lowercases a strategy string before looking it up, so ``strategy="lightning_mgpu.MGPUDPStrategy"``
        (in Python, or ``--trainer.strategy`` of a LightningCLI) finds the class under its path lowercased.
        """
        for name in (cls.strategy_name, *cls.class_path_names()):
            strategy_registry.register(name, cls, description=cls.__name__, override=True)

    @classmethod
    def class_path_names(cls) -> tuple[str, ...]:
        """Its paths, lowercased: where the class is defined, and for a binding the public ``lightning_mgpu.<Name>``."""
        paths = [f"{cls.__module__}.{cls.__qualname__}"]
        if cls in cls.bindings:
            paths.append(f"lightning_mgpu.{cls.__name__}")
        return tuple(dict.fromkeys(path.lower() for path in paths))

    def connect(self, model: pl.LightningModule) -> None:
        """Connect the model, after checking that it and the datamodule are of the Trainer's Lightning namespace.

        The Trainer calls this first with the data attached, before Lightning's own code reaches the datamodule (where
        one of the other namespace fails with ``ValueError: Expected a parent``).
        """
        super().connect(model)
        trainer = self._trainer()
        datamodule = getattr(trainer, "datamodule", None)
        problem = mixed(
            {
                "the Trainer": type(self),  # its strategy, bound to the Trainer's namespace
                f"the model {type(model).__name__}": type(model),
                f"the datamodule {type(datamodule).__name__}": None if datamodule is None else type(datamodule),
            }
        )
        if problem is not None:
            wrong_model = namespace_of(type(model)) is not self._namespace
            raise ConfigurationError(problem, setting="Trainer.fit.model" if wrong_model else "Trainer.fit.datamodule")

    def _prepare_module(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        """Check the model for multi-GPU traps before fitting."""
        if trainer.state.fn == TrainerFn.FITTING:
            report(check_model(module), self.strategy_name)

    @staticmethod
    def _release_module(module: pl.LightningModule | None) -> None:
        """Leave the module as it was given, so it runs under any other strategy afterwards.

        Lightning's DDP strategy routes each step through the module's ``forward`` and, undoing that, leaves the
        class's own ``forward`` behind as an attribute of the module; that attribute is removed.
        """
        if module is not None:
            drop_forward_left_by_lightning(module)

    def _move_to_namespace_of(self, given: object) -> None:
        """Become the binding to the namespace of ``given``, an object its Trainer hands over, if that is another.

        Only the namespace's own code runs on the strategy from then on. Lightning's ``__init__`` keeps objects of
        its namespace on the strategy (the forward redirection); those are taken from a new instance of the
        binding, the rest of the state is kept.
        """
        target, own = namespace_of(type(given)), self._namespace
        if target is None or target is own:
            return
        if type(self) not in self.bindings:
            raise self._cannot_move(target)
        binding = self.bindings[target]
        fresh = vars(binding())
        for key, value in vars(self).items():
            if key in fresh and namespace_of(type(value)) is own and namespace_of(type(fresh[key])) is target:
                self.__dict__[key] = fresh[key]
        self.__class__ = binding

    def _cannot_move(self, target: Namespace) -> ConfigurationError:
        cls = type(self)
        base = next(klass for klass in cls.__mro__ if klass in self.bindings)
        binding = self.bindings[target]
        return ConfigurationError(
            f"{cls.__module__}.{cls.__qualname__} subclasses {base.__module__}.{base.__qualname__}, a"
            f" {self._namespace.name} strategy, but was given to a {target.name} Trainer, which runs only"
            f" {target.name} strategies; a subclass cannot be carried across. Subclass"
            f" {binding.__module__}.{binding.__qualname__} (the same strategy bound to {target.name}) instead, or"
            f" build the Trainer from {self._namespace.name}.",
            setting="Trainer.strategy",
        )


def bind_strategy(strategy: S) -> S:
    """Bind a strategy's logic to the namespace of its last base, a Lightning strategy class (a class decorator).

    Every Trainer accepts an instance of its own namespace's ``Strategy`` only (and checks ``ParallelStrategy`` and
    ``DDPStrategy`` too), so the binding is made acceptable to every other namespace imported (``accept_in``): an
    instance given to another namespace's Trainer is accepted, and becomes that namespace's binding when the Trainer
    hands it its accelerator. A binding to a namespace other than ``lightning.pytorch`` is registered under the
    public class too, so ``isinstance(trainer.strategy, lightning_mgpu.MGPUDPStrategy)`` holds in either Trainer.
    """
    strategy.bindings(strategy)
    for namespace in imported():
        accept_in(namespace, strategy)
    if namespace_of(strategy) is not LIGHTNING:
        strategy.bindings[LIGHTNING].register(strategy)
    return strategy


def accept_in(namespace: Namespace, binding: type) -> None:
    """Make ``namespace``'s Trainer accept ``binding``, a virtual subclass of its class named as the binding's base.

    Called for each binding when it is made, and for every binding made before ``namespace`` was imported.
    """
    if namespace_of(binding) is not namespace:
        getattr(namespace, binding.__bases__[-1].__name__).register(binding)
