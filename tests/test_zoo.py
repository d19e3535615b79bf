"""Stock torch modules and training patterns must train under mgpu_dp and mgpu_ddp exactly as on one device."""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import pytest
from processes import run_zoo_job, zoo_result
from zoo import (
    DDP_BATCH,
    DDP_WORLD_SIZE,
    DDP_ZOO,
    DP_BATCH,
    ZOO,
    Outcome,
    assert_close_tensors,
    assert_same_training,
    assert_structure_kept,
    assert_trained,
    train,
)

LAUNCH_TIMEOUT = 240

DP_ENTRIES = [pytest.param(name, id=name) for name in ZOO]
DDP_ENTRIES = [pytest.param(name, id=name) for name in DDP_ZOO]


@functools.cache
def _one_device(name: str, batch_size: int) -> Outcome:
    """Lightning's default strategy on one device; the same run for every test that compares with it."""
    outcome = train(ZOO[name], batch_size)
    assert_trained(outcome, ZOO[name])
    return outcome


@pytest.mark.parametrize("devices", [2, 3], ids=["dp2-3+2", "dp3-2+2+1"])
@pytest.mark.parametrize("name", DP_ENTRIES)
def test_mgpu_dp_trains_like_one_device(name: str, devices: int) -> None:
    expected = _one_device(name, DP_BATCH)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = train(ZOO[name], DP_BATCH, devices=devices, strategy="mgpu_dp")
    assert_same_training(got, expected)
    ours = [str(warning.message) for warning in caught if str(warning.message).startswith("mgpu_dp")]
    assert not ours, f"a stock model trained exactly, yet mgpu_dp warned: {ours}"


@pytest.mark.parametrize("name", DP_ENTRIES)
def test_mgpu_dp_fit_leaves_the_model_structure_as_it_was(name: str) -> None:
    assert_structure_kept(train(ZOO[name], DP_BATCH, devices=3, strategy="mgpu_dp"))


@pytest.fixture(scope="module")
def ddp_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """Every DDP entry trained, one after another, in one two-process mgpu_ddp job; its output folder and stderr."""
    out = tmp_path_factory.mktemp("zoo_ddp")
    return out, run_zoo_job("zoo", out, DDP_ZOO, LAUNCH_TIMEOUT)


def _ddp_outcome(out: Path, name: str, rank: int, stderr: str) -> Outcome:
    return Outcome(**zoo_result(out, name, rank, stderr))


@pytest.mark.slow
@pytest.mark.parametrize("name", DDP_ENTRIES)
def test_mgpu_ddp_trains_like_one_device_on_the_global_batch(name: str, ddp_job: tuple[Path, str]) -> None:
    out, stderr = ddp_job
    ranks = [_ddp_outcome(out, name, rank, stderr) for rank in range(DDP_WORLD_SIZE)]
    assert_close_tensors(ranks[1].state, ranks[0].state, "rank 1 against rank 0:")
    assert_same_training(ranks[0], _one_device(name, DDP_BATCH * DDP_WORLD_SIZE))


@pytest.mark.slow
@pytest.mark.parametrize("name", DDP_ENTRIES)
def test_mgpu_ddp_fit_leaves_the_model_structure_as_it_was(name: str, ddp_job: tuple[Path, str]) -> None:
    out, stderr = ddp_job
    for rank in range(DDP_WORLD_SIZE):
        assert_structure_kept(_ddp_outcome(out, name, rank, stderr))
