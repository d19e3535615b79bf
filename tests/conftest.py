import os
import sys
import warnings

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import lightning_mgpu  # noqa: E402,F401  (registers the strategies)


@pytest.fixture(autouse=True)
def _quiet_lightning() -> None:
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
