"""Every private torch, Lightning and torchmetrics API in ``lightning_mgpu._compat``, each tested on its own.

An upgrade that changes one of them fails here first, naming the function, before it fails in a training run.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.plugins import TorchSyncBatchNorm
from models import PositionKeepingLoader, RegressionStream, regression_data
from processes import free_port
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, SequentialSampler, TensorDataset

from lightning_mgpu import _compat
from lightning_mgpu._compat import with_sampler
from lightning_mgpu.namespaces import Namespace, imported
from lightning_mgpu.strategies.samplers import EvenlyShardedSampler


class TaggedLoader(DataLoader):
    def __init__(self, dataset: TensorDataset, tag: str, **kwargs: object) -> None:
        super().__init__(dataset, **kwargs)
        self.tag = tag


def _dataset(rows: int = 5) -> TensorDataset:
    return TensorDataset(torch.arange(float(rows)))


@pytest.mark.parametrize("namespace", imported(), ids=lambda namespace: namespace.name)
def test_with_sampler_rebuilds_the_loader_around_the_new_sampler(namespace: Namespace) -> None:
    data = _dataset()
    original = TaggedLoader(data, "mine", batch_size=2, sampler=DistributedSampler(data, num_replicas=2, rank=1))
    rebuilt = with_sampler(original, EvenlyShardedSampler(data, num_replicas=2, rank=1, shuffle=False), namespace)
    assert isinstance(rebuilt, TaggedLoader)
    assert rebuilt.tag == "mine"
    assert rebuilt.batch_size == 2
    assert [batch[0].tolist() for batch in rebuilt] == [[1.0, 3.0]]


def test_metric_states_round_trip_with_their_update_count() -> None:
    import torchmetrics

    from lightning_mgpu._compat import metric_states, restore_metric_states

    holder = torch.nn.Module()
    holder.mean = torchmetrics.MeanMetric()
    holder.cat = torchmetrics.CatMetric()
    for value in (1.0, 2.0, 6.0):
        holder.mean.update(value)
        holder.cat.update(torch.tensor([value]))
    saved = metric_states(holder)
    fresh = torch.nn.Module()
    fresh.mean = torchmetrics.MeanMetric()
    fresh.cat = torchmetrics.CatMetric()
    restore_metric_states(fresh, saved)
    assert fresh.mean.update_count == 3
    assert fresh.mean.compute().item() == 3.0
    assert fresh.cat.compute().tolist() == [1.0, 2.0, 6.0]


# ---------------------------------------------------------------------------------------------------------- torch


def test_own_replication_is_found_and_used_for_rnns_only() -> None:
    lstm = nn.LSTM(3, 4)
    assert _compat.has_own_replication(lstm)
    assert not _compat.has_own_replication(nn.Linear(3, 4))
    replica = _compat.own_replica(lstm)
    assert replica is not lstm
    assert type(replica) is nn.LSTM
    assert replica._flat_weights_names == lstm._flat_weights_names


def test_compiled_wrappers_are_recognised_and_opened() -> None:
    module = nn.Linear(3, 4)
    compiled = torch.compile(module)
    assert _compat.is_compiled_wrapper(compiled)
    assert not _compat.is_compiled_wrapper(module)
    assert _compat.compiled_original(compiled) is module


def test_a_compile_call_is_found_and_rebound_to_another_module() -> None:
    module, other = nn.Linear(3, 4), nn.Linear(3, 4)
    assert _compat.compiled_call(module) is None
    module.compile(backend="eager")
    call = _compat.compiled_call(module)
    assert call is not None
    rebound = _compat.recompile_call(call, other)
    assert rebound is not None
    x = torch.randn(2, 3)
    torch.testing.assert_close(rebound(x), other(x), rtol=0, atol=0)


def test_a_compiled_call_set_on_a_shell_is_the_one_its_call_runs() -> None:
    module, shell = nn.Linear(3, 4), nn.Linear(3, 4)
    module.compile(backend="eager")
    compiled = _compat.compiled_call(module)
    assert compiled is not None
    _compat.set_compiled_call(shell, _compat.recompile_call(compiled, shell))
    assert _compat.compiled_call(shell) is not None
    calls: list[int] = []
    shell.register_forward_hook(lambda *_: calls.append(1))
    x = torch.randn(2, 3)
    torch.testing.assert_close(shell(x), torch.nn.functional.linear(x, shell.weight, shell.bias), rtol=0, atol=0)
    assert calls == [1]
    _compat.set_compiled_call(shell, None)
    assert _compat.compiled_call(shell) is None


def test_the_replica_flag_is_torchs(recwarn: pytest.WarningsRecorder) -> None:
    replica = _compat.own_replica(nn.LSTM(2, 2))  # what torch's replicate makes of every module
    assert vars(replica)[_compat.REPLICA_FLAG] is True
    replica.zero_grad()
    assert any("nn.DataParallel" in str(warning.message) for warning in recwarn)


def test_alias_shares_storage_and_passes_gradients_through() -> None:
    param = nn.Parameter(torch.randn(3, 2))
    alias = _compat.alias(param)
    assert alias is not param
    assert alias.data_ptr() == param.data_ptr()
    (alias * 2).sum().backward()
    torch.testing.assert_close(param.grad, torch.full((3, 2), 2.0), rtol=0, atol=0)
    sparse = nn.Embedding(5, 2, sparse=True)
    nn.functional.embedding(torch.tensor([1]), _compat.alias(sparse.weight), sparse=True).sum().backward()
    assert sparse.weight.grad is not None
    assert sparse.weight.grad.is_sparse


@pytest.mark.parametrize(
    ("message", "key", "class_paths"),
    [
        (
            'Parser key "model":\n  Does not validate against any of the types in typing.Union:\n'
            "    - Problem with given class_path 'examples.nope.Model':\n      No module named 'examples.nope'\n"
            "    - Problem with given class_path 'examples.nope.Model':\n",
            "model",
            ["examples.nope.Model"],
        ),
        ("Import of class_path 'a.B' failed; class_path 'c.D' too", None, ["a.B", "c.D"]),
        ("nothing to read here", None, []),
    ],
)
def test_parser_errors_name_their_key_and_class_paths(message: str, key: str | None, class_paths: list[str]) -> None:
    assert _compat.parser_error_facts(message) == (key, class_paths)


@pytest.mark.parametrize(
    ("message", "option"),
    [
        ("Subcommand 'fit' does not accept option 'trainer.max_epoch'", "trainer.max_epoch"),
        (
            "Parser key \"data\":\n  - Problem with given class_path 'a.B':\n      Option 'bach_size' is not accepted",
            "bach_size",
        ),
        ("unrecognized arguments: --trainr.max_epochs 3", "trainr.max_epochs"),
        ("Parser key \"trainer.max_epochs\":\n  Expected a <class 'int'>. Got value: abc", None),
    ],
)
def test_parser_errors_name_the_option_they_reject(message: str, option: str | None) -> None:
    assert _compat.rejected_option(message) == option


def test_parser_errors_name_the_types_expected_and_the_value_given() -> None:
    message = (
        'Parser key "trainer.max_epochs":\n  Does not validate against any of the Union subtypes\n  Subtypes: [<class'
        " 'int'>, <class 'NoneType'>]\n  Errors:\n    - Expected a <class 'int'>\n    - Expected a <class 'NoneType'>\n"
        "  Given value type: <class 'str'>\n  Given value: abc"
    )
    assert _compat.rejected_value(message) == (["int", "NoneType"], "abc")
    assert _compat.rejected_value("Subcommand 'fit' does not accept option 'x'") is None


_NESTED_FLOAT = (
    'Parser key "model":\n  Does not validate against any of the Union subtypes\n  Errors:\n    - Problem with given'
    " class_path 'a.Model':\n        Parser key \"lr\":\n          Expected a <class 'float'>. Got value: fast\n"
    "    - Expected a <class 'NoneType'>\n  Given value type: <class 'jsonargparse._util.NestedArg'>\n"
    "  Given value: NestedArg(key='lr', val='fast')"
)
_NESTED_OPTIONAL = (
    "Parser key \"trainer.strategy\":\n  Errors:\n    - Expected a <class 'str'>\n    - Problem with given class_path"
    " 'a.Strategy':\n        Parser key \"weights\":\n          Does not validate against any of the Union subtypes\n"
    "          Errors:\n            - Expected a <class 'collections.abc.Sequence'>\n            - Expected a <class"
    " 'NoneType'>\n          Given value type: <class 'int'>\n          Given value: 3\n  Given value type: <class"
    " 'dict'>\n  Given value: {'class_path': 'a.Strategy', 'init_args': {'weights': 3}}"
)
_NESTED_LITERAL = (
    "    - Problem with given class_path 'a.Strategy':\n        Parser key \"start_method\":\n          Expected a"
    " typing.Literal['popen', 'spawn']. Got value: forks\n  Given value: NestedArg(key='start_method', val='forks')"
)


@pytest.mark.parametrize(
    ("message", "facts"),
    [
        (_NESTED_FLOAT, ("a.Model", "lr", "float", "fast")),
        (_NESTED_OPTIONAL, ("a.Strategy", "weights", "collections.abc.Sequence", 3)),
        (_NESTED_LITERAL, ("a.Strategy", "start_method", "Literal['popen', 'spawn']", "forks")),
        ("Parser key \"trainer.max_epochs\":\n  Expected a <class 'int'>. Got value: abc", None),
    ],
)
def test_parser_errors_name_the_init_argument_its_type_and_the_value_given(
    message: str, facts: tuple[str, str, str, object] | None
) -> None:
    assert _compat.rejected_init_value(message) == facts


def test_parser_errors_name_init_args_given_without_a_class() -> None:
    by_name = (
        "Parser key \"trainer.strategy\":\n  Errors:\n    - Expected a <class 'str'>\n    - Expected a dot import"
        " path string: mgpu_dp\n  Given value: NestedArg(key='sync_batchnorm', val=[1, 2])"
    )
    assert _compat.not_a_class_path(by_name) == "mgpu_dp"
    assert _compat.given_init_args(by_name) == {"sync_batchnorm": [1, 2]}
    in_a_config = (
        'Parser key "trainer.strategy":\n  Errors:\n    - Not a valid subclass of Strategy\n  Given value type: <class'
        " 'dict'>\n  Given value: {'init_args': {'oops': 3}}"
    )
    assert _compat.not_a_class_path(in_a_config) == ""
    assert _compat.given_init_args(in_a_config) == {"oops": 3}
    assert _compat.not_a_class_path(_NESTED_FLOAT) is None


@pytest.mark.filterwarnings("ignore:.*weight_norm.*is deprecated:FutureWarning")
def test_attributes_rewritten_by_torch_hooks_are_named() -> None:
    legacy = torch.nn.utils.weight_norm(nn.Linear(3, 4))  # the form that recomputes ``weight`` in a pre-hook
    assert "weight" in _compat.names_rewritten_by_hooks(legacy, _is_torch_class)
    assert _compat.names_rewritten_by_hooks(legacy, lambda cls: False) == set()
    assert _compat.names_rewritten_by_hooks(nn.Linear(3, 4), _is_torch_class) == set()


def _is_torch_class(cls: type) -> bool:
    return cls.__module__.partition(".")[0] == "torch"


def test_function_mode_depth_counts_active_modes() -> None:
    from torch.overrides import TorchFunctionMode

    outside = _compat.function_mode_depth()
    assert outside == 0
    with TorchFunctionMode():
        assert _compat.function_mode_depth() == 1


def test_the_default_device_reads_device_blocks_on_every_supported_torch() -> None:
    assert _compat.default_device() == torch.device("cpu")
    with torch.device("meta"):
        assert _compat.default_device() == torch.device("meta")
        assert torch.empty(1).device == torch.device("meta")
    assert _compat.default_device() == torch.device("cpu")


def test_the_batchnorm_base_class() -> None:
    for layer in (nn.BatchNorm1d(3), nn.BatchNorm2d(3), nn.SyncBatchNorm(3), nn.LazyBatchNorm1d()):
        assert isinstance(layer, _compat.BatchNorm), type(layer).__name__
    assert not isinstance(nn.LayerNorm(3), _compat.BatchNorm)


@pytest.mark.parametrize("fullgraph", [True, False])
def test_compiled_with_fullgraph_reads_both_ways_of_compiling(fullgraph: bool) -> None:
    in_place = nn.Linear(2, 2)
    in_place.compile(fullgraph=fullgraph, backend="eager")
    assert _compat.compiled_with_fullgraph(in_place) is fullgraph
    wrapped = torch.compile(nn.Linear(2, 2), fullgraph=fullgraph, backend="eager")
    assert _compat.compiled_with_fullgraph(wrapped) is fullgraph
    assert not _compat.compiled_with_fullgraph(nn.Linear(2, 2))


def test_a_replica_device_is_what_the_lightning_module_reports() -> None:
    module = pl.LightningModule()
    assert module.device == torch.device("cpu")
    _compat.set_lightning_device(module, torch.device("meta"))
    assert module.device == torch.device("meta")


class _HalfUsed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(3, 1)
        self.unused = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def test_ddps_unused_parameter_error_is_recognised_with_its_indices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    assert not dist.is_initialized()
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        model = nn.parallel.DistributedDataParallel(_HalfUsed())
        model(torch.randn(2, 3)).sum().backward()
        with pytest.raises(RuntimeError) as caught:
            model(torch.randn(2, 3)).sum().backward()
    finally:
        dist.destroy_process_group()
    message = str(caught.value)
    assert _compat.is_unused_parameters_error(message)
    assert _compat.unused_parameter_indices(message) == [2, 3]  # unused.weight, unused.bias
    assert not _compat.is_unused_parameters_error("CUDA out of memory")
    assert _compat.unused_parameter_indices("CUDA out of memory") == []


# ---------------------------------------------------------------------------------- Lightning and torchmetrics


class _Counting(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)
        self.done: list[int] = []

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0]).sum()

    def on_train_batch_end(self, outputs: object, batch: object, batch_idx: int) -> None:
        self.done.append(_compat.batches_done_in_epoch(self.trainer))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_batches_done_in_epoch_counts_the_running_batch() -> None:
    module = _Counting()
    loader = DataLoader(TensorDataset(torch.randn(6, 2)), batch_size=2)
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    trainer.fit(module, loader)
    assert module.done == [1, 2, 3, 1, 2, 3]


class _SeeingTheLastBatch(_Counting):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.last: list[bool] = []

    def on_train_batch_end(self, outputs: object, batch: object, batch_idx: int) -> None:
        self.last.append(_compat.last_batch_started(self.trainer))


@pytest.mark.parametrize("sized", [True, False], ids=["TensorDataset", "IterableDataset"])
def test_last_batch_started_holds_from_the_last_batch_of_each_epoch(sized: bool) -> None:
    module = _SeeingTheLastBatch()
    data = regression_data(rows=6) if sized else RegressionStream(rows=6)
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    trainer.fit(module, DataLoader(data, batch_size=2))
    assert module.last == [False, False, True, False, False, True]


def test_the_saved_states_of_stateful_training_dataloaders_are_found(tmp_path: Path) -> None:
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=2, logger=False, enable_progress_bar=False, default_root_dir=str(tmp_path)
    )
    trainer.fit(_Counting(), PositionKeepingLoader(TensorDataset(torch.randn(6, 2)), batch_size=2))
    checkpoint = torch.load(trainer.checkpoint_callback.best_model_path, weights_only=False)
    saved = _compat.saved_dataloader_states(checkpoint)
    assert saved == [{"yielded": 2, "seed": None}]  # not shuffled: no seed to keep
    assert _compat.saved_dataloader_states({}) == []


class _Weighted(pl.LightningModule):
    """Logs 1, 10, 2 in three batches of two rows; the second batch is made to count for nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)
        self.batches_seen: list[bool] = []

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        trainer = self.trainer
        self.batches_seen.append(_compat.training_batch(trainer) is batch)
        saved = _compat.epoch_aggregates(trainer)
        if batch_idx == 1:
            _compat.set_logged_batch_size(trainer, 0)
        value = torch.tensor([1.0, 10.0, 2.0][batch_idx])
        self.log("mean", value, on_step=False, on_epoch=True)
        self.log("total", value, reduce_fx="sum", on_step=False, on_epoch=True)
        self.log("top", value, reduce_fx="max", on_step=False, on_epoch=True)
        if batch_idx == 1:
            self.log("only_here", value, reduce_fx="sum", on_step=False, on_epoch=True)
            _compat.restore_epoch_aggregates(trainer, saved)
        return self.layer(batch[0]).sum()

    def on_train_epoch_end(self) -> None:
        self.batches_seen.append(_compat.training_batch(self.trainer) is None)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_logged_batch_size_and_epoch_aggregates_let_a_batch_count_for_nothing(tmp_path: object) -> None:
    module = _Weighted()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=str(tmp_path),
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(TensorDataset(torch.randn(6, 2)), batch_size=2))
    assert module.batches_seen == [True, True, True, True], "the batch while it runs, None after the epoch"
    metrics = {key: float(value) for key, value in trainer.callback_metrics.items()}
    assert metrics == {"mean": 1.5, "total": 3.0, "top": 2.0, "only_here": 0.0}


def test_a_strategy_says_whether_it_will_convert_batchnorm_to_sync() -> None:
    for sync in (True, False):
        built = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", sync_batchnorm=sync, logger=False)
        assert _compat.converts_batchnorm_to_sync(built.strategy) is sync


def test_the_layer_converter_that_lightnings_ddp_setup_applies_is_the_one_set(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from models import trainer

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    built = trainer(tmp_path, strategy="ddp", sync_batchnorm=True, max_steps=1)
    assert type(_compat.layer_sync(built.strategy)) is TorchSyncBatchNorm
    applied: list[nn.Module] = []

    class Recording(TorchSyncBatchNorm):
        def apply(self, model: nn.Module) -> nn.Module:
            applied.append(model)
            return model

    _compat.set_layer_sync(built.strategy, Recording())
    module = _BatchNormModule()
    try:
        built.fit(module, DataLoader(TensorDataset(torch.randn(4, 3)), batch_size=2))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert applied == [module], "Lightning's DDPStrategy.setup applied the converter set, to the module"
    assert isinstance(module.norm, nn.BatchNorm1d), "no other converter ran"


class _BatchNormModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(3)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.norm(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Hooked(pl.LightningModule):
    """Builds its training DataLoader in ``train_dataloader`` with a batch_sampler, and keeps what it returned."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(1, 1)
        self.built: list[DataLoader] = []

    def train_dataloader(self) -> DataLoader:
        data = _dataset(6)
        self.built.append(DataLoader(data, batch_sampler=BatchSampler(SequentialSampler(data), 3, drop_last=False)))
        return self.built[-1]

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0].unsqueeze(1)).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_the_training_data_is_seen_as_built_before_lightning_rebuilds_it(tmp_path: object) -> None:
    seen: list[object] = []
    stops: list[Callable[[], None]] = []

    class Watch(pl.Callback):
        def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
            stops.append(_compat.watch_training_data(trainer, seen.append))

    module = _Hooked()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy="ddp",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        callbacks=[Watch()],
    )
    trainer.fit(module)
    assert seen == module.built, "the DataLoader the hook returned, once"
    assert trainer.train_dataloader is not module.built[0], "Lightning trains on a rebuilt copy"
    assert "dataloader" in vars(trainer.fit_loop._data_source)
    stops[0]()
    assert "dataloader" not in vars(trainer.fit_loop._data_source), "stopping leaves the data source as it was"


def test_only_the_forward_lightning_leaves_behind_is_dropped() -> None:
    left = nn.Linear(2, 2)
    left.__dict__["forward"] = left.forward  # what undoing Lightning's DDP forward redirection leaves
    _compat.drop_forward_left_by_lightning(left)
    assert "forward" not in vars(left)

    def own(x: torch.Tensor) -> torch.Tensor:
        return x

    chosen = nn.Linear(2, 2)
    chosen.__dict__["forward"] = own  # a forward the module's own code set stays
    _compat.drop_forward_left_by_lightning(chosen)
    assert vars(chosen)["forward"] is own


def test_the_version_counter_counts_in_place_changes_and_reads_minus_one_for_inference_tensors() -> None:
    tensor = torch.zeros(2)
    before = _compat.version_counter(tensor)
    tensor += 1
    tensor.mul_(2)
    assert _compat.version_counter(tensor) == before + 2
    tensor = tensor + 1  # a new tensor: its own count
    assert _compat.version_counter(tensor) == 0
    with torch.inference_mode():
        made_there = torch.zeros(2)
        made_there += 1
    assert _compat.version_counter(made_there) == -1


def test_a_metrics_update_count_cached_value_and_step_value_are_set_where_torchmetrics_reads_them() -> None:
    import torchmetrics

    metric = torchmetrics.SumMetric()
    metric.update(torch.tensor(2.0))
    assert metric.compute() == 2.0
    metric.sum_value = torch.tensor(5.0)  # a merged state, which the cached value does not know
    assert metric.compute() == 2.0
    _compat.forget_computed(metric)
    assert metric.compute() == 5.0
    _compat.set_update_count(metric, 3)
    assert metric.update_count == 3
    _compat.set_forward_value(metric, torch.tensor(7.0))
    assert metric(torch.tensor(1.0)) == 1.0  # a call replaces it, as the field Lightning logs a step value from
    _compat.set_forward_value(metric, torch.tensor(7.0))
    assert metric._forward_cache == 7.0


def test_caller_module_names_the_module_of_the_calling_function() -> None:
    def asks() -> str:
        return _compat.caller_module(1)

    assert asks() == __name__
    assert _compat.caller_module(0) == __name__


@pytest.mark.parametrize("weighted", [True, False])
def test_batch_norm_backward_parts_are_the_gradient_for_fixed_statistics_and_its_two_sums(weighted: bool) -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 4, 2, dtype=torch.float64, generator=generator) * 2 + 1
    grad = torch.randn(x.shape, dtype=torch.float64, generator=generator)
    weight = torch.rand(3, dtype=torch.float64, generator=generator) + 0.5 if weighted else None
    mean, variance = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64), torch.tensor([1.5, 0.7, 3.0]).double()
    held, normalised_sum, plain_sum = _compat.batch_norm_backward_parts(grad, x, weight, mean, variance, 1e-3)
    shape = (1, 3, 1, 1)
    inverse_std = (variance + 1e-3).rsqrt()
    scale = inverse_std if weight is None else weight * inverse_std
    torch.testing.assert_close(held, grad * scale.view(shape), atol=1e-12, rtol=0)
    normalised = (x - mean.view(shape)) * inverse_std.view(shape)
    torch.testing.assert_close(normalised_sum, (grad * normalised).sum((0, 2, 3)), atol=1e-12, rtol=0)
    torch.testing.assert_close(plain_sum, grad.sum((0, 2, 3)), atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_move_averages_updates_every_tensor_as_the_one_tensor_ops_do(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    averages = [torch.randn(3, dtype=dtype, generator=generator), torch.rand(5, dtype=dtype, generator=generator)]
    values = [torch.randn(3, dtype=dtype, generator=generator), torch.rand(5, dtype=dtype, generator=generator)]
    expected = [
        average.clone().mul_(1 - 0.1).add_(value, alpha=0.1) for average, value in zip(averages, values, strict=True)
    ]
    _compat.move_averages_(averages, values, 0.1)
    for after, wanted in zip(averages, expected, strict=True):  # the tensors given, updated in place
        torch.testing.assert_close(after, wanted, atol=0, rtol=0)


def test_copy_all_copies_every_tensor_in_place_as_copy_does() -> None:
    generator = torch.Generator().manual_seed(0)
    targets = [torch.zeros(3), torch.zeros((), dtype=torch.long), torch.zeros(2, 2, dtype=torch.float64)]
    values = [torch.randn(3, generator=generator), torch.tensor(7), torch.randn(2, 2, dtype=torch.float64)]
    storages = [target.data_ptr() for target in targets]
    _compat.copy_all_(targets, values)
    for target, value, storage in zip(targets, values, storages, strict=True):
        assert target.data_ptr() == storage  # the tensors given, written in place
        torch.testing.assert_close(target, value, atol=0, rtol=0)


@pytest.mark.parametrize("namespace", ["lightning.pytorch", "pytorch_lightning"])
def test_log_checker_raises_what_self_log_raises_and_leaves_the_trainers_results_alone(namespace: str) -> None:
    import pytorch_lightning
    import pytorch_lightning.utilities.exceptions
    import torchmetrics
    from lightning.pytorch.utilities import exceptions as pl_exceptions
    from models import PLRegressor, Regressor, loader, pl_trainer, regression_data, trainer

    base, build, lightning_module, misconfiguration = {
        "lightning.pytorch": (Regressor, trainer, pl.LightningModule, pl_exceptions.MisconfigurationException),
        "pytorch_lightning": (
            PLRegressor,
            pl_trainer,
            pytorch_lightning.LightningModule,
            pytorch_lightning.utilities.exceptions.MisconfigurationException,
        ),
    }[namespace]
    outcomes: list[BaseException | None] = []
    seen: list[tuple[list[str], object]] = []

    class Checks(base):  # type: ignore[misc,valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.total = torchmetrics.SumMetric()

        def training_step(self, batch: object, batch_idx: int) -> torch.Tensor:
            check = _compat.log_checker(self, lightning_module.log)
            calls: list[tuple[tuple[object, ...], dict[str, object]]] = [
                (("x", None), {}),
                (("k", 1.0), {}),
                (("k", 2.0), {}),
                (("t", self.total), {}),  # one of the module's metrics
                (("k", 3.0), {"prog_bar": True}),  # other arguments than this step's "k" before
            ]
            if batch_idx == 1:
                calls = [(("j", 1.0), {"prog_bar": True})]  # other arguments than "j" had in the step before
            for args, kwargs in calls:
                try:
                    check(*args, **kwargs)
                except Exception as error:  # noqa: BLE001 - the outcome compared
                    outcomes.append(error)
                else:
                    outcomes.append(None)
            if batch_idx == 0:
                seen.append((sorted(self.trainer._results), self._metric_attributes))
            self.log("j", 1.0)
            return super().training_step(batch, batch_idx)

    build(max_steps=2).fit(Checks(), loader(regression_data(rows=8), 4))
    none, first, again, metric, other_prog_bar, other_than_before = outcomes
    assert isinstance(none, ValueError)
    assert str(none) == "`self.log(x, None)` was called, but `NoneType` values cannot be logged"
    assert (first, again, metric) == (None, None, None)
    twice = "You called `self.log({}, ...)` twice in `training_step` with different arguments. This is not allowed"
    for error, name in ((other_prog_bar, "k"), (other_than_before, "j")):
        assert isinstance(error, misconfiguration)
        assert str(error) == twice.format(name)
    assert seen == [([], None)], "nothing recorded into the Trainer's results, nothing cached on the module"


def test_log_checker_checks_a_call_like_one_that_passed_only_for_its_arguments_against_the_steps_others() -> None:
    from lightning.pytorch.utilities.exceptions import MisconfigurationException
    from models import Regressor, loader, regression_data, trainer

    checked: list[str] = []
    outcomes: dict[int, list[BaseException | None]] = {0: [], 1: []}

    @functools.wraps(pl.LightningModule.log)  # its parameters, by which a call's arguments are read
    def counting_log(module: pl.LightningModule, name: str, *args: object, **kwargs: object) -> None:
        checked.append(name)
        pl.LightningModule.log(module, name, *args, **kwargs)

    class Checks(Regressor):
        def training_step(self, batch: object, batch_idx: int) -> torch.Tensor:
            check = _compat.log_checker(self, counting_log)
            calls: list[tuple[tuple[object, ...], dict[str, object]]] = [
                (("m", 1.0), {}),
                (("s", torch.tensor(2.0)), {}),
                (("s", torch.tensor(3.0)), {}),  # like the call before: not checked again
            ]
            if batch_idx == 1:
                calls = [
                    (("s", torch.tensor(4.0)), {}),  # like the calls of the step before
                    (("m", 1.0), {"prog_bar": True}),  # new arguments: checked, and passes (nothing logged "m")
                    (("m", 2.0), {}),  # like a call that passed, but "m" was logged with other arguments above
                    (("s", torch.ones(2)), {}),  # two elements, where the calls that passed held one
                ]
            for args, kwargs in calls:
                try:
                    check(*args, **kwargs)
                except Exception as error:  # noqa: BLE001 - the outcome compared
                    outcomes[batch_idx].append(error)
                else:
                    outcomes[batch_idx].append(None)
            return super().training_step(batch, batch_idx)

    trainer(max_steps=2).fit(Checks(), loader(regression_data(rows=8), 4))
    assert outcomes[0] == [None, None, None]
    like_before, new_arguments, other_than_above, two_elements = outcomes[1]
    assert (like_before, new_arguments) == (None, None)
    assert isinstance(other_than_above, MisconfigurationException)
    assert str(other_than_above) == (
        "You called `self.log(m, ...)` twice in `training_step` with different arguments. This is not allowed"
    )
    assert isinstance(two_elements, ValueError)
    assert "the tensor must have a single element" in str(two_elements)
    assert checked == ["m", "s", "m", "s"], "each call checked by Lightning once per kind of call"


def test_log_checker_checks_a_metric_logged_like_before_only_for_its_arguments_and_another_metric_in_full() -> None:
    import torchmetrics
    from lightning.pytorch.utilities.exceptions import MisconfigurationException
    from models import Regressor, loader, regression_data, trainer

    checked: list[str] = []
    outcomes: list[BaseException | None] = []

    @functools.wraps(pl.LightningModule.log)  # its parameters, by which a call's arguments are read
    def counting_log(module: pl.LightningModule, name: str, *args: object, **kwargs: object) -> None:
        checked.append(name)
        pl.LightningModule.log(module, name, *args, **kwargs)

    class Checks(Regressor):
        def __init__(self) -> None:
            super().__init__()
            self.first = torchmetrics.SumMetric()
            self.second = torchmetrics.SumMetric()

        def training_step(self, batch: object, batch_idx: int) -> torch.Tensor:
            check = _compat.log_checker(self, counting_log)
            calls: list[tuple[tuple[object, ...], dict[str, object]]] = [(("a", self.first), {})]
            if batch_idx == 1:
                calls = [
                    (("a", self.first), {}),  # like the call of the step before: not checked again
                    (("b", self.second), {}),  # another metric: checked
                    (("a", self.first), {"prog_bar": True}),  # other arguments than "a" had above
                    (("c", torchmetrics.SumMetric()), {}),  # a metric of no attribute: Lightning's error
                ]
            for args, kwargs in calls:
                try:
                    check(*args, **kwargs)
                except Exception as error:  # noqa: BLE001 - the outcome compared
                    outcomes.append(error)
                else:
                    outcomes.append(None)
            return super().training_step(batch, batch_idx)

    trainer(max_steps=2).fit(Checks(), loader(regression_data(rows=8), 4))
    assert outcomes[:3] == [None, None, None]
    other_than_above, no_attribute = outcomes[3:]
    assert isinstance(other_than_above, MisconfigurationException)
    assert "twice in `training_step` with different arguments" in str(other_than_above)
    assert isinstance(no_attribute, MisconfigurationException)
    assert "Could not find the `LightningModule` attribute" in str(no_attribute)
    assert checked == ["a", "b", "a", "c"], "a metric logged like before is checked by Lightning once"
