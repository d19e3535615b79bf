"""BatchNorm under mgpu_dp normalises every chunk by the whole batch's statistics, so it trains as on one device."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from models import Regressor, assert_same_parameters, loader, parameters, regression_data, trainer
from torch import nn

from lightning_mgpu import MGPUDataParallel, MGPUDPStrategy


@pytest.fixture
def float64() -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


class _Twice(nn.Module):
    """One BatchNorm layer called twice in a forward."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.linear(self.bn(x)))


LAYERS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "bn1d": (lambda: nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 2)), (7, 4)),
    "bn1d-sequence": (lambda: nn.Sequential(nn.Conv1d(3, 4, 2), nn.BatchNorm1d(4), nn.Flatten()), (7, 3, 5)),
    "bn2d-cumulative": (
        lambda: nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3, momentum=None), nn.ReLU(), nn.Flatten()),
        (5, 2, 6, 6),
    ),
    "bn3d": (lambda: nn.Sequential(nn.BatchNorm3d(2), nn.Flatten()), (5, 2, 2, 2, 2)),
    "no-affine-no-running-stats": (
        lambda: nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6, affine=False, track_running_stats=False), nn.Tanh()),
        (7, 4),
    ),
    "called-twice": (_Twice, (7, 4)),
    "sync-batchnorm-class": (lambda: nn.Sequential(nn.Linear(4, 3), nn.SyncBatchNorm(3)), (7, 4)),
}


@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize("devices", [2, 3])
@pytest.mark.parametrize("name", list(LAYERS))
def test_outputs_gradients_and_running_statistics_equal_one_device(name: str, devices: int) -> None:
    make, shape = LAYERS[name]
    torch.manual_seed(0)
    x = torch.randn(*shape) * 3 + 1
    torch.manual_seed(1)
    single = make()
    torch.manual_seed(1)
    parallel = make()
    expected = single(x)
    expected.pow(3).sum().backward()
    wrapper = MGPUDataParallel(parallel, [torch.device("cpu")] * devices)
    try:
        output = wrapper(x)
        output.pow(3).sum().backward()
    finally:
        wrapper.close()
    torch.testing.assert_close(output, expected, atol=1e-12, rtol=0)
    for (key, ours), theirs in zip(single.named_parameters(), parallel.parameters(), strict=True):
        torch.testing.assert_close(theirs.grad, ours.grad, atol=1e-10, rtol=1e-10, msg=f"gradient of {key}")
    for (key, ours), theirs in zip(single.named_buffers(), parallel.buffers(), strict=True):
        torch.testing.assert_close(theirs, ours, atol=1e-12, rtol=0, msg=f"buffer {key}")


@pytest.mark.usefixtures("float64")
def test_without_the_exchange_each_chunk_is_normalised_on_its_own() -> None:
    torch.manual_seed(0)
    model = nn.BatchNorm1d(3)
    x = torch.randn(6, 3) * 2
    wrapper = MGPUDataParallel(model, [torch.device("cpu")] * 2, sync_batchnorm=False)
    try:
        output = wrapper(x)
    finally:
        wrapper.close()
    torch.testing.assert_close(output[:3], nn.functional.batch_norm(x[:3], None, None, training=True))
    assert (output - nn.BatchNorm1d(3)(x)).abs().max() > 0.1


def test_a_layer_skipped_by_one_replica_is_an_error_not_a_hang() -> None:
    class Conditional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm1d(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.bn(x) if x.shape[0] > 2 else x

    wrapper = MGPUDataParallel(Conditional(), [torch.device("cpu")] * 2)
    try:
        with pytest.raises(RuntimeError, match=r"BatchNorm layer `bn` \(call 1\) ran in replica 0 but replica\(s\) 1"):
            wrapper(torch.randn(5, 4))
    finally:
        wrapper.close()


def test_the_error_of_the_failing_replica_is_reported_and_nobody_waits() -> None:
    class Failing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm1d(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] == 2:
                raise ValueError("bad chunk")
            return self.bn(x)

    wrapper = MGPUDataParallel(Failing(), [torch.device("cpu")] * 2)
    try:
        with pytest.raises(ValueError, match="bad chunk") as caught:
            wrapper(torch.randn(5, 4))
    finally:
        wrapper.close()
    assert "raised in replica 1 of 2" in " ".join(caught.value.__notes__)


class _Normalised(Regressor):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))


def _fit(model: nn.Module, **overrides: Any) -> None:
    trainer(max_steps=4, max_epochs=2, **overrides).fit(model, loader(regression_data(), 7))


@pytest.mark.parametrize("devices", [2, 3])
def test_training_with_batchnorm_equals_one_device(devices: int) -> None:
    single, parallel = _Normalised(), _Normalised()
    _fit(single)
    _fit(parallel, devices=devices, strategy="mgpu_dp")
    assert_same_parameters(parameters(single), parameters(parallel))
    assert parallel.net[1].num_batches_tracked.item() == 4


def test_switching_the_exchange_off_warns_and_differs() -> None:
    single, parallel = _Normalised(), _Normalised()
    _fit(single)
    expected = r"BatchNorm layers \(net\.1\) normalise each replica's chunk.*This is sync_batchnorm=False"
    with pytest.warns(UserWarning, match=expected):
        _fit(parallel, devices=2, strategy=MGPUDPStrategy(sync_batchnorm=False))
    difference = (parameters(single)["net.1.running_mean"] - parameters(parallel)["net.1.running_mean"]).abs()
    assert difference.max() > 1e-4


def test_ddp_names_batchnorm_layers_that_train_on_the_rank_batch_only() -> None:
    from lightning_mgpu.step.health import StepHealth

    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.BatchNorm1d(4).eval(), nn.SyncBatchNorm(4))
    with pytest.warns(UserWarning, match=r"mgpu_ddp: the BatchNorm layers \(1\) normalise each rank's batch.*sync_bat"):
        StepHealth("mgpu_ddp").check_batchnorm(model, "each rank's batch", "Pass Trainer(sync_batchnorm=True).")
