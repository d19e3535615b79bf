import os
import sys
import warnings
from collections.abc import Iterator

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import lightning_mgpu  # noqa: E402,F401  (registers the strategies)


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
