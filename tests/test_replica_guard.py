"""What torch keeps per process, inside ``mgpu_dp``'s replica threads: parameter storage, random numbers, dtype.

A replica's step is one device's step on its chunk: a parameter every replica changes alike in place (a momentum
encoder) changes once, as on one device, and any other change of one stops the step before the module changes;
random numbers come from a generator of each replica's own, so a seeded run repeats; the precision plugin's default
dtype is set once per step, never left behind. Every comparison under ``mgpu_dp`` runs twice.
"""

from __future__ import annotations

import copy
import threading
import time
import warnings
from typing import Any

import lightning as L
import pytest
import torch
from models import assert_same_parameters, parameters, trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import MGPUDataParallel, ReplicaStateError

MOMENTUM_FORMS = ["foreach", "data", "data_in_place", "no_grad", "state_dict_copy"]


class MomentumEncoder(L.LightningModule):
    """BYOL's shape: an online network, a predictor, and a frozen target moved towards the online one in the step.

    ``form`` is how the target is updated, each as a library or a paper's code writes it.
    """

    def __init__(self, form: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.form = form
        self.online = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)).double()
        self.predictor = nn.Linear(4, 4).double()
        self.target = copy.deepcopy(self.online).requires_grad_(False)

    def update_target(self, momentum: float = 0.9) -> None:
        online, target = list(self.online.parameters()), list(self.target.parameters())
        if self.form == "foreach":  # a self-supervised library's update, under no_grad as it is there
            with torch.no_grad():
                torch._foreach_mul_(target, momentum)
                torch._foreach_add_(target, online, alpha=1 - momentum)
        elif self.form == "data":
            for t, o in zip(target, online, strict=True):
                t.data = t.data * momentum + o.data * (1 - momentum)
        elif self.form == "data_in_place":
            for t, o in zip(target, online, strict=True):
                t.data.mul_(momentum).add_(o.data, alpha=1 - momentum)
        elif self.form == "no_grad":
            with torch.no_grad():
                for t, o in zip(target, online, strict=True):
                    t.mul_(momentum).add_((1 - momentum) * o)
        else:  # timm's ModelEma: the target's state dict, written in place
            with torch.no_grad():
                online_state = self.online.state_dict()
                for name, value in self.target.state_dict().items():
                    value.copy_(value * momentum + online_state[name] * (1 - momentum))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.update_target()
        (x,) = batch
        prediction = self.predictor(self.online(x))
        with torch.no_grad():
            projection = self.target(x + 0.1)
        return (prediction - projection).pow(2).sum(1).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([*self.online.parameters(), *self.predictor.parameters()], lr=0.1)


def _rows(rows: int = 23, seed: int = 1) -> DataLoader:
    x = torch.randn(rows, 4, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return DataLoader(TensorDataset(x), batch_size=6)  # chunks of 3 + 3, 2 + 2 + 2, and a last batch of 5


def _fit(model: L.LightningModule, devices: int, **settings: Any) -> dict[str, torch.Tensor]:
    strategy = "mgpu_dp" if devices > 1 else "auto"
    trainer(strategy=strategy, devices=devices, max_epochs=2, **settings).fit(model, _rows())
    return parameters(model)


@pytest.mark.parametrize("form", MOMENTUM_FORMS)
def test_a_momentum_encoder_updated_in_the_step_moves_once_per_step_as_on_one_device(form: str) -> None:
    one_device = _fit(MomentumEncoder(form), 1)
    for devices in (2, 3):
        for _ in range(2):
            assert_same_parameters(_fit(MomentumEncoder(form), devices), one_device)


class _TimmEma(L.LightningModule):
    """timm's own model EMA, kept as a submodule and updated at the start of ``training_step``."""

    def __init__(self, version: int) -> None:
        super().__init__()
        from timm.utils import ModelEmaV2, ModelEmaV3

        torch.manual_seed(0)
        self.version = version
        self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1)).double()
        self.ema = (ModelEmaV3 if version == 3 else ModelEmaV2)(self.net, decay=0.9)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.version == 3:
            self.ema.update(self.net, step=self.global_step)
        else:
            self.ema.update(self.net)
        (x,) = batch
        return (self.net(x) - self.ema.module(x).detach()).pow(2).mean() + self.net(x).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.net.parameters(), lr=0.1)


@pytest.mark.libraries
@pytest.mark.parametrize("version", [2, 3])
def test_timms_model_ema_updated_in_the_step_equals_one_device(version: int) -> None:
    one_device = _fit(_TimmEma(version), 1)
    for devices in (2, 3):
        for _ in range(2):
            assert_same_parameters(_fit(_TimmEma(version), devices), one_device)


class _ChangesFromItsRows(L.LightningModule):
    """Changes a parameter in place by a value of the replica's own rows, which no one device's value matches."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.layer = nn.Linear(4, 1).double()
        self.center = nn.Parameter(torch.zeros(4, dtype=torch.float64), requires_grad=False)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        with torch.no_grad():
            if self.how == "rows":
                self.center.add_(x.mean(0))
            elif self.how == "one_replica":
                if self.replica_index == 0:
                    self.center.add_(1.0)
            else:  # a write through a view of the parameter
                self.center[:2].add_(1.0)
        return self.layer(x - self.center).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.layer.parameters(), lr=0.1)


@pytest.mark.parametrize(
    ("how", "fact"),
    [
        ("rows", "changed it to different values"),
        ("one_replica", "but not in replica 1"),
        ("view", "wrote to part of a parameter in place"),
    ],
)
def test_a_parameter_changed_otherwise_stops_the_first_step_with_the_module_unchanged(how: str, fact: str) -> None:
    model = _ChangesFromItsRows(how)
    before = parameters(model)
    with pytest.raises(ReplicaStateError, match=fact) as raised:
        _fit(model, 2)
    assert raised.value.step == "training_step"
    assert raised.value.path == ("self" if how == "view" else "self.center")
    assert_same_parameters(parameters(model), before, atol=0)


def test_a_trainable_parameter_changed_in_place_with_gradients_on_raises_what_torch_raises() -> None:
    class ScalesItsWeight(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 1).double()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.layer.weight.mul_(0.5)
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    for devices in (1, 2):
        with pytest.raises(RuntimeError, match="a leaf Variable that requires grad is being used in an in-place"):
            _fit(ScalesItsWeight(), devices)


class _Renormalised(L.LightningModule):
    """Keeps a trainable weight at unit norm by hand, through ``.data``, with gradients on, as older code does."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(4, 3).double()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.layer.weight.data.div_(self.layer.weight.data.norm())
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_trainable_parameter_changed_through_data_with_gradients_on_equals_one_device() -> None:
    one_device = _fit(_Renormalised(), 1)
    for devices in (2, 3):
        for _ in range(2):
            assert_same_parameters(_fit(_Renormalised(), devices), one_device)


def test_the_drop_in_wrapper_applies_a_forwards_identical_in_place_update_once() -> None:
    class CountsCalls(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.calls = nn.Parameter(torch.zeros(()), requires_grad=False)
            self.layer = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls.add_(1)
            return self.layer(x) * self.calls

    for devices in (2, 3):
        module = CountsCalls()
        wrapper = MGPUDataParallel(module, [torch.device("cpu")] * devices)
        try:
            x = torch.randn(7, 4)
            for _ in range(2):
                output = wrapper(x)
        finally:
            wrapper.close()
        assert module.calls.item() == 2.0
        torch.testing.assert_close(output, module.layer(x) * 2, atol=1e-6, rtol=0)


def test_a_compiled_module_in_the_replicas_is_not_recompiled_as_the_guard_meets_new_functions() -> None:
    """The guard's cache of functions, filled as replicas meet them, must not become a guard of a compiled graph:
    another replica's thread fills it while this one traces (seen on CUDA as a failed guard)."""
    from lightning_mgpu.replica_state import guard

    compiled = []

    def backend(graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        compiled.append(graph)
        return graph.forward

    torch._dynamo.reset()
    layer = nn.Linear(4, 2)
    wrapper = MGPUDataParallel(torch.compile(layer, backend=backend), [torch.device("cpu")] * 2)
    try:
        x = torch.randn(6, 4)
        for _ in range(2):  # the first step of a kind looks for batch-norm calls in a mode of its own: a recompile
            wrapper(x)
        graphs = len(compiled)
        guard._KINDS[object()] = guard._PLAIN  # what another replica's first use of a function does
        torch.testing.assert_close(wrapper(x), layer(x), atol=1e-6, rtol=0)
    finally:
        wrapper.close()
        torch._dynamo.reset()
    assert graphs >= 1
    assert len(compiled) == graphs


class _Noisy(L.LightningModule):
    """Dropout, noise from ``torch.randn_like`` and a random mask in the step: every kind of draw torch routes."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.3), nn.Tanh(), nn.Linear(16, 1)).double()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        x = x + 0.01 * torch.randn_like(x)
        keep = torch.rand(x.shape[0], 1, dtype=x.dtype) < 0.8
        return (self.net(x) * keep).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _seeded_fit(devices: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(7)
    model = _Noisy()
    trainer(strategy="mgpu_dp", devices=devices, max_epochs=2).fit(
        model, DataLoader(TensorDataset(torch.randn(40, 4, dtype=torch.float64)), batch_size=8, shuffle=True)
    )
    return parameters(model)


@pytest.mark.parametrize("devices", [2, 3])
def test_a_seeded_run_with_dropout_and_noise_repeats_exactly(devices: int) -> None:
    first = _seeded_fit(devices)
    for _ in range(3):
        assert_same_parameters(_seeded_fit(devices), first, atol=0)


def test_replicas_draw_different_numbers_and_the_default_generator_moves_once_per_step() -> None:
    class Draws(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.rand(x.shape[0], 3)

    wrapper = MGPUDataParallel(Draws(), [torch.device("cpu")] * 2)
    try:
        torch.manual_seed(0)
        first = wrapper(torch.zeros(4, 3))
        after_one = torch.random.get_rng_state()
        second = wrapper(torch.zeros(4, 3))
        torch.manual_seed(0)
        again = wrapper(torch.zeros(4, 3))
    finally:
        wrapper.close()
    assert not torch.equal(first[:2], first[2:])  # each replica its own numbers
    assert not torch.equal(first, second)  # and new ones each step
    torch.testing.assert_close(again, first, atol=0, rtol=0)
    torch.manual_seed(0)
    torch.empty((), dtype=torch.int64).random_()  # one draw, as each step that drew advances it
    assert torch.equal(torch.random.get_rng_state(), after_one)


def test_a_model_that_draws_nothing_leaves_the_default_generator_as_one_device_does() -> None:
    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(3, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layer(x)

    wrapper = MGPUDataParallel(Plain(), [torch.device("cpu")] * 2)
    try:
        torch.manual_seed(3)
        state = torch.random.get_rng_state()
        wrapper(torch.randn(4, 3, generator=torch.Generator()))
    finally:
        wrapper.close()
    assert torch.equal(torch.random.get_rng_state(), state)


def test_draws_from_the_shared_generator_that_cannot_be_routed_are_warned_about_once() -> None:
    class Attends(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q = x.unsqueeze(0)
            return torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.5)[0]

    wrapper = MGPUDataParallel(Attends(), [torch.device("cpu")] * 2)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                wrapper(torch.randn(4, 3))
    finally:
        wrapper.close()
    messages = [str(warning.message) for warning in caught if "default generator" in str(warning.message)]
    assert len(messages) == 1
    assert "scaled_dot_product_attention" in messages[0]


class _InsideTogether(L.LightningModule):
    """Both replicas inside the step at once, replica 1 leaving last: what a per-thread dtype context would race on."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.barrier = threading.Barrier(2, timeout=30)
        self.dtypes: list[torch.dtype] = []

    def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        self.barrier.wait()
        if self.replica_index == 1:
            time.sleep(0.01)
        return self.layer(x).pow(2).mean() + torch.zeros(()) * 0

    def on_test_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.dtypes.append(outputs.dtype)


@pytest.mark.parametrize("precision", ["64-true", "bf16-true"])
def test_a_true_precision_sets_the_default_dtype_once_per_step_and_never_leaves_it(precision: str) -> None:
    expected = torch.float64 if precision == "64-true" else torch.bfloat16
    for _ in range(2):
        model = _InsideTogether()
        data = DataLoader(TensorDataset(torch.randn(24, 4)), batch_size=4)
        trainer(strategy="mgpu_dp", devices=2, precision=precision).test(model, data, verbose=False)
        assert torch.get_default_dtype() == torch.float32
        assert model.dtypes == [expected] * 6


@pytest.mark.parametrize("func", [torch.rand_like, torch.randn_like])
def test_like_functions_draw_from_the_replicas_generator_where_torch_gives_them_none(
    func: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_mgpu.replica_state import random

    monkeypatch.setitem(random._ACCEPTS, func, False)  # as torch releases before their generator= argument
    like = torch.zeros(4, 3, dtype=torch.float64)
    state = torch.random.get_rng_state()
    draws = [random.ReplicaRandom(index, random.StepSeed(state), {}).call(func, (like,), {}) for index in (0, 0, 1)]
    assert draws[0].dtype == torch.float64
    assert draws[0].shape == (4, 3)
    torch.testing.assert_close(draws[0], draws[1], atol=0, rtol=0)  # the same replica and step: the same numbers
    assert not torch.equal(draws[0], draws[2])  # another replica: its own
    assert torch.equal(torch.random.get_rng_state(), state)  # the default generator untouched


class _Buffered(L.LightningModule):
    """Buffers a step changes: a step counter (in place), a reassigned total, and optionally a mean of its own rows."""

    def __init__(self, chunk_mean: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.chunk_mean = chunk_mean
        self.layer = nn.Linear(4, 1).double()
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("total", torch.zeros((), dtype=torch.float64))
        self.register_buffer("input_mean", torch.zeros(4, dtype=torch.float64))
        self.register_buffer("checked", torch.zeros((), dtype=torch.long))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        self.steps.add_(1)
        self.total = self.total + 0.5
        if self.chunk_mean:
            self.input_mean.lerp_(x.mean(0), 0.1)
        return self.layer(x).pow(2).mean()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.checked.add_(1)  # in inference mode, where copies of buffers keep no version counter

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _buffered_fit(model: _Buffered, devices: int) -> _Buffered:
    data = DataLoader(TensorDataset(torch.randn(24, 4, dtype=torch.float64)), batch_size=6)
    trainer(strategy="mgpu_dp" if devices > 1 else "auto", devices=devices, max_epochs=2).fit(model, data, data)
    return model


def test_buffers_every_replica_changes_alike_change_once_in_training_and_in_validation() -> None:
    one_device = _buffered_fit(_Buffered(), 1)
    for devices in (2, 3):
        for _ in range(2):
            model = _buffered_fit(_Buffered(), devices)
            for name in ("steps", "total", "checked", "input_mean"):
                torch.testing.assert_close(getattr(model, name), getattr(one_device, name), atol=0, rtol=0)
            assert_same_parameters(parameters(model), parameters(one_device))
    assert one_device.steps.item() == 8
    assert one_device.checked.item() == 8


def test_a_buffer_updated_from_each_replicas_rows_stops_the_first_step_with_the_module_unchanged() -> None:
    for devices in (2, 3):
        for _ in range(2):
            model = _Buffered(chunk_mean=True)
            before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
            with pytest.raises(ReplicaStateError, match=r"(?s)changed the buffer self\.input_mean inside the replicas"):
                _buffered_fit(model, devices)
            for name, tensor in model.state_dict().items():
                assert torch.equal(tensor, before[name]), name


def test_the_drop_in_wrapper_refuses_a_buffer_its_replicas_leave_apart_and_keeps_the_module() -> None:
    class RunningMean(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("mean", torch.zeros(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.mean.copy_(x.mean(0))
            return x

    module = RunningMean()
    wrapper = MGPUDataParallel(module, [torch.device("cpu")] * 2)
    try:
        with pytest.raises(ReplicaStateError) as caught:
            wrapper(torch.arange(12.0).reshape(4, 3))
        assert caught.value.path == "self.mean"
        assert caught.value.buffer
        assert "replicas 0 and 1 left it at different values (by up to 6)" in str(caught.value)
        assert torch.equal(module.mean, torch.zeros(3))
        wrapper(torch.ones(4, 3))  # the same value in every replica: once, as on one device
        assert torch.equal(module.mean, torch.ones(3))
    finally:
        wrapper.close()


_PROCESS_SETTINGS = {
    "torch.set_default_dtype": (
        lambda: torch.set_default_dtype(torch.float64),
        torch.get_default_dtype,
        torch.set_default_dtype,
    ),
    "torch.use_deterministic_algorithms": (
        lambda: torch.use_deterministic_algorithms(True, warn_only=True),
        lambda: (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()),
        lambda value: torch.use_deterministic_algorithms(value[0], warn_only=value[1]),
    ),
    "torch.autograd.set_detect_anomaly": (
        lambda: torch.autograd.set_detect_anomaly(True),
        lambda: (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
        lambda value: torch.autograd.set_detect_anomaly(value[0], check_nan=value[1]),
    ),
    "torch.set_float32_matmul_precision": (
        lambda: torch.set_float32_matmul_precision("high"),
        torch.get_float32_matmul_precision,
        torch.set_float32_matmul_precision,
    ),
    "torch.backends.cudnn": (
        lambda: setattr(torch.backends.cudnn, "benchmark", True),
        lambda: (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic),
        lambda value: setattr(torch.backends.cudnn, "benchmark", value[0]),
    ),
}


class _SetsASetting(L.LightningModule):
    """Changes a process-wide torch setting in ``training_step``, or in ``on_train_batch_start`` (``in_hook``)."""

    def __init__(self, change: Any, in_hook: bool = False) -> None:
        super().__init__()
        self.change = change
        self.in_hook = in_hook
        self.layer = nn.Linear(4, 1).double()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.in_hook:
            self.change()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if not self.in_hook:
            self.change()
        (x,) = batch
        return self.layer(x).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("setting", list(_PROCESS_SETTINGS))
def test_a_process_wide_torch_setting_changed_inside_the_replicas_stops_the_first_step_and_is_put_back(
    setting: str,
) -> None:
    change, read, write = _PROCESS_SETTINGS[setting]
    before = read()
    try:
        for devices in (2, 3):
            for _ in range(2):
                model = _SetsASetting(change)
                start = parameters(model)
                with pytest.raises(ReplicaStateError, match="one setting for the whole process") as raised:
                    _fit(model, devices)
                assert raised.value.path == setting
                assert raised.value.step == "training_step"
                assert f"It is back at {before}" in str(raised.value)
                assert read() == before
                assert_same_parameters(parameters(model), start, atol=0)
        # On one device torch accepts it: the same model trains.
        model = _SetsASetting(change)
        start = parameters(model)
        _fit(model, 1)
        assert not torch.equal(parameters(model)["layer.weight"], start["layer.weight"])
    finally:
        write(before)


def test_a_process_wide_setting_changed_in_a_hook_outside_the_replicas_trains_as_on_one_device() -> None:
    def change() -> None:
        torch.set_float32_matmul_precision("high")

    before = torch.get_float32_matmul_precision()
    try:
        torch.manual_seed(3)
        one_device = _fit(_SetsASetting(change, in_hook=True), 1)
        for devices in (2, 3):
            for _ in range(2):
                torch.set_float32_matmul_precision(before)
                torch.manual_seed(3)
                assert_same_parameters(_fit(_SetsASetting(change, in_hook=True), devices), one_device)
                assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before)


class _CatchesWarnings(L.LightningModule):
    """Each replica enters ``warnings.catch_warnings`` and replica 0 leaves first: the blocks interleave."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1).double()
        self.entered = threading.Barrier(2, timeout=30)
        self.left = threading.Barrier(2, timeout=30)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("ignore")
            if self.replica_index == 0:
                self.entered.wait()  # replica 1 enters after replica 0 ...
            else:
                self.entered.wait()
                time.sleep(0.01)
                self.left.wait()  # ... and leaves after it, putting back replica 0's filters
                return self.layer(x).pow(2).mean()
        self.left.wait()
        return self.layer(x).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_warning_filters_that_interleaved_catch_warnings_blocks_leave_behind_are_put_back() -> None:
    filters, show = list(warnings.filters), warnings.showwarning
    for _ in range(2):
        found = warnings.filters
        _fit(_CatchesWarnings(), 2)
        assert warnings.filters is found
        assert warnings.filters == filters
        assert warnings.showwarning is show
