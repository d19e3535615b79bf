"""Which attributes of a module a library looks after, and which are the model's own code's.

torch, torchmetrics, Lightning and the model libraries (torchvision, timm, transformers, ...: ``LIBRARY_PACKAGES``)
keep bookkeeping of their own in plain attributes (an RNN's list of its flat weights, the tensor that ``weight_norm``
recomputes before every forward, a metric's states, a detector's anchors) and handle it themselves. An attribute is
theirs when a class of theirs in the module's MRO stores it (read from that class's source, so a subclass of
``nn.LSTM`` in your code inherits the exemption for ``_flat_weights`` but not for what the subclass adds), or when a
forward pre-hook of theirs recomputes it (``weight_norm``, ``spectral_norm``, ``torch.nn.utils.prune``). The model
checks judge only the rest, and replicas copy only the rest.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from collections.abc import Iterator
from typing import Any

from torch import nn

from lightning_mgpu._compat import names_rewritten_by_hooks

LIBRARY_PACKAGES = frozenset(
    {
        "torch",
        "torchmetrics",
        "lightning",
        "pytorch_lightning",
        "lightning_fabric",
        "torchvision",
        "torchaudio",
        "torchtext",
        "timm",
        "transformers",
        "diffusers",
        "peft",
        "sentence_transformers",
        "open_clip",
        "torch_geometric",
        "segmentation_models_pytorch",
        "monai",
        "ultralytics",
        "detectron2",
        "mmcv",
        "mmengine",
        "mmdet",
        "fairseq",
    }
)
"""Packages whose classes and utilities look after the attributes they store. Model libraries are judged as torch
is: their models train on DataParallel and DDP every day."""


def kept_by_library(module: nn.Module, name: str) -> bool:
    """Whether attribute ``name`` of ``module`` is kept by a library's class (``LIBRARY_PACKAGES``), not by you."""
    if name in names_rewritten_by_hooks(module, is_library_class):
        return True
    for cls in type(module).__mro__:
        if is_library_class(cls):
            names = _names_stored_by(cls)
            if names is None or name in names:
                return True
    return False


def is_library_class(cls: type) -> bool:
    """Whether ``cls`` is defined in one of ``LIBRARY_PACKAGES``."""
    module_name = getattr(cls, "__module__", None)
    return isinstance(module_name, str) and module_name.partition(".")[0] in LIBRARY_PACKAGES


@functools.cache
def _names_stored_by(cls: type) -> frozenset[str] | None:
    """Attribute names that the methods of ``cls`` store on the instance, read from the source of ``cls`` itself.

    Returns ``None`` when some method's source cannot be read (an install without sources); every attribute of an
    instance is then given the benefit of the doubt, since a false error would stop a correct model.
    """
    names: set[str] = set()
    for function in _functions_of(cls):
        try:
            # The code object's source: ``inspect.getsource`` of a function would read what it wraps instead.
            source = textwrap.dedent(inspect.getsource(function.__code__))
            tree = ast.parse(f"if True:\n{source}" if source[:1].isspace() else source)
        except (OSError, TypeError, SyntaxError):
            return None
        names.update(_names_stored_on_first_argument(tree, f"_{cls.__name__.lstrip('_')}"))
    return frozenset(names)


def _functions_of(cls: type) -> Iterator[Any]:
    """The Python functions defined in ``cls`` that receive the instance: methods and property accessors.

    A method that another package replaced by a function of its own is read together with the original: the one
    it wraps by ``functools.wraps``, or else the function of ``cls`` among the replacement's closure (``torch.compile``
    wraps ``nn.Module.__init__`` without ``functools.wraps``). The replacement is read too, since it may store
    attributes of its own: Hugging Face's kernel hub wraps a layer's ``__init__`` to keep function modules in
    ``self.__dict__``.
    """
    for value in vars(cls).values():
        if isinstance(value, (staticmethod, classmethod)):
            continue
        accessors = (value.fget, value.fset, value.fdel) if isinstance(value, property) else (value,)
        for accessor in accessors:
            for function in _wrapped_chain(accessor):
                if inspect.isfunction(function):
                    yield function
                    original = _original_of(function, cls)
                    if original is not function:
                        yield original


def _wrapped_chain(function: Any) -> Iterator[Any]:
    """``function``, then what it wraps by ``functools.wraps`` (its ``__wrapped__``), and so on, each once."""
    seen: set[int] = set()
    while callable(function) and id(function) not in seen:
        seen.add(id(function))
        yield function
        function = getattr(function, "__wrapped__", None)


def _original_of(function: Any, cls: type) -> Any:
    """``function`` if ``cls`` defines it, else the function of ``cls`` it closes over, if there is one."""
    if function.__qualname__.startswith(f"{cls.__qualname__}."):
        return function
    for cell in function.__closure__ or ():
        inner = cell.cell_contents
        if inspect.isfunction(inner) and inner.__qualname__.startswith(f"{cls.__qualname__}."):
            return inner
    return function


def _names_stored_on_first_argument(tree: ast.AST, private_prefix: str) -> set[str]:
    """Names stored on the first argument of the first function in ``tree``, in any of the ways Python allows.

    Covers ``self.x = ...`` (also augmented, annotated, unpacked and loop targets; ``self.__x`` under its mangled
    name, with ``private_prefix``), ``setattr(self, "x", ...)``, ``object.__setattr__(self, "x", ...)``,
    ``super().__setattr__("x", ...)``, ``self.__dict__["x"] = ...`` and ``self.__dict__.setdefault("x", ...)``.
    """
    function = next(
        (node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))),
        None,
    )
    if function is None:
        return set()
    arguments = [*function.args.posonlyargs, *function.args.args]
    if not arguments:
        return set()
    owner = arguments[0].arg
    names: set[str] = set()
    for node in ast.walk(function):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _is_name(node.value, owner):
            private = node.attr.startswith("__") and not node.attr.endswith("__")
            names.add(f"{private_prefix}{node.attr}" if private else node.attr)
        elif (
            isinstance(node, ast.Subscript)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "__dict__"
            and _is_name(node.value.value, owner)
        ):
            names.update(_literal(node.slice))
        elif isinstance(node, ast.Call) and len(node.args) >= 2:
            names.update(_name_set_by_call(node, owner))
    return names


def _name_set_by_call(call: ast.Call, owner: str) -> list[str]:
    """The literal name that ``setattr``/``__setattr__``/``__dict__.setdefault`` stores on ``owner`` in ``call``."""
    func, first, second = call.func, call.args[0], call.args[1]
    if (
        isinstance(func, ast.Attribute)
        and func.attr == "setdefault"
        and isinstance(func.value, ast.Attribute)
        and func.value.attr == "__dict__"
        and _is_name(func.value.value, owner)
    ):  # self.__dict__.setdefault("x", v)
        return _literal(first)
    if _is_name(func, "setattr") or (isinstance(func, ast.Attribute) and func.attr == "__setattr__"):
        if _is_name(first, owner):  # setattr(self, "x", v), object.__setattr__(self, "x", v)
            return _literal(second)
        bound_to_owner = isinstance(func, ast.Attribute) and (
            _is_name(func.value, owner) or (isinstance(func.value, ast.Call) and _is_name(func.value.func, "super"))
        )
        if bound_to_owner:  # super().__setattr__("x", v), self.__setattr__("x", v)
            return _literal(first)
    return []


def _literal(node: ast.AST) -> list[str]:
    return [node.value] if isinstance(node, ast.Constant) and isinstance(node.value, str) else []


def _is_name(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name
