"""``MGPUDataParallel`` as a drop-in for ``torch.nn.DataParallel``.

The cases follow torch's own DataParallel suite (``test/distributed/test_data_parallel.py``), rewritten for virtual
replicas on the CPU and compared with the module run on one device. Where the split-and-gather contract differs from
torch's on purpose (uneven chunk sizes, per-sample lists, lists that read two ways), the test states ours.
"""

from __future__ import annotations

import copy
import functools
import gc
import io
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from models import Regressor
from torch import nn

from lightning_mgpu import BatchSplitError, Fields, GatherError, MGPUDataParallel
from lightning_mgpu.engine import ParallelApply, Scattered, gather, replicate, scatter
from lightning_mgpu.errors import ConfigurationError
from lightning_mgpu.step.replicas import run_replica_step

CPU = torch.device("cpu")
CPU2 = [CPU] * 2
CPU3 = [CPU] * 3
EXACT = {"atol": 1e-6, "rtol": 0.0}

gradcheck = functools.partial(torch.autograd.gradcheck, check_batched_grad=False)
gradgradcheck = functools.partial(torch.autograd.gradgradcheck, check_batched_grad=False)

replica_counts = pytest.mark.parametrize("replicas", [2, 3])


@pytest.fixture
def wrap() -> Iterator[Callable[..., MGPUDataParallel]]:
    """Build wrappers whose replica threads are stopped when the test ends."""
    made: list[MGPUDataParallel] = []

    def make(module: nn.Module, *args: Any, **kwargs: Any) -> MGPUDataParallel:
        wrapper = MGPUDataParallel(module, *args, **kwargs)
        made.append(wrapper)
        return wrapper

    yield make
    for wrapper in made:
        wrapper.close()


def _linear(dtype: torch.dtype = torch.float32) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(10, 5).to(dtype)


# --- forward: positional, keyword and no inputs ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "tolerance"),
    [(torch.float32, 1e-6), (torch.float64, 1e-6), (torch.bfloat16, 1e-2), (torch.float16, 1e-3)],
)
@replica_counts
def test_module_output_matches_one_device(
    wrap: Callable[..., MGPUDataParallel], dtype: torch.dtype, tolerance: float, replicas: int
) -> None:
    layer = _linear(dtype)
    x = torch.randn(20, 10, dtype=dtype)
    out = wrap(layer, [CPU] * replicas)(x)
    assert out.device == CPU
    assert out.dtype == dtype
    torch.testing.assert_close(out, layer(x), atol=tolerance, rtol=0)


@replica_counts
def test_keyword_only_input(wrap: Callable[..., MGPUDataParallel], replicas: int) -> None:
    layer = _linear()

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = layer

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            return self.layer(input)

    x = torch.randn(20, 10)
    torch.testing.assert_close(wrap(Net(), [CPU] * replicas)(input=x), layer(x), **EXACT)


@pytest.mark.parametrize("unused", [[], {}, ()], ids=["empty_list", "empty_dict", "empty_tuple"])
def test_keyword_only_input_with_an_empty_container(wrap: Callable[..., MGPUDataParallel], unused: Any) -> None:
    layer = _linear()
    seen: list[Any] = []

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = layer

        def forward(self, input: dict[str, Any]) -> torch.Tensor:
            seen.append(input["unused"])
            return self.layer(input["data"])

    x = torch.randn(20, 10)
    out = wrap(Net(), CPU2)(input={"data": x, "unused": unused})
    torch.testing.assert_close(out, layer(x), **EXACT)
    assert seen == [unused, unused]
    assert all(type(value) is type(unused) for value in seen)


def test_positional_and_keyword_inputs_with_their_gradients(wrap: Callable[..., MGPUDataParallel]) -> None:
    class Net(nn.Module):
        def forward(
            self, a: torch.Tensor, b: torch.Tensor, scale: float, c: torch.Tensor | None = None
        ) -> torch.Tensor:
            return scale * (a * b if c is None else a * b + c)

    torch.manual_seed(0)
    a = torch.randn(5, 5, requires_grad=True)
    b = torch.randn(5, 5, requires_grad=True)
    c = torch.randn(5, 5)
    scale = torch.randn(1).item()

    def grads_of(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a.grad = b.grad = None
        out.sum().backward()
        assert a.grad is not None
        assert b.grad is not None
        return a.grad.clone(), b.grad.clone()

    for kwargs in ({}, {"c": c}):
        expected = Net()(a, b, scale, **kwargs)
        expected_grads = grads_of(expected)
        for devices in (CPU2, CPU3, [CPU]):
            out = wrap(Net(), devices)(a, b, scale, **kwargs)
            got = grads_of(out)
            torch.testing.assert_close(out, expected, **EXACT)
            torch.testing.assert_close(got, expected_grads, **EXACT)


@pytest.mark.parametrize("devices", [[CPU], CPU2, CPU3], ids=["1", "2", "3"])
def test_no_inputs_runs_the_module_once_on_the_root_device(
    wrap: Callable[..., MGPUDataParallel], devices: list[torch.device]
) -> None:
    calls: list[str] = []

    class Constant(nn.Module):
        def forward(self) -> torch.Tensor:
            calls.append(threading.current_thread().name)
            eye = torch.eye(2, 3)
            return eye + (1 - eye)

    out = wrap(Constant(), devices)()
    torch.testing.assert_close(out, torch.ones(2, 3))
    assert len(calls) == 1


def test_zero_dim_outputs_as_torch_returns_them(wrap: Callable[..., MGPUDataParallel]) -> None:
    """One device returns the module's output as it is; several stack one value per replica, as torch does."""

    class Total(nn.Module):
        def forward(self, x: torch.Tensor | None = None) -> torch.Tensor:
            return torch.tensor(1.0) if x is None else x.sum()

    x = torch.arange(6.0).reshape(6, 1)
    assert wrap(Total(), [CPU])(x).shape == ()
    assert wrap(Total(), [CPU])().shape == ()
    torch.testing.assert_close(wrap(Total(), CPU2)(x), torch.tensor([3.0, 12.0]))
    torch.testing.assert_close(wrap(Total(), CPU2)(), torch.tensor([1.0]))


def test_one_device_returns_any_output_as_the_module_does(wrap: Callable[..., MGPUDataParallel]) -> None:
    class Describe(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[str, int]:
            return "rows", len(x)

    assert wrap(Describe(), [CPU])(torch.randn(4, 2)) == ("rows", 4)


def test_nested_input(wrap: Callable[..., MGPUDataParallel]) -> None:
    class Net(nn.Module):
        def forward(self, *inputs: Any) -> torch.Tensor:
            return inputs[1][0]

    x = torch.randn(20, 3)
    inputs = (x.cos(), (x.sin(), x), x.sin())
    torch.testing.assert_close(wrap(Net(), CPU2)(*inputs), x.sin(), **EXACT)


def _nested(x: torch.Tensor) -> list[Any]:
    return [x, (x.sin(), x.cos(), [x.add(1)]), x, OrderedDict(a=x, b=[x.sin()])]


class _Nested(nn.Module):
    def forward(self, x: torch.Tensor) -> list[Any]:
        return _nested(x)


@replica_counts
def test_nested_output_keeps_its_types(wrap: Callable[..., MGPUDataParallel], replicas: int) -> None:
    x = torch.randn(10, 2)  # chunks of 5 + 5 or 4 + 3 + 3 rows: no list of the output has one item per row
    out = wrap(_Nested(), [CPU] * replicas)(x)
    torch.testing.assert_close(out, _nested(x), **EXACT)
    assert isinstance(out, list)
    assert isinstance(out[1], tuple)
    assert isinstance(out[1][2], list)
    assert type(out[3]) is OrderedDict
    assert list(out[3]) == ["a", "b"]
    assert isinstance(out[3]["b"], list)


def test_nested_output_at_torchs_own_two_rows_gathers_item_by_item(wrap: Callable[..., MGPUDataParallel]) -> None:
    """torch's own case: with 1-row chunks every list of tensors has one item per row, and is gathered as torch does."""
    x = torch.randn(2, 2)
    torch.testing.assert_close(wrap(_Nested(), CPU2)(x), _nested(x), **EXACT)

    class Marked(nn.Module):
        def forward(self, x: torch.Tensor) -> list[Any]:
            return Fields([x, Fields([x.add(1)])])

    torch.testing.assert_close(wrap(Marked(), CPU2)(x), [x, [x.add(1)]])


# --- how the inputs are split: where our contract differs from torch.chunk ------------------------------------------


def test_chunks_differ_by_at_most_one_row(wrap: Callable[..., MGPUDataParallel]) -> None:
    """Deliberate difference: 5 rows on 4 replicas are 2 + 1 + 1 + 1 (torch.chunk: 2 + 2 + 1 on three)."""

    class Rows(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.full((len(x),), len(x))

    assert wrap(Rows(), [CPU] * 4)(torch.randn(5, 1)).tolist() == [2, 2, 1, 1, 1]
    assert wrap(Rows(), CPU3)(torch.randn(20, 1)).tolist() == [7] * 14 + [6] * 6


def test_every_tensor_input_must_have_the_batch_rows(wrap: Callable[..., MGPUDataParallel]) -> None:
    class Masked(nn.Module):
        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return x * mask

    with pytest.raises(BatchSplitError) as caught:
        wrap(Masked(), CPU2)(torch.randn(4, 2), mask=torch.ones(3, 1))
    assert caught.value.path == "batch['kwargs']['mask']"
    assert "positional input i" in caught.value.__notes__[0]


def test_a_list_with_one_item_per_row_is_split_by_items(wrap: Callable[..., MGPUDataParallel]) -> None:
    """Deliberate difference: torch hands every replica the whole list; ours gives each its own rows' items."""
    received: list[list[str]] = []

    class Named(nn.Module):
        def forward(self, x: torch.Tensor, names: list[str]) -> list[str]:
            received.append(names)
            return [f"{name}:{row}" for name, row in zip(names, x.tolist(), strict=True)]

    out = wrap(Named(), CPU2)(torch.arange(3), ["a", "b", "c"])
    assert sorted(received) == [["a", "b"], ["c"]]
    assert out == ["a:0", "b:1", "c:2"]


class _PairErrors(nn.Module):
    """Takes the batch whole, as one ``[x, y]`` list, and returns each row's squared error."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))

    def forward(self, batch: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, y = batch
        return (self.net(x) - y).pow(2).squeeze(1)


@replica_counts
@pytest.mark.parametrize("kind", [list, tuple])
@pytest.mark.parametrize("rows", [[2, 2, 2], [8, 8, 2]], ids=["batches-of-2", "a-last-batch-of-2"])
def test_a_pair_batch_of_two_rows_is_split_as_fields_and_trains_like_one_device(
    wrap: Callable[..., MGPUDataParallel], replicas: int, kind: type, rows: list[int]
) -> None:
    """As torch splits it: each of the 2 items along dim 0, never one item per replica; no error, no warning."""
    generator = torch.Generator().manual_seed(0)
    batches = [kind([torch.randn(n, 3, generator=generator), torch.randn(n, 1, generator=generator)]) for n in rows]
    single, parallel = _PairErrors(), _PairErrors()
    initial = copy.deepcopy(dict(single.named_parameters()))
    wrapper = wrap(parallel, [CPU] * replicas)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for module, call in ((single, single), (parallel, wrapper)):
            optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
            for batch in batches:
                optimizer.zero_grad()
                call(batch).mean().backward()
                optimizer.step()
    torch.testing.assert_close(dict(parallel.named_parameters()), dict(single.named_parameters()), **EXACT)
    assert not torch.equal(single.net[0].weight, initial["net.0.weight"])


def test_a_call_without_tensors_is_refused(wrap: Callable[..., MGPUDataParallel]) -> None:
    """Deliberate difference: torch runs such a call on every device with the same inputs."""
    with pytest.raises(BatchSplitError) as caught:
        wrap(nn.Identity(), CPU2)(3.0)
    assert caught.value.path == "batch"


# --- gradients, grad modes, autocast --------------------------------------------------------------------------------


@replica_counts
def test_output_and_gradients_match_one_device(wrap: Callable[..., MGPUDataParallel], replicas: int) -> None:
    layer = _linear()
    x = torch.randn(20, 10)
    expected = layer(x)
    expected.sum().backward()
    expected_grads = [param.grad.clone() for param in layer.parameters() if param.grad is not None]
    layer.zero_grad()
    out = wrap(layer, [CPU] * replicas)(x)
    out.sum().backward()
    torch.testing.assert_close(out, expected, **EXACT)
    torch.testing.assert_close([param.grad for param in layer.parameters()], expected_grads, **EXACT)


def test_sparse_gradients_match_one_device(wrap: Callable[..., MGPUDataParallel]) -> None:
    torch.manual_seed(0)
    embedding = nn.Embedding(10, 5, sparse=True)
    ids = torch.randint(10, (20, 5))
    expected = embedding(ids)
    expected.sum().backward()
    assert embedding.weight.grad is not None
    expected_grad = embedding.weight.grad.coalesce()
    embedding.zero_grad()
    out = wrap(embedding, CPU2)(ids)
    out.sum().backward()
    torch.testing.assert_close(out, expected, **EXACT)
    assert embedding.weight.grad is not None
    assert embedding.weight.grad.is_sparse
    torch.testing.assert_close(embedding.weight.grad.coalesce(), expected_grad, **EXACT)


def test_buffers_that_require_grad_pass_gradcheck(wrap: Callable[..., MGPUDataParallel]) -> None:
    class Scaled(nn.Module):
        def __init__(self, scale: torch.Tensor) -> None:
            super().__init__()
            self.register_buffer("scale", scale)
            self.register_buffer("shift", scale.detach().clone())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.scale + self.shift

    torch.manual_seed(0)
    module = Scaled(torch.randn(100, dtype=torch.float64, requires_grad=True))
    assert module.scale.requires_grad
    wrapper = wrap(module, CPU2)
    x = torch.randn(2, 100, dtype=torch.float64)
    assert gradcheck(lambda scale: wrapper(x), (module.scale,))


@pytest.mark.parametrize("devices", [[CPU], CPU2], ids=["1", "2"])
def test_double_backward_through_the_wrapper(
    wrap: Callable[..., MGPUDataParallel], devices: list[torch.device]
) -> None:
    """A gradient penalty needs the graph of the input gradient, through scatter, replicas and gather.

    Deliberate difference: the bias, which the penalty does not depend on, gets no gradient, as on one device;
    torch's replicas give it a zero gradient.
    """
    net = nn.Linear(4, 1)
    wrapper = wrap(net, devices)
    x = torch.ones(2, 4, requires_grad=True)
    out = wrapper(x)
    (input_grad,) = torch.autograd.grad(out, x, grad_outputs=torch.ones_like(out), create_graph=True)
    input_grad.mean().backward()
    torch.testing.assert_close(net.weight.grad, torch.full((1, 4), 0.25))
    assert net.bias.grad is None


def test_replicas_follow_the_callers_grad_mode(wrap: Callable[..., MGPUDataParallel]) -> None:
    modes: list[bool] = []

    class Probe(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            modes.append(torch.is_grad_enabled())
            return x

    wrapper = wrap(Probe(), CPU2)
    with torch.no_grad():
        wrapper(torch.randn(20, 10))
    assert modes == [False, False]
    wrapper(torch.randn(20, 10))
    assert modes[2:] == [True, True]


def test_autocast_inside_forward_and_around_the_call(wrap: Callable[..., MGPUDataParallel]) -> None:
    class Inside(nn.Linear):
        @torch.autocast("cpu", dtype=torch.bfloat16)
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x)

    x = torch.randn(8, 8)
    assert wrap(Inside(8, 8), CPU2)(x).dtype is torch.bfloat16

    layer = _linear()
    wrapper = wrap(layer, CPU2)
    x = torch.randn(8, 10)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = layer(x)
        out = wrapper(x)
    assert out.dtype is torch.bfloat16
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    assert wrapper(x).dtype is torch.float32


# --- modules ---------------------------------------------------------------------------------------------------------


@replica_counts
def test_lstm_training_steps_match_one_device(wrap: Callable[..., MGPUDataParallel], replicas: int) -> None:
    class Recurrent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = nn.LSTM(30, 16, 1, batch_first=True, bidirectional=True)

        def forward(self, x: torch.Tensor) -> Any:
            self.rnn.flatten_parameters()
            return self.rnn(x)

    def step(model: nn.Module, x: torch.Tensor) -> None:
        optimizer = torch.optim.SGD(model.parameters(), lr=10)
        output = model(x)[0]
        F.mse_loss(output, torch.zeros_like(output)).backward()
        optimizer.step()

    torch.manual_seed(0)
    with torch.no_grad():
        model = Recurrent()
        wrapper = wrap(copy.deepcopy(model), [CPU] * replicas)
        wrapper(torch.rand(3 * replicas, 4, 30))  # grad disabled must not break the replicas
    x = torch.randn(12, 4, 30)
    step(model, x)
    step(wrapper, x)
    for param, wrapped in zip(model.parameters(), wrapper.parameters(), strict=True):
        torch.testing.assert_close(param, wrapped, **EXACT)


def test_lazy_modules_are_refused_as_torch_refuses_them(wrap: Callable[..., MGPUDataParallel]) -> None:
    with pytest.raises(RuntimeError, match="Modules with uninitialized parameters"):
        wrap(nn.LazyLinear(10), CPU2)(torch.rand(10, 10))


@pytest.mark.parametrize(
    ("container", "keys"),
    [
        (lambda first, second: nn.ParameterList([first, second]), (0, 1)),
        (lambda first, second: nn.ParameterDict({"0": first, "1": second}), ("0", "1")),
    ],
    ids=["ParameterList", "ParameterDict"],
)
def test_parameter_lists_and_dicts_reach_the_replicas(
    wrap: Callable[..., MGPUDataParallel], container: Callable[..., nn.Module], keys: tuple[Any, Any]
) -> None:
    first, second = nn.Parameter(torch.rand(10)), nn.Parameter(torch.rand(10))
    checked: list[int] = []

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.data = container(first, second)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for key, original in zip(keys, (first, second), strict=True):
                value = self.data[key]
                torch.testing.assert_close(value, original)
                assert value.requires_grad
                assert value.grad_fn is not None, "a replica's parameter is an alias that gradients flow through"
            checked.append(len(x))
            return x

    wrap(Holder(), CPU2)(torch.randn(8, 8))
    assert sorted(checked) == [4, 4]


def test_complex_parameters_and_inputs(wrap: Callable[..., MGPUDataParallel]) -> None:
    """Deliberate difference: the output is the complex tensor one device computes, not a real view of it."""

    class Shift(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shift = nn.Parameter(torch.randn(1, 10, dtype=torch.cfloat))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.shift

    module = Shift()
    x = torch.rand(4, 10, dtype=torch.cfloat)
    expected = module(x)
    expected.abs().sum().backward()
    assert module.shift.grad is not None
    expected_grad = module.shift.grad.clone()
    module.zero_grad()
    out = wrap(module, CPU2)(x)
    out.abs().sum().backward()
    assert out.dtype == torch.cfloat
    torch.testing.assert_close(out, expected, **EXACT)
    torch.testing.assert_close(module.shift.grad, expected_grad, **EXACT)


@pytest.mark.parametrize(
    "formats",
    [
        [torch.contiguous_format] * 4,
        [torch.channels_last] * 2 + [torch.contiguous_format] * 2,
        [torch.channels_last] * 4,
    ],
    ids=["contiguous", "mixed", "channels_last"],
)
def test_gradients_keep_the_parameters_memory_format(
    wrap: Callable[..., MGPUDataParallel], formats: list[torch.memory_format]
) -> None:
    def convnet() -> nn.Sequential:
        torch.manual_seed(0)
        widths = [8, 16, 32, 16, 8]
        layers = [nn.Conv2d(widths[i], widths[i + 1], (2, 2)).double() for i in range(4)]
        return nn.Sequential(*(layer.to(memory_format=fmt) for layer, fmt in zip(layers, formats, strict=True)))

    model = convnet()
    wrapped = convnet()
    wrapper = wrap(wrapped, CPU2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped_optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    x = torch.randn(16, 8, 8, 8, dtype=torch.float64)
    target = torch.randn(16, 8, 4, 4, dtype=torch.float64)
    for _ in range(2):  # the first step creates the gradients, the second accumulates into zeroed ones
        F.mse_loss(model(x), target).backward()
        F.mse_loss(wrapper(x), target).backward()
        for layer, wrapped_layer, fmt in zip(model, wrapped, formats, strict=True):
            assert wrapped_layer.weight.grad.is_contiguous(memory_format=fmt)
            assert layer.weight.grad.is_contiguous(memory_format=fmt)
            torch.testing.assert_close(wrapped_layer.weight.grad, layer.weight.grad, **EXACT)
            torch.testing.assert_close(wrapped_layer.bias.grad, layer.bias.grad, **EXACT)
        optimizer.step()
        wrapped_optimizer.step()
        optimizer.zero_grad()
        wrapped_optimizer.zero_grad()


def test_zero_grad_inside_a_replica_warns(wrap: Callable[..., MGPUDataParallel]) -> None:
    messages: list[str] = []

    class ZeroesItsGrads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(5, 5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                self.zero_grad()
            messages.extend(str(warning.message) for warning in caught)
            return x

    wrap(ZeroesItsGrads(), CPU2)(torch.rand(4, 3, 6, 5))
    expected = "Calling .zero_grad() from a module created with nn.DataParallel() has no effect."
    assert sum(message.startswith(expected) for message in messages) == 2


def test_forward_hooks_run_once_per_replica_on_its_chunk(wrap: Callable[..., MGPUDataParallel]) -> None:
    rows: list[int] = []
    module = nn.Linear(3, 2)
    module.register_forward_pre_hook(lambda _, args: rows.append(len(args[0])))
    wrap(module, CPU3)(torch.randn(7, 3))
    assert sorted(rows) == [2, 2, 3]


def test_the_module_must_live_on_the_first_device(wrap: Callable[..., MGPUDataParallel]) -> None:
    with pytest.raises(ConfigurationError, match=r"parameter 'weight' is on meta.*module\.to\('cpu'\)") as caught:
        wrap(nn.Linear(2, 2, device="meta"), CPU2)(torch.randn(2, 2))
    assert caught.value.setting == "MGPUDataParallel.module"
    split = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    with pytest.raises(ConfigurationError) as caught:
        wrap(split, CPU2)(torch.randn(2, 2))
    assert caught.value.setting == "MGPUDataParallel.module"


def test_no_reference_cycles(wrap: Callable[..., MGPUDataParallel]) -> None:
    wrapper = wrap(nn.Linear(1, 1), CPU2)
    gc.collect()
    wrapper(torch.randn(4, 1))
    wrapper(torch.randn(1, 1))
    assert gc.collect() == 0


# --- arguments as torch spells them ---------------------------------------------------------------------------------


def test_torch_argument_names_and_order(wrap: Callable[..., MGPUDataParallel]) -> None:
    layer = _linear()
    x = torch.randn(20, 10)
    for wrapper in (
        wrap(layer, device_ids=CPU2, output_device=CPU),
        wrap(layer, CPU2, CPU, 0),
        wrap(layer, ["cpu", "cpu"], -1),
    ):
        assert wrapper.devices == CPU2
        assert wrapper.output_device == CPU
        torch.testing.assert_close(wrapper(x), layer(x), **EXACT)


def test_arguments_that_cannot_work_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="dim=1.*batch_first=True") as caught:
        MGPUDataParallel(nn.Linear(2, 2), CPU2, dim=1)
    assert caught.value.setting == "MGPUDataParallel.dim"
    with pytest.raises(ConfigurationError, match="both devices= and device_ids=") as caught:
        MGPUDataParallel(nn.Linear(2, 2), CPU2, device_ids=CPU2)
    assert caught.value.setting == "MGPUDataParallel.device_ids"
    with pytest.raises(ConfigurationError, match="at least one device") as caught:
        MGPUDataParallel(nn.Linear(2, 2), [])
    assert caught.value.setting == "MGPUDataParallel.devices"


def _an_index_names_a_device() -> bool:
    try:
        torch.device(0)
    except RuntimeError:
        return False
    return True


@pytest.mark.skipif(_an_index_names_a_device(), reason="checks the message shown where torch sees no accelerator")
def test_device_indexes_without_an_accelerator_name_the_cpu_alternative() -> None:
    with pytest.raises(ConfigurationError, match=r"devices=\[torch\.device\('cpu'\)\] \* 2") as caught:
        MGPUDataParallel(nn.Linear(2, 2), [0, 1])
    assert caught.value.setting == "MGPUDataParallel.devices"


@pytest.mark.skipif(torch.cuda.is_available(), reason="without devices, CUDA machines use every GPU")
def test_without_devices_a_cpu_only_machine_runs_the_module_as_it_is(wrap: Callable[..., MGPUDataParallel]) -> None:
    layer = _linear()
    wrapper = wrap(layer)
    assert wrapper.devices == [CPU]
    x = torch.randn(3, 10)
    torch.testing.assert_close(wrapper(x), layer(x), atol=0, rtol=0)


# --- the engine's own scatter, parallel apply, replicate and gather -------------------------------------------------


def test_scatter_splits_rows_and_passes_gradients_back() -> None:
    x = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    chunks, sizes = scatter(x, CPU2)
    assert sizes == [2, 2]
    torch.testing.assert_close(chunks, [x[:2], x[2:]], atol=0, rtol=0)
    grad = torch.full((2, 4), 2.0, dtype=torch.float64)
    chunks[0].backward(grad)
    assert x.grad is not None
    torch.testing.assert_close(x.grad, torch.cat([grad, torch.zeros_like(grad)]))

    def split(y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(scatter(y, CPU2)[0])

    assert gradcheck(split, (x,))
    assert gradgradcheck(split, (x,))


def test_gather_concatenates_rows_and_passes_gradients_back() -> None:
    torch.manual_seed(0)
    parts = (torch.randn(2, 4, requires_grad=True), torch.randn(2, 4, requires_grad=True))
    result = gather(parts, CPU, [2, 2])
    assert result.shape == (4, 4)
    torch.testing.assert_close(result, torch.cat(parts), atol=0, rtol=0)
    grad = torch.randn(4, 4)
    result.backward(grad)
    torch.testing.assert_close([part.grad for part in parts], [grad[:2], grad[2:]])
    doubles = tuple(part.detach().double().requires_grad_() for part in parts)
    assert gradcheck(lambda a, b: gather((a, b), CPU, [2, 2]), doubles)
    assert gradgradcheck(lambda a, b: gather((a, b), CPU, [2, 2]), doubles)


def test_gather_stacks_zero_dim_outputs_into_a_vector() -> None:
    scalars = (torch.randn((), requires_grad=True), torch.randn((), requires_grad=True))
    result = gather(scalars, CPU, [2, 2])
    assert result.shape == (2,)
    torch.testing.assert_close(result, torch.stack(scalars), atol=0, rtol=0)
    grad = torch.randn(2)
    result.backward(grad)
    torch.testing.assert_close([scalar.grad for scalar in scalars], [grad[0], grad[1]])
    doubles = tuple(scalar.detach().double().requires_grad_() for scalar in scalars)
    assert gradcheck(lambda a, b: gather((a, b), CPU, [2, 2]), doubles)
    assert gradgradcheck(lambda a, b: gather((a, b), CPU, [2, 2]), doubles)


def test_gather_refuses_dicts_with_different_keys() -> None:
    """Torch raises ValueError; ``GatherError`` is a TypeError that names the replica whose keys differ."""
    outputs = ({"a": torch.randn(1, 2)}, {"b": torch.randn(1, 2), "a": torch.randn(1, 2)})
    with pytest.raises(GatherError) as caught:
        gather(outputs, CPU, [1, 1])
    assert (caught.value.path, caught.value.replica) == ("output", 1)


def test_parallel_apply_runs_each_call_on_its_device() -> None:
    torch.manual_seed(0)
    first, second = nn.Linear(10, 5), nn.Linear(10, 5)
    x1, x2 = torch.randn(2, 10), torch.randn(2, 10)
    apply = ParallelApply(2)
    try:
        plain = apply([lambda: first(x1), lambda: second(x2)], CPU2)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected_autocast = [first(x1), second(x2)]
            autocast = apply([lambda: first(x1), lambda: second(x2)], CPU2)
    finally:
        apply.close()
    torch.testing.assert_close(plain, [first(x1), second(x2)], atol=0, rtol=0)
    assert [out.dtype for out in autocast] == [torch.bfloat16, torch.bfloat16]
    torch.testing.assert_close(autocast, expected_autocast, atol=0, rtol=0)


def test_a_replicas_exception_reaches_the_caller_with_its_replica(wrap: Callable[..., MGPUDataParallel]) -> None:
    class Fails(nn.Module):
        def forward(self, *args: Any) -> Any:
            return {}["wonderful"]

    with pytest.raises(KeyError, match="wonderful") as caught:
        wrap(Fails(), CPU2)(torch.randn(4, 1))
    assert caught.value.__notes__[-1].startswith("lightning_mgpu: raised in replica 0 of 2 on cpu")


def test_replicas_compute_what_the_module_computes() -> None:
    module = _linear()
    x = torch.randn(2, 10)
    for replica in replicate(module, CPU2):
        assert all(param.device == CPU for param in replica.parameters())
        torch.testing.assert_close(replica(x), module(x), atol=0, rtol=0)


def test_replica_buffers_live_on_the_replica_device() -> None:
    net = nn.Module()
    net.bn = nn.BatchNorm2d(10)
    for replica in replicate(net, CPU2):
        assert {buffer.device for buffer in replica.buffers()} == {CPU}
        assert {name for name, _ in replica.named_buffers()} == {
            "bn.running_mean",
            "bn.running_var",
            "bn.num_batches_tracked",
        }


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_replicas_can_be_saved(grad: bool) -> None:
    with torch.set_grad_enabled(grad):
        replicas = replicate(nn.Linear(8, 8), CPU2)
    buffer = io.BytesIO()
    torch.save(replicas, buffer)
    assert buffer.tell() > 0


class _Traced(MGPUDataParallel):
    """Overrides each of the four phases, as a subclass of torch.nn.DataParallel may, and records what they saw."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[tuple[Any, ...]] = []

    def scatter(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Scattered:
        scattered = super().scatter(inputs, kwargs)
        self.seen.append(("scatter", scattered.sizes))
        return scattered

    def scatter_batch(
        self, batch: Any, args: Any = (), kwargs: dict[str, Any] | None = None, method: str = "forward"
    ) -> Scattered:
        scattered = super().scatter_batch(batch, args, kwargs, method)
        self.seen.append(("scatter_batch", scattered.sizes, method))
        return scattered

    def replicate(self, module: nn.Module, devices: Any) -> list[nn.Module]:
        replicas = super().replicate(module, devices)
        self.seen.append(("replicate", len(replicas)))
        return replicas

    def parallel_apply(self, replicas: Any, calls: Any, devices: Any, method: Any = None, context: Any = None) -> Any:
        outputs = super().parallel_apply(replicas, calls, devices, method, context)
        self.seen.append(("parallel_apply", method))
        return [output * 2 for output in outputs] if method is None else outputs

    def gather(self, outputs: Any, sizes: Any = None, method: str = "forward") -> Any:
        self.seen.append(("gather", method))
        return super().gather(outputs, sizes, method)


@replica_counts
def test_forward_is_scatter_replicate_parallel_apply_gather_each_overridable(replicas: int) -> None:
    module = _linear(torch.float64)
    wrapper = _Traced(module, [CPU] * replicas)
    try:
        x = torch.randn(7, 10, dtype=torch.float64)
        torch.testing.assert_close(wrapper(x), 2 * module(x), **EXACT)
    finally:
        wrapper.close()
    sizes = [3, 2, 2] if replicas == 3 else [4, 3]
    assert wrapper.seen == [
        ("scatter", sizes),
        ("replicate", replicas),
        ("parallel_apply", None),
        ("gather", "forward"),
    ]


@pytest.mark.filterwarnings("ignore:You are trying to `self.log\\(\\)` but the `self.trainer`")
def test_a_lightning_step_runs_through_the_same_overridable_phases() -> None:
    module = Regressor().double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 1, dtype=torch.float64)
    wrapper = _Traced(module, CPU2)
    try:
        loss = run_replica_step(wrapper, module, "validation_step", ([x, y], 0), {})
    finally:
        wrapper.close()
    torch.testing.assert_close(loss, F.mse_loss(module(x), y), **EXACT)
    assert wrapper.seen == [
        ("scatter_batch", [3, 2], "validation_step"),
        ("replicate", 2),
        ("parallel_apply", "validation_step"),
        ("gather", "validation_step"),
    ]


@pytest.mark.parametrize("call", ["forward", "step"])
def test_a_module_not_on_the_root_device_is_refused_before_any_replica_runs(call: str) -> None:
    module = Regressor().double()
    module.net[2].to("meta")  # one layer left behind on another device
    x, y = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 1, dtype=torch.float64)
    wrapper = _Traced(module, CPU2)
    calls = {
        "forward": lambda: wrapper(x),
        "step": lambda: run_replica_step(wrapper, module, "validation_step", ([x, y], 0), {}),
    }
    try:
        with pytest.raises(ConfigurationError) as caught:
            calls[call]()
    finally:
        wrapper.close()
    assert str(caught.value) == (
        "MGPUDataParallel needs the module on its first device, cpu, but parameter 'net.2.weight' is on meta. Move"
        " the module there before calling the wrapper: module.to('cpu')."
    )
    assert ("parallel_apply", None) not in wrapper.seen
    assert ("parallel_apply", "validation_step") not in wrapper.seen


# --- against torch.nn.DataParallel on real GPUs ---------------------------------------------------------------------


class _Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(10, 5)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        out = self.layer(x)
        return out if mask is None else out * mask


def _compare_with_torch(device_ids: list[int], module: nn.Module, x: torch.Tensor, mask: torch.Tensor) -> None:
    reference = copy.deepcopy(module)
    theirs = torch.nn.DataParallel(reference, device_ids=device_ids)
    ours = MGPUDataParallel(module, device_ids=device_ids)
    try:
        expected = theirs(x, mask=mask)
        out = ours(x, mask=mask)
        assert out.device == expected.device == torch.device("cuda", device_ids[0])
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
        expected.sum().backward()
        out.sum().backward()
        for param, reference_param in zip(module.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(param.grad, reference_param.grad, atol=1e-5, rtol=0)
        torch.testing.assert_close(ours(x[:3]), theirs(x[:3]), atol=1e-5, rtol=0)
    finally:
        ours.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="compares with torch.nn.DataParallel on 2 GPUs")
def test_matches_torch_data_parallel_on_two_gpus() -> None:
    module = _Masked().cuda(0)
    x = torch.randn(20, 10, device="cuda:0")
    mask = torch.rand(20, 5, device="cuda:0")
    _compare_with_torch([0, 1], module, x, mask)
    ours = MGPUDataParallel(module, [0, 1], output_device=-1)
    try:
        assert ours(x).device == CPU
    finally:
        ours.close()
    with pytest.raises(ConfigurationError) as caught:
        MGPUDataParallel(_Masked(), [0, 1])(x)
    assert caught.value.setting == "MGPUDataParallel.module"


@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="compares with torch.nn.DataParallel on 1 GPU")
def test_matches_torch_data_parallel_on_one_gpu() -> None:
    module = _Masked()  # on the CPU: with one device, both wrappers move it there
    x = torch.randn(20, 10)
    mask = torch.rand(20, 5)
    _compare_with_torch([0], module, x, mask)
    assert module.layer.weight.device == torch.device("cuda", 0)
