"""``when_imported``: a callback right after a module's code has run, and nothing else changed about importing."""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from lightning_mgpu import import_hook
from lightning_mgpu.import_hook import when_imported

NAMES = ("hooked", "hooked_namespace", "hooked_broken")


@pytest.fixture
def packages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A folder on ``sys.path`` for the test's modules; none of them, nor a callback for them, is left behind."""
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in list(sys.modules):
        if name.split(".")[0] in NAMES:
            del sys.modules[name]
    for name in NAMES:
        import_hook._WAITING.pop(name, None)
    if not import_hook._WAITING:
        sys.meta_path[:] = [finder for finder in sys.meta_path if not import_hook._is_ours(finder)]


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def __call__(self, module: ModuleType) -> None:
        self.calls.append((module.__name__, getattr(module, "VALUE", None)))


def _ours() -> list[object]:
    return [finder for finder in sys.meta_path if import_hook._is_ours(finder)]


def test_a_callback_runs_after_the_module_s_code_and_the_finder_leaves(packages: Path) -> None:
    (packages / "hooked").mkdir()
    (packages / "hooked" / "__init__.py").write_text("VALUE = 1\n")
    (packages / "hooked" / "sub.py").write_text("VALUE = 2\n")
    recorder = Recorder()
    when_imported("hooked", recorder)
    assert len(_ours()) == 1
    assert recorder.calls == []
    hooked = importlib.import_module("hooked")
    assert recorder.calls == [("hooked", 1)]
    assert _ours() == []
    assert isinstance(hooked.__loader__, importlib.machinery.SourceFileLoader)
    assert hooked.__spec__.loader is hooked.__loader__
    assert importlib.import_module("hooked.sub").VALUE == 2
    (packages / "hooked" / "__init__.py").write_text("VALUE = 3\n")
    importlib.invalidate_caches()
    assert importlib.reload(hooked).VALUE == 3
    assert recorder.calls == [("hooked", 1)]


def test_a_module_imported_already_gets_the_callback_at_once_and_no_finder(packages: Path) -> None:
    recorder = Recorder()
    when_imported("json", recorder)
    assert recorder.calls == [("json", None)]
    assert _ours() == []


def test_registering_a_callback_again_runs_it_once(packages: Path) -> None:
    (packages / "hooked.py").write_text("VALUE = 1\n")
    recorder = Recorder()
    when_imported("hooked", recorder.__call__)
    when_imported("hooked", recorder.__call__)
    assert len(_ours()) == 1
    importlib.import_module("hooked")
    assert recorder.calls == [("hooked", 1)]


def test_a_module_that_fails_to_import_keeps_its_callback_for_the_next_try(packages: Path) -> None:
    (packages / "hooked_broken.py").write_text("raise ImportError('not yet')\n")
    recorder = Recorder()
    when_imported("hooked_broken", recorder)
    with pytest.raises(ImportError, match="not yet"):
        importlib.import_module("hooked_broken")
    assert recorder.calls == []
    assert len(_ours()) == 1
    (packages / "hooked_broken.py").write_text("VALUE = 4\n")
    importlib.invalidate_caches()
    importlib.import_module("hooked_broken")
    assert recorder.calls == [("hooked_broken", 4)]
    assert _ours() == []


def test_other_imports_and_namespace_packages_go_past_the_finder(packages: Path) -> None:
    (packages / "hooked_namespace" / "part").mkdir(parents=True)
    (packages / "hooked_namespace" / "part" / "__init__.py").write_text("VALUE = 5\n")
    when_imported("hooked", Recorder())
    part = importlib.import_module("hooked_namespace.part")
    assert part.VALUE == 5
    assert sys.modules["hooked_namespace"].__spec__.origin is None
    assert isinstance(part.__loader__, importlib.machinery.SourceFileLoader)
    assert len(_ours()) == 1  # still waiting for its own module
