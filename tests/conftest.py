import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Before torch is imported: on torch 2.8 and older, importing torch._inductor where triton is installed (CUDA builds)
# starts a pool of compile worker processes unless compiling stays in this process.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Nothing is downloaded at run time: Hugging Face libraries (transformers, and the torchmetrics metrics built on it)
# fail at once instead of retrying a hub they cannot reach. Read when huggingface_hub is first imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

sys.path.insert(0, os.path.dirname(__file__))
from processes import SELECTED_BLOCKS, SELECTED_LAUNCHES  # noqa: E402

import lightning_mgpu  # noqa: E402,F401  (registers the strategies)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """A run that leaves out the ``libraries`` tests does not import the library zoo, so it needs no library."""
    if collection_path.name == "test_library_zoo.py" and "not libraries" in (config.option.markexpr or ""):
        return True
    return None


def pytest_collection_finish(session: pytest.Session) -> None:
    """Record what the selected tests wait for, so that the fixtures starting it start that alone.

    ``tests/test_cli.py``'s ``launches`` starts the ``launch`` parameters of the tests that use it, together;
    ``tests/test_docs.py``'s ``jobs`` runs the ``block`` parameters of the tests that use it, a few at a time.
    """
    session.config.stash[SELECTED_LAUNCHES] = set(_parameters_of(session, "launches", "launch"))
    session.config.stash[SELECTED_BLOCKS] = list(dict.fromkeys(_parameters_of(session, "jobs", "block")))


def _parameters_of(session: pytest.Session, fixture: str, parameter: str) -> list[Any]:
    return [
        item.callspec.params[parameter]
        for item in session.items
        if fixture in getattr(item, "fixturenames", ())
        and parameter in getattr(getattr(item, "callspec", None), "params", {})
    ]


@pytest.fixture(autouse=True)
def _processes_only_in_slow_tests(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test that starts a process must be marked slow, so that ``-m "not slow"`` starts none."""
    if request.node.get_closest_marker("slow") is not None:
        return

    def refuse(self: subprocess.Popen, args: Any, *rest: Any) -> None:
        raise RuntimeError(
            f"{request.node.nodeid} starts a process ({args!r}) but is not marked slow: add @pytest.mark.slow"
        )

    # Popen.__init__ calls this to start the child and cleans up after it when it raises.
    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)


@pytest.fixture(scope="session", autouse=True)
def _nothing_written_into_the_working_directory() -> Iterator[None]:
    """Tests write into their tmp_path; a Trainer without ``default_root_dir`` would leave folders in the checkout."""
    names = ("checkpoints", "lightning_logs", "runs")
    before = {name for name in names if os.path.exists(name)}
    yield
    left = sorted(name for name in names if os.path.exists(name) and name not in before)
    assert not left, f"tests wrote {left} into {os.getcwd()}: give their Trainer default_root_dir=tmp_path"


@pytest.fixture(autouse=True)
def _quiet_lightning() -> None:
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")


@pytest.fixture(autouse=True)
def _no_process_group_left_behind() -> Iterator[None]:
    """In-process mgpu_ddp runs (devices=1) leave torch.distributed initialised; later tests must not inherit it."""
    yield
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
