"""The structural model checks judge only what the user wrote.

Every stock module of ``torch.nn``, the wrappers and utilities of torch that rewrite a module, every torchmetrics metric
and Lightning's own attributes pass without findings, also inside a user's subclass of a stock class; the user's
plain containers and unregistered tensors are still found, wherever they sit.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import pickle
import pkgutil
import re
import socket
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import lightning as L
import pytest
import torch
import torchmetrics
from models import Portable, loader, regression_data, trainer
from torch import nn
from torch.nn.utils import parametrizations, parametrize, prune

from lightning_mgpu import ConfigurationError, ModelCheckError, allow_plain_tensors, check_model
from lightning_mgpu.checks import Finding, report

Factory = Callable[[], nn.Module]


class _Holder(L.LightningModule):
    """A user's LightningModule that holds the modules under test as children, the way a model would."""

    def __init__(self, parts: dict[str, nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleDict(parts)


def _found(module: nn.Module) -> list[tuple[str, str, str]]:
    return [(finding.level, finding.check, finding.where) for finding in check_model(module)]


def _quietly(factory: Callable[[], Any]) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return factory()


# ---------------------------------------------------------------------------------------------------------------------
# Every class of torch.nn

_POSITIONAL = [(), (4,), (4, 4), (4, 4, 3), (4, 2)]

# Classes that the positional table cannot build (or builds too large), and configurations that store other attributes.
_CONFIGURATIONS: dict[str, list[tuple[tuple[Any, ...], dict[str, Any]]]] = {
    "RNNBase": [(("LSTM", 4, 4), {})],
    "RNNCellBase": [((4, 4), {"bias": True, "num_chunks": 4})],
    "RNN": [((4, 4), {"num_layers": 2, "bidirectional": True}), ((4, 4), {"nonlinearity": "relu"})],
    "LSTM": [((4, 4), {"num_layers": 2, "bidirectional": True}), ((4, 4), {"proj_size": 2})],
    "GRU": [((4, 4), {"num_layers": 2, "bidirectional": True, "dropout": 0.1, "batch_first": True})],
    "Embedding": [((10, 4), {"sparse": True}), ((10, 4), {"padding_idx": 0, "max_norm": 1.0})],
    "EmbeddingBag": [((10, 4), {"mode": "max"}), ((10, 4), {"sparse": True, "include_last_offset": True})],
    "MultiheadAttention": [
        ((8, 2), {}),
        ((8, 2), {"kdim": 4, "vdim": 4, "add_bias_kv": True, "add_zero_attn": True, "batch_first": True}),
    ],
    "Transformer": [
        ((), {"d_model": 8, "nhead": 2, "num_encoder_layers": 1, "num_decoder_layers": 1, "dim_feedforward": 16}),
    ],
    "TransformerEncoderLayer": [((8, 2, 16), {}), ((8, 2, 16), {"norm_first": True, "batch_first": True})],
    "TransformerDecoderLayer": [((8, 2, 16), {})],
    "TransformerEncoder": [((nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), 2, nn.LayerNorm(8)), {})],
    "TransformerDecoder": [((nn.TransformerDecoderLayer(8, 2, 16), 2), {})],
    "AdaptiveLogSoftmaxWithLoss": [((8, 10, [4, 8]), {})],
    "Unflatten": [((1, (2, 2)), {})],
    "CrossEntropyLoss": [((), {"weight": torch.ones(3)})],
    "BCEWithLogitsLoss": [((), {"pos_weight": torch.ones(3)})],
}


def _torch_nn_classes() -> dict[str, type[nn.Module]]:
    return {
        name: value
        for name, value in vars(nn).items()
        if not name.startswith("_") and isinstance(value, type) and issubclass(value, nn.Module)
    }


def _subclass(cls: type[nn.Module]) -> type[nn.Module]:
    """A user's subclass of a stock class that adds nothing: it must inherit the stock class's exemptions."""
    return type(f"User{cls.__name__}", (cls,), {"__module__": __name__})


def _build_torch_nn() -> tuple[dict[str, nn.Module], dict[str, str]]:
    """An instance of every class of torch.nn and one of a user's subclass of it, per configuration; and what failed."""
    built: dict[str, nn.Module] = {}
    unbuilt: dict[str, str] = {}
    for name, cls in _torch_nn_classes().items():
        configurations = _CONFIGURATIONS.get(name, [(arguments, {}) for arguments in _POSITIONAL])
        errors = []
        for index, (arguments, keywords) in enumerate(configurations):
            try:
                built[f"{name}_{index}"] = _quietly(lambda cls=cls, a=arguments, k=keywords: cls(*a, **k))
                built[f"User{name}_{index}"] = _quietly(
                    lambda cls=cls, a=arguments, k=keywords: _subclass(cls)(*a, **k)
                )
            except Exception as error:  # noqa: BLE001 - the positional table tries arguments until one fits
                errors.append(error)
                continue
            if name not in _CONFIGURATIONS:
                break
        if errors and (name in _CONFIGURATIONS or len(errors) == len(configurations)):
            unbuilt[name] = repr(errors[-1])
    return built, unbuilt


def test_every_torch_nn_class_passes_inside_a_lightning_module() -> None:
    built, unbuilt = _build_torch_nn()
    assert unbuilt == {}, f"torch.nn classes the tests could not build; add a row to _CONFIGURATIONS: {unbuilt}"
    classes = {type(module) for module in built.values()} & set(_torch_nn_classes().values())
    assert len(classes) >= 150, f"only {len(classes)} torch.nn classes were built"
    findings = _found(_Holder(built))
    # A lazy module that has not run yet has nothing to replicate: the one finding a stock class gets, by design.
    lazy = [finding for finding in findings if finding[1] == "uninitialized-parameter"]
    assert [finding for finding in findings if finding not in lazy] == []
    assert lazy
    assert all(finding[2].split(".")[1].removeprefix("User").startswith("Lazy") for finding in lazy)


def test_a_lazy_module_that_has_not_run_is_an_error_with_the_fix() -> None:
    holder = _Holder({"head": nn.LazyLinear(2)})
    assert _found(holder) == [
        ("error", "uninitialized-parameter", "parts.head.weight"),
        ("error", "uninitialized-parameter", "parts.head.bias"),
    ]
    with pytest.raises(
        ModelCheckError, match=r"parts\.head\.weight` belongs to a lazy module.*nn\.Linear\(in_feat"
    ) as caught:
        report(check_model(holder), "mgpu_dp")
    assert [finding.where for finding in caught.value.findings] == ["parts.head.weight", "parts.head.bias"]
    holder.parts["head"](torch.zeros(3, 4))
    assert _found(holder) == []


def test_a_model_check_error_keeps_its_findings_when_pickled() -> None:
    findings = [Finding("error", "plain-container", "heads", "`heads` is a plain Python list")]
    error = pickle.loads(pickle.dumps(ModelCheckError("mgpu_dp found 1 problem(s)", findings)))
    assert (str(error), error.findings) == ("mgpu_dp found 1 problem(s)", findings)


def test_a_user_subclass_of_lstm_keeps_the_rnn_bookkeeping_exempt() -> None:
    class StackedLSTM(nn.LSTM):
        def __init__(self) -> None:
            super().__init__(4, 4, num_layers=2, bidirectional=True)
            self.depth = 2

    model = _Holder({"encoder": StackedLSTM(), "gru": nn.GRU(4, 4)})
    assert _found(model) == []
    model.parts["encoder"](torch.zeros(3, 1, 4))
    assert _found(model) == []


# ---------------------------------------------------------------------------------------------------------------------
# torch's utilities and wrappers


class _Affine(nn.Module):
    """A user module whose parameters the utilities below rewrite."""

    def __init__(self) -> None:
        super().__init__()
        self.kernel = nn.Parameter(torch.randn(4, 4))
        self.shift = nn.Parameter(torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.kernel + self.shift


class _Symmetric(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.triu() + x.triu(1).transpose(-1, -2)


def _materialized(module: nn.Module, example: torch.Tensor) -> nn.Module:
    module(example)
    return module


def _pruned_twice() -> nn.Module:
    module = nn.Linear(4, 4)
    prune.l1_unstructured(module, "weight", amount=0.5)
    prune.random_unstructured(module, "weight", amount=0.25)
    prune.random_unstructured(module, "bias", amount=0.5)
    return module


def _pruned_globally() -> nn.Module:
    model = nn.Sequential(nn.Linear(4, 4), nn.Conv1d(4, 4, 3), _Affine())
    prune.global_unstructured(
        [(model[0], "weight"), (model[1], "weight"), (model[2], "kernel")],
        pruning_method=prune.L1Unstructured,
        amount=0.3,
    )
    prune.ln_structured(model[1], "weight", amount=0.5, n=2, dim=0)
    return model


def _parametrized() -> nn.Module:
    module = _Affine()
    parametrize.register_parametrization(module, "kernel", _Symmetric())
    return module


def _compiled_in_place() -> nn.Module:
    module = nn.Sequential(nn.Linear(4, 4), nn.LSTM(4, 4))
    module.compile(backend="eager")
    return module


def _quantization_prepared() -> nn.Module:
    from torch.ao import quantization

    model = nn.Sequential(quantization.QuantStub(), nn.Linear(4, 4), nn.ReLU(), quantization.DeQuantStub())
    model.qconfig = quantization.default_qconfig
    return quantization.prepare(model)


def _checkpoint_wrapped() -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    return checkpoint_wrapper(nn.Sequential(nn.Linear(4, 4), nn.GRU(4, 4)))


class _Traced(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("offset", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + self.offset


_UTILITIES: dict[str, Factory] = {
    "weight_norm": lambda: nn.utils.weight_norm(nn.Linear(4, 4)),
    "weight_norm_conv_dim_none": lambda: nn.utils.weight_norm(nn.Conv1d(4, 4, 3), dim=None),
    "weight_norm_user_module": lambda: nn.utils.weight_norm(_Affine(), name="kernel"),
    "spectral_norm": lambda: nn.utils.spectral_norm(nn.Linear(4, 4)),
    "spectral_norm_user_module": lambda: nn.utils.spectral_norm(_Affine(), name="kernel"),
    "spectral_norm_on_lstm": lambda: nn.utils.spectral_norm(nn.LSTM(4, 4), name="weight_hh_l0"),
    "parametrizations_weight_norm": lambda: parametrizations.weight_norm(nn.Linear(4, 4)),
    "parametrizations_orthogonal": lambda: parametrizations.orthogonal(nn.Linear(4, 4)),
    "parametrizations_spectral_norm": lambda: parametrizations.spectral_norm(nn.Linear(4, 4)),
    "parametrize_user": _parametrized,
    "prune_twice": _pruned_twice,
    "prune_global": _pruned_globally,
    "torch_compile": lambda: torch.compile(nn.Sequential(nn.Linear(4, 4), nn.LSTM(4, 4)), backend="eager"),
    "module_compile": _compiled_in_place,
    "quantization_prepare": _quantization_prepared,
    "checkpoint_wrapper": _checkpoint_wrapped,
    "fx_symbolic_trace": lambda: torch.fx.symbolic_trace(_Traced()),
    "jit_trace": lambda: torch.jit.trace(_Traced(), torch.zeros(2, 4)),
    "sync_batchnorm": lambda: nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm1d(4))),
    "lazy_linear_materialized": lambda: _materialized(nn.LazyLinear(4), torch.zeros(2, 3)),
    "lazy_conv_materialized": lambda: _materialized(nn.LazyConv2d(4, 3), torch.zeros(1, 2, 5, 5)),
    "lazy_batchnorm_materialized": lambda: _materialized(nn.LazyBatchNorm1d(), torch.zeros(2, 3)),
}


def test_modules_rewritten_by_torch_utilities_pass() -> None:
    parts = {name: _quietly(factory) for name, factory in _UTILITIES.items()}
    assert _found(_Holder(parts)) == []
    parts["weight_norm"](torch.zeros(2, 4))  # the hook recomputes `weight` before each forward: still not a finding
    assert _found(_Holder(parts)) == []


def test_a_weight_norm_hook_exempts_only_the_attribute_it_recomputes() -> None:
    class Shifted(_Affine):
        def __init__(self) -> None:
            super().__init__()
            self.offset = torch.zeros(4)

    module = _quietly(lambda: nn.utils.weight_norm(Shifted(), name="kernel"))
    assert _found(module) == [("warning", "unregistered-tensor", "offset")]


def test_a_users_own_hook_object_does_not_exempt_its_attribute() -> None:
    class Doubling:
        def __init__(self, name: str) -> None:
            self.name = name

        def __call__(self, module: nn.Module, inputs: Any) -> None:
            setattr(module, self.name, module.raw * 2)

    module = _Affine()
    module.raw = nn.Parameter(torch.ones(4))
    module.doubled = torch.ones(4) * 2
    module.register_forward_pre_hook(Doubling("doubled"))
    assert _found(module) == [("warning", "unregistered-tensor", "doubled")]


# ---------------------------------------------------------------------------------------------------------------------
# Every torchmetrics metric

_METRIC_ARGUMENTS: dict[str, Callable[[], Any]] = {
    "task": lambda: "binary",
    "num_classes": lambda: 3,
    "num_labels": lambda: 3,
    "num_outputs": lambda: 2,
    "num_groups": lambda: 2,
    "beta": lambda: 0.5,
    "p": lambda: 2.0,
    "threshold": lambda: 0.5,
    "data_range": lambda: 1.0,
    "min_recall": lambda: 0.5,
    "min_precision": lambda: 0.5,
    "min_sensitivity": lambda: 0.5,
    "min_specificity": lambda: 0.5,
    "things": lambda: {0},
    "stuffs": lambda: {1},
    "mouth_map": lambda: [0, 1],
    "fn": lambda: "sum",
    "default_value": lambda: torch.tensor(0.0),
    "metric_func": lambda: torchmetrics.functional.mean_squared_error,
    "metric": lambda: torchmetrics.MeanSquaredError(),
    "base_metric": lambda: torchmetrics.MeanSquaredError(),
    "wrapped_metric": lambda: torchmetrics.MeanSquaredError(),
    "metrics": lambda: [torchmetrics.MeanSquaredError(), torchmetrics.MeanAbsoluteError()],
    "task_metrics": lambda: {"a": torchmetrics.MeanSquaredError(), "b": torchmetrics.MeanAbsoluteError()},
}
_TASKS: dict[str, dict[str, Any]] = {"binary": {}, "multiclass": {"num_classes": 3}, "multilabel": {"num_labels": 3}}


def _torchmetrics_classes() -> dict[str, type[nn.Module]]:
    packages = [
        importlib.import_module(f"torchmetrics.{info.name}")
        for info in pkgutil.iter_modules(torchmetrics.__path__)
        if info.ispkg and info.name not in ("functional", "utilities")
    ]
    return {
        value.__qualname__: value
        for package in [torchmetrics, *packages]
        for value in vars(package).values()
        if isinstance(value, type) and issubclass(value, nn.Module) and not inspect.isabstract(value)
    }


def _metric_configurations(cls: type[nn.Module]) -> Iterator[dict[str, Any]]:
    """Keyword arguments to try: the required ones from the table, and one set per task where the class has tasks."""
    parameters = inspect.signature(cls).parameters
    plain = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    required = {
        name: _METRIC_ARGUMENTS[name]()
        for name, parameter in parameters.items()
        if parameter.kind in plain and parameter.default is inspect.Parameter.empty and name in _METRIC_ARGUMENTS
    }
    sized = {name: 3 for name in ("num_classes", "num_labels") if name in parameters}
    if "task" in required:
        for task, sizes in _TASKS.items():
            yield {**required, "task": task, **sizes}
    else:
        yield {**required, **sized}


@pytest.fixture
def _no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Metrics that fetch pretrained networks fail at once instead of waiting on a download."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise OSError("no network in the tests")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


# Classes that only build with packages or downloads that the tests do not assume; every other class must build.
_OPTIONAL = re.compile(r"install|no network in the tests")
_NEEDS_FID_NETWORKS = {"FeatureShare"}


@pytest.mark.usefixtures("_no_network")
def test_every_torchmetrics_metric_passes_inside_a_lightning_module() -> None:
    built: dict[str, nn.Module] = {}
    failures: dict[str, str] = {}
    for name, cls in _torchmetrics_classes().items():
        for index, arguments in enumerate(_metric_configurations(cls)):
            try:
                built[f"{name}_{index}"] = _quietly(lambda cls=cls, arguments=arguments: cls(**arguments))
            except Exception as error:  # noqa: BLE001 - optional dependencies, reported below
                failures.setdefault(name, repr(error))
    classes = {key.rsplit("_", 1)[0] for key in built}
    unbuilt = {name: why for name, why in failures.items() if name not in classes}
    unexpected = {
        name: why for name, why in unbuilt.items() if not (_OPTIONAL.search(why) or name in _NEEDS_FID_NETWORKS)
    }
    assert unexpected == {}, f"torchmetrics classes the tests could not build; extend _METRIC_ARGUMENTS: {unexpected}"
    assert len(classes) >= 200, f"only {len(classes)} torchmetrics classes were built; not built: {sorted(unbuilt)}"
    assert _found(_Holder(built)) == []


# ---------------------------------------------------------------------------------------------------------------------
# Lightning's own attributes


class _Recurrent(Portable):
    """A user's model with an LSTM, hyperparameters that hold a module and a tensor, and an example input."""

    def __init__(self, encoder: nn.Module, scale: torch.Tensor) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.encoder = encoder
        self.example_input_array = torch.zeros(2, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        encoded, _ = self.encoder(x.unsqueeze(1))
        return self.net(encoded.squeeze(1))


def test_lightning_attributes_and_an_lstm_pass_before_and_after_fit_under_mgpu_dp() -> None:
    model = _quietly(lambda: _Recurrent(nn.LSTM(4, 4, batch_first=True), torch.ones(1)))
    assert set(model.hparams) == {"encoder", "scale"}
    assert _found(model) == []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(max_steps=1, devices=2, strategy="mgpu_dp").fit(model, loader(regression_data(rows=4), 4))
    assert [str(warning.message) for warning in caught if "mgpu_dp: " in str(warning.message)] == []
    assert _found(model) == []


# ---------------------------------------------------------------------------------------------------------------------
# The user's mistakes are still found


class _Mistakes(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Parameter(torch.ones(1))
        self.second = nn.Parameter(torch.ones(1))
        self.params = [nn.Parameter(torch.ones(1))]
        self.heads = {"a": nn.Linear(1, 1)}
        self.constants = (torch.ones(1), torch.zeros(1))
        self.nested = {"group": [{"deep": nn.Parameter(torch.ones(1))}]}
        self.pair = [self.first, self.second]
        self.offset = torch.zeros(1)


def test_the_users_plain_containers_and_tensors_are_found() -> None:
    assert _found(_Mistakes()) == [
        ("error", "plain-container", "params"),
        ("error", "plain-container", "heads"),
        ("warning", "plain-tensors", "constants"),
        ("error", "plain-container", "nested"),
        ("warning", "unregistered-tensor", "offset"),
    ]


@pytest.mark.parametrize(
    ("where", "pattern"),
    [
        ("params", r"`params` is a plain Python list holding parameters.*nn.ParameterList"),
        ("heads", r"`heads` is a plain Python dict holding modules.*nn.ModuleList / nn.ModuleDict"),
        (
            "constants",
            r"`constants` is a plain Python tuple holding tensors.*register_buffer.*allow_plain_tensors\(self,"
            r" 'constants'\)",
        ),
        ("nested", r"`nested` is a plain Python dict holding parameters"),
        ("params", r"`params` is a plain Python list.*register_parameters\(self, 'params', params\)"),
        ("offset", r"`offset` is a tensor but neither a parameter nor a buffer.*register_buffer\('offset'"),
    ],
)
def test_each_finding_names_the_attribute_and_the_fix(where: str, pattern: str) -> None:
    messages = {finding.where: finding.message for finding in check_model(_Mistakes())}
    assert where in messages
    assert re.search(pattern, messages[where]), messages[where]


def test_tensors_allowed_by_name_are_not_reported_but_parameters_and_modules_still_are() -> None:
    model = _Mistakes()
    allow_plain_tensors(model, "constants", "offset")
    allow_plain_tensors(model, "params", "heads")
    assert _found(model) == [
        ("error", "plain-container", "params"),
        ("error", "plain-container", "heads"),
        ("error", "plain-container", "nested"),
    ]
    copy = _Mistakes()
    assert ("warning", "plain-tensors", "constants") in _found(copy), "the permission belongs to one instance"


def test_allowing_an_attribute_that_is_missing_or_registered_names_it() -> None:
    model = _Mistakes()
    with pytest.raises(ConfigurationError) as caught:
        allow_plain_tensors(model, "offest", "first", "constants")
    assert caught.value.setting == "allow_plain_tensors.names"
    message = str(caught.value)
    assert "'offest' is not an attribute of it yet" in message
    assert "'first' is a registered parameter, buffer or submodule" in message
    assert "'constants'" not in message
    assert "constants" in _found_where(model), "a refused call allows nothing"


def _found_where(module: nn.Module) -> set[str]:
    return {finding.where for finding in check_model(module)}


class _Rotate(nn.Module):
    """A function wrapped as a module, with neither parameters nor buffers."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([-x[:, 1:2], x[:, 0:1], x[:, 2:]], dim=1)


class _FunctionsInAPlainDict(Portable):
    """Keeps function modules in a plain dict beside its layers, as Hugging Face's kernel hub attaches them."""

    def __init__(self) -> None:
        super().__init__()
        self.__dict__.setdefault("_kernel_funcs", {})["rotate"] = _Rotate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(self._kernel_funcs["rotate"](x))


def _wrapped_like_the_kernel_hub(cls: type[nn.Module]) -> type[nn.Module]:
    """Wraps ``cls.__init__`` as Hugging Face's kernel hub (``kernels.use_kernelized_func``) wraps a layer's: the
    wrapper keeps modules in a plain dict of ``self.__dict__``, here one with parameters."""
    original = cls.__init__

    @functools.wraps(original)
    def new_init(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.__dict__.setdefault("_kernel_funcs", {})["project"] = nn.Linear(2, 2)

    cls.__init__ = new_init  # type: ignore[method-assign]
    return cls


@_wrapped_like_the_kernel_hub
class _LibraryAttention(nn.Module):
    __module__ = "transformers.models.stand_in"  # judged as a class of a model library

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(2, 2)


@_wrapped_like_the_kernel_hub
class _UsersAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(2, 2)


def test_what_a_wrapper_of_a_library_class_stores_is_the_librarys_and_the_same_on_a_users_class_is_found() -> None:
    library, users = _LibraryAttention(), _UsersAttention()
    assert isinstance(library._kernel_funcs["project"], nn.Linear)
    assert _found(_Holder({"attention": library})) == []
    assert _found(_Holder({"attention": users})) == [("error", "plain-container", "parts.attention._kernel_funcs")]


def test_modules_without_state_in_a_plain_dict_pass_and_train_like_one_device() -> None:
    model = _FunctionsInAPlainDict()
    assert _found(model) == []
    one_device = _FunctionsInAPlainDict()
    trainer(max_epochs=2).fit(one_device, loader(regression_data(rows=12), 6))
    for _ in range(2):
        split = _FunctionsInAPlainDict()
        trainer(max_epochs=2, devices=3, strategy="mgpu_dp").fit(split, loader(regression_data(rows=12), 6))
        for name, tensor in one_device.state_dict().items():
            torch.testing.assert_close(split.state_dict()[name], tensor, atol=1e-6, rtol=0)
    model._kernel_funcs["scaled"] = nn.Sequential(_Rotate(), nn.Linear(4, 4))
    assert _found(model) == [("error", "plain-container", "_kernel_funcs")], "a module with parameters is still found"


@pytest.mark.libraries
def test_a_model_librarys_own_plain_attributes_pass_and_a_users_subclass_is_judged_on_its_additions() -> None:
    from torchvision.models.detection.anchor_utils import AnchorGenerator

    class UserAnchors(AnchorGenerator):
        def __init__(self) -> None:
            super().__init__()
            self.offsets = [torch.zeros(2)]
            self.extra = [nn.Parameter(torch.ones(1))]

    stock = AnchorGenerator()
    assert isinstance(stock.cell_anchors, list)
    assert all(isinstance(anchors, torch.Tensor) for anchors in stock.cell_anchors)
    assert _found(_Holder({"anchors": stock})) == []
    assert _found(_Holder({"anchors": UserAnchors()})) == [
        ("warning", "plain-tensors", "parts.anchors.offsets"),
        ("error", "plain-container", "parts.anchors.extra"),
    ]


def test_a_users_additions_to_a_subclass_of_lstm_are_found() -> None:
    class AttentiveLSTM(nn.LSTM):
        def __init__(self) -> None:
            super().__init__(4, 4, num_layers=2)
            self.extra = [nn.Parameter(torch.ones(4))]
            self.temperature = torch.ones(1)

    model = _Holder({"encoder": AttentiveLSTM()})
    assert _found(model) == [
        ("error", "plain-container", "parts.encoder.extra"),
        ("warning", "unregistered-tensor", "parts.encoder.temperature"),
    ]
    with (
        pytest.raises(
            ModelCheckError, match=r"(?s)1 problem\(s\).*`parts.encoder.extra` is a plain Python list"
        ) as caught,
        pytest.warns(UserWarning, match=r"`parts.encoder.temperature` is a tensor"),
    ):
        report(check_model(model), "mgpu_dp")
    assert [(finding.check, finding.where) for finding in caught.value.findings] == [
        ("plain-container", "parts.encoder.extra")
    ]


def test_mistakes_deep_in_submodules_and_on_stock_instances_are_found() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Sequential(nn.Linear(4, 4))
            self.inner.cache = [nn.Linear(4, 4)]
            self.inner[0].scale = torch.ones(1)

    model = _Holder({"block": Block()})
    assert _found(model) == [
        ("error", "plain-container", "parts.block.inner.cache"),
        ("warning", "unregistered-tensor", "parts.block.inner.0.scale"),
    ]


def test_a_stock_class_without_readable_source_gets_the_benefit_of_the_doubt() -> None:
    namespace: dict[str, Any] = {"__name__": "torch.generated", "nn": nn, "torch": torch}
    source = (
        "class Generated(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.cache = [nn.Parameter(torch.ones(1))]\n"
    )
    exec(compile(source, "<generated>", "exec"), namespace)
    assert _found(namespace["Generated"]()) == []
