# The part of Lightning-AI/pytorch-lightning tests/tests_pytorch/helpers/runif.py (tag 2.6.5) that the copied tests use.
# Copyright The Lightning AI team. Licensed under the Apache License, Version 2.0
# Changed: nothing but this header and the module's name.
import pytest
from lightning.fabric.utilities.imports import _IS_WINDOWS
from lightning.pytorch.utilities.imports import _TORCH_GREATER_EQUAL_2_8
from lightning.pytorch.utilities.testing import _runif_reasons


def RunIf(**kwargs):  # noqa: N802
    reasons, marker_kwargs = _runif_reasons(**kwargs)
    return pytest.mark.skipif(condition=len(reasons) > 0, reason=f"Requires: [{' + '.join(reasons)}]", **marker_kwargs)


_xfail_gloo_windows = pytest.mark.xfail(
    RuntimeError,
    strict=True,
    condition=(_IS_WINDOWS and _TORCH_GREATER_EQUAL_2_8),
    reason="makeDeviceForHostname(): unsupported gloo device",
)
