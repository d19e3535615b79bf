"""BatchNorm under mgpu_dp normalises every chunk by the whole batch's statistics, so it trains as on one device."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from models import Regressor, assert_same_parameters, loader, parameters, regression_data, trainer
from torch import nn

from lightning_mgpu import MGPUDataParallel, MGPUDPStrategy, _compat
from lightning_mgpu.errors import ConfigurationError


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


class _BNReLU(nn.BatchNorm1d):
    """A BatchNorm subclass whose forward does more than normalise, as timm's BatchNormAct2d does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(super().forward(x)) * 2 - 0.5


class _FunctionalNorm(nn.Module):
    """No BatchNorm layer: the module's own code normalises by batch statistics, keeping its own running mean."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, features))
        self.register_buffer("mean", torch.zeros(features))
        self.register_buffer("var", torch.ones(features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normalised = nn.functional.batch_norm(x, self.mean, self.var, self.gain, None, training=True, momentum=0.3)
        return torch.batch_norm(normalised.tanh(), None, None, None, None, True, 0.0, 1e-3, False)


def _with_running_statistics(layer: nn.BatchNorm1d) -> nn.BatchNorm1d:
    with torch.no_grad():
        layer.running_mean.uniform_(-1, 1)
        layer.running_var.uniform_(0.5, 2)
    return layer


LAYERS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "subclass-with-its-own-forward": (lambda: nn.Sequential(nn.Linear(4, 6), _BNReLU(6), nn.Linear(6, 2)), (7, 4)),
    "functional-calls-in-own-code": (lambda: nn.Sequential(nn.Linear(4, 5), _FunctionalNorm(5)), (7, 4)),
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
    "eval-without-running-stats": (
        lambda: nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6, track_running_stats=False)).eval(),
        (7, 4),
    ),
    "eval-with-running-stats": (lambda: _with_running_statistics(nn.BatchNorm1d(4)).eval(), (7, 4)),
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
def test_every_call_of_a_module_whose_own_code_normalises_equals_one_device() -> None:
    torch.manual_seed(1)
    single = nn.Sequential(nn.Linear(4, 5), _FunctionalNorm(5))
    parallel = copy.deepcopy(single)
    wrapper = MGPUDataParallel(parallel, [torch.device("cpu")] * 2)
    try:
        for rows in (7, 5, 6):
            x = torch.randn(rows, 4)
            torch.testing.assert_close(wrapper(x), single(x), atol=1e-12, rtol=0)
    finally:
        wrapper.close()
    torch.testing.assert_close(parallel[1].mean, single[1].mean, atol=1e-12, rtol=0)


def test_a_module_that_never_normalises_runs_later_calls_without_watching_torch_functions() -> None:
    depths: list[int | None] = []

    class Watched(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            depths.append(_compat.function_mode_depth())
            return super().forward(x)

    wrapper = MGPUDataParallel(Watched(4, 2), [torch.device("cpu")] * 2)
    try:
        for _ in range(3):
            wrapper(torch.randn(6, 4))
    finally:
        wrapper.close()
    # The first call of each replica watches for batch-norm calls (one mode more); every call runs in its guard.
    assert depths == [2, 2, 1, 1, 1, 1]


@pytest.mark.usefixtures("float64")
def test_a_compiled_batchnorm_subclass_equals_one_device() -> None:
    torch.manual_seed(1)
    single = nn.Sequential(nn.Linear(4, 6), _BNReLU(6), nn.Linear(6, 2))
    parallel = copy.deepcopy(single)
    parallel[1].compile(backend="eager")
    x = torch.randn(7, 4)
    expected = single(x)
    expected.pow(2).sum().backward()
    wrapper = MGPUDataParallel(parallel, [torch.device("cpu")] * 2)
    try:
        output = wrapper(x)
        output.pow(2).sum().backward()
    finally:
        wrapper.close()
    torch.testing.assert_close(output, expected, atol=1e-12, rtol=0)
    for (key, ours), theirs in zip(single.named_parameters(), parallel.parameters(), strict=True):
        torch.testing.assert_close(theirs.grad, ours.grad, atol=1e-10, rtol=1e-10, msg=f"gradient of {key}")


@pytest.mark.parametrize("in_place", [True, False], ids=["module.compile", "torch.compile"])
def test_batchnorm_compiled_with_fullgraph_is_refused_before_any_replica_runs(in_place: bool) -> None:
    block = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6))
    if in_place:
        block.compile(fullgraph=True, backend="eager")
        model = nn.Sequential(block, nn.Linear(6, 1))
        refused = "`0.1`"
    else:
        model = nn.Sequential(torch.compile(block, fullgraph=True, backend="eager"), nn.Linear(6, 1))
        refused = "`0._orig_mod.1`"
    with pytest.raises(ConfigurationError) as caught:
        MGPUDataParallel(model, [torch.device("cpu")] * 2)
    assert refused in str(caught.value)
    if in_place:
        assert "inside a module compiled with fullgraph=True" in str(caught.value)
    MGPUDataParallel(model, [torch.device("cpu")] * 2, sync_batchnorm=False).close()
    MGPUDataParallel(model, [torch.device("cpu")]).close()


def test_fit_with_batchnorm_compiled_with_fullgraph_stops_before_the_first_step() -> None:
    model = _Normalised()
    model.net[1].compile(fullgraph=True, backend="eager")
    before = {name: value.clone() for name, value in parameters(model).items()}
    with pytest.raises(ConfigurationError) as caught:
        _fit(model, devices=2, strategy="mgpu_dp")
    assert caught.value.setting == "torch.compile.fullgraph"
    assert_same_parameters(before, parameters(model))


@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize("devices", [2, 3])
def test_a_gradient_penalty_through_batchnorm_equals_one_device(devices: int) -> None:
    """Second derivatives flow through the whole batch's statistics as through one device's (WGAN-GP, R1)."""
    torch.manual_seed(2)
    single = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 1))
    parallel = copy.deepcopy(single)
    x = torch.randn(7, 4) * 2 + 1

    def penalised(model: nn.Module) -> torch.Tensor:
        inputs = x.clone().requires_grad_(True)
        output = model(inputs)
        (slope,) = torch.autograd.grad(output.sum(), inputs, create_graph=True)
        return output.pow(2).mean() + slope.pow(2).sum(1).sub(1).pow(2).mean()

    penalised(single).backward()
    wrapper = MGPUDataParallel(parallel, [torch.device("cpu")] * devices)
    try:
        penalised(wrapper).backward()
    finally:
        wrapper.close()
    for (key, ours), theirs in zip(single.named_parameters(), parallel.parameters(), strict=True):
        torch.testing.assert_close(theirs.grad, ours.grad, atol=1e-10, rtol=1e-10, msg=f"gradient of {key}")


class _Late(nn.Module):
    """Holds back the chunk of ``rows`` rows, so that its replica is the last to reach the next batch-norm call."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.rows = rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == self.rows:
            time.sleep(0.02)
        return x


@pytest.mark.usefixtures("float64")
def test_the_result_does_not_depend_on_which_replica_reaches_the_exchange_last() -> None:
    torch.manual_seed(3)
    reference = nn.Sequential(nn.Linear(4, 6), _Late(0), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 1))
    x = torch.randn(7, 4) * 2 + 1
    results = []
    for late_rows in (0, 4, 3):  # nobody held back (one device), then replica 0, then replica 1 last
        model = copy.deepcopy(reference)
        model[1].rows = late_rows
        wrapper = MGPUDataParallel(model, [torch.device("cpu")] * (1 if late_rows == 0 else 2))
        try:
            output = wrapper(x)
            output.pow(2).sum().backward()
        finally:
            wrapper.close()
        results.append((output.detach(), [p.grad for p in model.parameters()], list(model.buffers())))
    (one_device, *held_back) = results
    first, second = held_back
    assert torch.equal(first[0], second[0])
    assert all(torch.equal(a, b) for a, b in zip(first[1] + first[2], second[1] + second[2], strict=True))
    torch.testing.assert_close(first[0], one_device[0], atol=1e-12, rtol=0)
    for ours, theirs in zip(first[1] + first[2], one_device[1] + one_device[2], strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-10, rtol=1e-10)


def test_half_precision_inputs_keep_their_dtype_and_match_one_device() -> None:
    torch.manual_seed(0)
    layer = nn.BatchNorm1d(3).to(torch.bfloat16)
    x = (torch.randn(8, 3) * 2 + 1).to(torch.bfloat16)
    expected = copy.deepcopy(layer)(x)
    wrapper = MGPUDataParallel(layer, [torch.device("cpu")] * 2)
    try:
        output = wrapper(x)
    finally:
        wrapper.close()
    assert output.dtype == torch.bfloat16
    torch.testing.assert_close(output, expected, atol=2e-2, rtol=2e-2)


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
    first_chunk = nn.BatchNorm1d(3)  # torch.nn.DataParallel keeps replica 0's running statistics: so does this
    first_chunk(x[:3])
    torch.testing.assert_close(model.running_mean, first_chunk.running_mean, atol=0, rtol=0)
    torch.testing.assert_close(model.running_var, first_chunk.running_var, atol=0, rtol=0)
    assert model.num_batches_tracked.item() == 1


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
    def __init__(self, layer: type[nn.BatchNorm1d] = nn.BatchNorm1d) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.net = nn.Sequential(nn.Linear(4, 8), layer(8), nn.Tanh(), nn.Linear(8, 1))


def _fit(model: nn.Module, **overrides: Any) -> None:
    trainer(max_steps=4, max_epochs=2, **overrides).fit(model, loader(regression_data(), 7))


@pytest.mark.parametrize("layer", [nn.BatchNorm1d, _BNReLU], ids=["BatchNorm1d", "subclass"])
@pytest.mark.parametrize("devices", [2, 3])
def test_training_with_batchnorm_equals_one_device(devices: int, layer: type[nn.BatchNorm1d]) -> None:
    single, parallel = _Normalised(layer), _Normalised(layer)
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
    from lightning_mgpu.sync_batchnorm import MGPUSyncBatchNorm

    model = nn.Sequential(
        nn.Linear(4, 4), nn.BatchNorm1d(4), nn.BatchNorm1d(4).eval(), nn.SyncBatchNorm(4), MGPUSyncBatchNorm(4)
    )
    with pytest.warns(UserWarning, match=r"mgpu_ddp: the BatchNorm layers \(1\) normalise each rank's batch.*sync_bat"):
        StepHealth("mgpu_ddp").check_batchnorm(model, "each rank's batch", "Pass Trainer(sync_batchnorm=True).")
