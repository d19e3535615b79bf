"""Run code right after a module is imported, without importing it: how ``pytorch_lightning`` is bound lazily.

Importing ``pytorch_lightning`` rebinds the rank-zero logger it shares with ``lightning.pytorch``, so the package never
imports it. ``when_imported`` runs a callback at once where the module is imported already, else from a finder on
``sys.meta_path`` that wraps the module's loader: the callback runs after the module's code, before the ``import``
statement returns, and the finder removes itself once nothing waits. Every other import, reloads and namespace
packages included, goes past it untouched.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import FunctionType, ModuleType
from typing import Any

Callback = Callable[[ModuleType], None]

_WAITING: dict[str, dict[object, Callback]] = {}
"""The callbacks for each module not imported yet; a function's key is its qualified name."""
_LOCK = threading.RLock()


def when_imported(name: str, callback: Callback) -> None:
    """Call ``callback`` with the module ``name`` now if it is imported, else right after its code has run.

    Registering a callback again replaces it instead of running it twice; a function counts as registered again when
    one of the same qualified name is (the module that registers it was reloaded).
    """
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return
    with _LOCK:
        key = f"{callback.__module__}.{callback.__qualname__}" if isinstance(callback, FunctionType) else callback
        _WAITING.setdefault(name, {})[key] = callback
        if not any(_is_ours(finder) for finder in sys.meta_path):
            sys.meta_path.insert(0, _PostImportFinder())


def _imported(module: ModuleType) -> None:
    with _LOCK:
        callbacks = _WAITING.pop(module.__name__, {})
        if not _WAITING:
            sys.meta_path[:] = [finder for finder in sys.meta_path if not _is_ours(finder)]
    for callback in callbacks.values():
        callback(module)


def _is_ours(finder: object) -> bool:
    """Whether ``finder`` is this module's finder, also one made before this module was reloaded."""
    return type(finder).__module__ == __name__ and type(finder).__qualname__ == _PostImportFinder.__qualname__


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: hands a waited-for module's spec, found by the finders after it, a calling-back loader."""

    def __init__(self) -> None:
        self._searching = threading.local()

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        """The spec the other finders give ``fullname``, its loader wrapped, when a callback waits for it."""
        if fullname not in _WAITING or getattr(self._searching, "name", None) == fullname:
            return None
        self._searching.name = fullname  # another finder that searches sys.meta_path again gets past this one
        try:
            spec = self._spec_from_the_others(fullname, path, target)
        finally:
            self._searching.name = None
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _CallingBackLoader(spec.loader)
        return spec

    def _spec_from_the_others(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None
    ) -> ModuleSpec | None:
        for finder in list(sys.meta_path):
            find_spec = getattr(finder, "find_spec", None)
            if finder is self or _is_ours(finder) or find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                return spec
        return None


class _CallingBackLoader(importlib.abc.Loader):
    """The module's own loader, which runs the module's code; then the callbacks, with its own loader put back."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        """Whatever the module's own loader creates."""
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        """Run the module's code, put its own loader back where the import recorded this one, then the callbacks."""
        try:
            self._loader.exec_module(module)
        finally:
            if getattr(module, "__loader__", None) is self:
                module.__loader__ = self._loader
            spec = getattr(module, "__spec__", None)
            if spec is not None and spec.loader is self:
                spec.loader = self._loader
        _imported(module)

    def __getattr__(self, name: str) -> Any:
        loader = self.__dict__.get("_loader")  # absent while a copy is being built
        if loader is None:
            raise AttributeError(name)
        return getattr(loader, name)
