"""mgpu_ddp: two CPU processes with gloo, under every launcher, must match one device."""

from __future__ import annotations

import inspect
import json
import os
import pickle
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch
from models import Regressor, assert_same_parameters, loader, parameters, regression_data, trainer
from processes import (
    DDP_SCRIPT,
    clean_env,
    free_port,
    rank_report,
    run,
    run_ddp_script,
    single_device_parameters,
    still_running,
)
from torch.nn.parallel import DistributedDataParallel

import lightning_mgpu
from lightning_mgpu import MGPUDDPStrategy
from lightning_mgpu.errors import ConfigurationError
from lightning_mgpu.strategies import ddp as ddp_strategy
from lightning_mgpu.strategies import pytorch_lightning as bound_to_pytorch_lightning
from lightning_mgpu.strategies.ddp import buffer_sync_keyword

LAUNCH_TIMEOUT = 180


def _assert_matches_single_device(out: Path, result: subprocess.CompletedProcess, environment: str) -> None:
    assert result.returncode == 0, result.stderr[-3000:]
    reports = [rank_report(out, rank) for rank in (0, 1)]
    assert [r["world_size"] for r in reports] == [2, 2]
    assert {r["environment"] for r in reports} == {environment}
    assert {r["strategy"] for r in reports} == {"MGPUDDPStrategy"}
    assert_same_parameters(torch.load(out / "params.pt"), single_device_parameters())


def _assert_side_by_side_matches_single_device(
    out: Path, runs: list[tuple[list[str], dict[str, str]]], environment: str
) -> None:
    """Start one process per (command, environment) at once, wait for all, and compare the run with one device."""
    pipe = subprocess.PIPE
    processes = [subprocess.Popen(command, env=env, stdout=pipe, stderr=pipe, text=True) for command, env in runs]
    outputs = [process.communicate(timeout=LAUNCH_TIMEOUT) for process in processes]
    codes = [process.returncode for process in processes]
    assert codes == [0] * len(runs), "".join(stderr[-3000:] for _, stderr in outputs)
    _assert_matches_single_device(out, subprocess.CompletedProcess([], 0, "", ""), environment)


@pytest.mark.slow
def test_lightning_launcher_matches_one_device_with_twice_the_batch(tmp_path: Path) -> None:
    result = run_ddp_script(tmp_path)
    _assert_matches_single_device(tmp_path, result, "LightningEnvironment")


@pytest.mark.slow
def test_an_iterable_dataset_is_read_whole_by_every_rank_as_lightnings_ddp_reads_it(tmp_path: Path) -> None:
    """Lightning injects no sampler into an IterableDataset, so both ranks train on the same batches of 2 rows.

    DDP averages two equal gradients: the run equals one device on batches of 2, as Lightning's ``ddp`` does.
    """
    result = run_ddp_script(tmp_path, "--stream")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = regression_data().tensors[0][:, 0].tolist()
    for rank in (0, 1):
        seen = rank_report(tmp_path, rank)["rows"]
        assert sorted(seen) == ["0", "1"]
        assert all(epoch_rows == pytest.approx(rows, abs=0) for epoch_rows in seen.values())
    assert_same_parameters(torch.load(tmp_path / "params.pt"), single_device_parameters(batch=2))


@pytest.mark.slow
def test_torchrun(tmp_path: Path) -> None:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
        str(DDP_SCRIPT), "--out", str(tmp_path), "--model", "Evaluated", "--val-rows", "5",
    ]  # fmt: skip
    _assert_matches_single_device(tmp_path, run(command, clean_env()), "TorchElasticEnvironment")
    assert rank_report(tmp_path, 0)["metrics"]["val_rows"] == 5.0, "validation during fit counts each sample once"


@pytest.mark.slow
def test_legacy_torch_distributed_launch_with_its_local_rank_argument(tmp_path: Path) -> None:
    command = [
        sys.executable, "-m", "torch.distributed.launch", "--nproc_per_node", "2", "--master_port", str(free_port()),
        str(DDP_SCRIPT), "--out", str(tmp_path),
    ]  # fmt: skip
    result = run(command, clean_env())
    _assert_matches_single_device(tmp_path, result, "TorchElasticEnvironment")


@pytest.mark.slow
def test_slurm_environment(tmp_path: Path) -> None:
    port = str(free_port())
    runs: list[tuple[list[str], dict[str, str]]] = []
    for rank in (0, 1):
        env = clean_env(
            SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2", SLURM_NNODES="1", SLURM_NODEID="0",
            SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_JOB_ID="4242", SLURM_JOB_NAME="train",
            SLURM_NODELIST="127.0.0.1", MASTER_PORT=port,
        )  # fmt: skip
        runs.append(([sys.executable, str(DDP_SCRIPT), "--out", str(tmp_path)], env))
    _assert_side_by_side_matches_single_device(tmp_path, runs, "SLURMEnvironment")


@pytest.mark.slow
def test_two_nodes_on_one_machine_through_torchrun(tmp_path: Path) -> None:
    port = str(free_port())
    runs: list[tuple[list[str], dict[str, str]]] = []
    for node in (0, 1):
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
            "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", port,
            str(DDP_SCRIPT), "--out", str(tmp_path), "--devices", "1", "--num-nodes", "2",
        ]  # fmt: skip
        runs.append((command, clean_env()))
    _assert_side_by_side_matches_single_device(tmp_path, runs, "TorchElasticEnvironment")


@pytest.mark.slow
def test_validation_counts_each_sample_once(tmp_path: Path) -> None:
    result = run_ddp_script(tmp_path, "--scenario", "validate", "--model", "Evaluated", "--val-rows", "5")
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = rank_report(tmp_path, 0)["metrics"]
    assert metrics["val_rows"] == 5.0
    expected = trainer().validate(Regressor(), loader(regression_data(rows=5, seed=3), 5), verbose=False)
    assert metrics["val_loss"] == pytest.approx(expected[0]["val_loss"], abs=1e-6)


@pytest.mark.slow
def test_training_shuffles_differently_every_epoch(tmp_path: Path) -> None:
    result = run_ddp_script(tmp_path, "--scenario", "shuffle", "--epochs", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    reports = [rank_report(tmp_path, rank) for rank in (0, 1)]
    for epoch in ("0", "1"):
        seen = sorted(row for report in reports for row in report["rows"][epoch])
        assert seen == [float(i) for i in range(20)], "every row exactly once per epoch"
    assert reports[0]["rows"]["0"] != reports[0]["rows"]["1"]


def _assert_every_process_ends(tmp_path: Path, scenario: str, fail_rank: int) -> subprocess.CompletedProcess:
    started = time.monotonic()
    result = run_ddp_script(
        tmp_path, "--scenario", scenario, "--fail-rank", str(fail_rank), "--timeout", "20", "--epochs", "5", timeout=120
    )
    assert result.returncode != 0
    assert len(list(tmp_path.glob("pid-*"))) == 2
    assert not still_running(tmp_path), "a rank kept running after another one failed"
    assert time.monotonic() - started < 90
    return result


@pytest.mark.slow
@pytest.mark.parametrize("fail_rank", [0, 1])
def test_a_failing_rank_ends_every_process_quickly(tmp_path: Path, fail_rank: int) -> None:
    result = _assert_every_process_ends(tmp_path, "fail", fail_rank)
    assert "fails on purpose" in result.stderr


@pytest.mark.slow
def test_a_rank_that_exits_ends_every_process_quickly(tmp_path: Path) -> None:
    _assert_every_process_ends(tmp_path, "exit", fail_rank=1)


@pytest.mark.slow
def test_unused_parameters_are_named_with_the_fix(tmp_path: Path) -> None:
    result = run_ddp_script(tmp_path, "--model", "Unused", "--timeout", "30")
    assert result.returncode != 0
    assert "received none in the last step: unused_head.weight, unused_head.bias" in result.stderr
    assert "find_unused_parameters=True" in result.stderr
    assert "static_graph=True" in result.stderr


@pytest.mark.slow
def test_checkpoints_move_between_ddp_dp_and_one_device(tmp_path: Path) -> None:
    ddp_out = tmp_path / "ddp"
    result = run_ddp_script(ddp_out, "--epochs", "1")
    assert result.returncode == 0, result.stderr[-3000:]
    ddp_checkpoint = next((ddp_out / "checkpoints").glob("*.ckpt"))
    saved = torch.load(ddp_checkpoint, weights_only=False)
    assert not any(key.startswith("module.") for key in saved["state_dict"])

    loaded = Regressor.load_from_checkpoint(ddp_checkpoint)
    assert_same_parameters(parameters(loaded), torch.load(ddp_out / "params.pt"))
    straight = single_device_parameters(epochs=2)
    for overrides in ({}, {"devices": 2, "strategy": "mgpu_dp"}):
        resumed = Regressor()
        trainer(max_epochs=2, **overrides).fit(resumed, loader(regression_data(), 4), ckpt_path=str(ddp_checkpoint))
        assert_same_parameters(parameters(resumed), straight)

    dp_model = Regressor()
    dp_trainer = trainer(tmp_path, max_epochs=1, devices=2, strategy="mgpu_dp", enable_checkpointing=True)
    dp_trainer.fit(dp_model, loader(regression_data(), 4))
    dp_checkpoint = next(Path(dp_trainer.checkpoint_callback.dirpath).glob("*.ckpt"))
    resumed_out = tmp_path / "resumed"
    result = run_ddp_script(resumed_out, "--ckpt-in", str(dp_checkpoint))
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_parameters(torch.load(resumed_out / "params.pt"), straight)


@pytest.mark.slow
def test_ranks_release_the_process_group_and_exit_cleanly(tmp_path: Path) -> None:
    """Gloo's threads can still need the GIL after fit returns; a rank that reached finalization first got SIGABRT."""
    for attempt in range(3):
        out = tmp_path / str(attempt)
        result = run_ddp_script(out, "--epochs", "1", "--exit-report")
        assert result.returncode == 0, result.stderr[-3000:]
        assert "terminate called" not in result.stderr, f"a rank aborted at exit in attempt {attempt}"
        exits = [json.loads((out / f"exit-rank{rank}.json").read_text()) for rank in (0, 1)]
        assert exits == [{"group_initialized": False}] * 2, "mgpu_ddp destroys the default group at exit"


def test_the_exit_handler_is_registered_once_and_leaves_the_group_of_a_failed_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Failing(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            raise RuntimeError("fails on purpose")

    registered: list[Callable[[], None]] = []
    monkeypatch.setattr(ddp_strategy, "atexit", SimpleNamespace(register=registered.append))
    monkeypatch.setattr(ddp_strategy, "_process_exit", ddp_strategy._ProcessExit())
    try:
        for _ in range(2):
            trainer(strategy="mgpu_ddp", max_steps=1).fit(Regressor(), loader(regression_data(), 4))
        assert registered == [ddp_strategy._release_process_group]
        assert torch.distributed.is_initialized()
        started = time.monotonic()
        registered[0]()
        assert time.monotonic() - started >= ddp_strategy._EXIT_GRACE_S, "gloo's threads get the GIL for a moment"
        assert not torch.distributed.is_initialized()

        with pytest.raises(RuntimeError, match="fails on purpose"):
            trainer(strategy="mgpu_ddp", max_steps=1).fit(Failing(), loader(regression_data(), 4))
        registered[0]()
        assert torch.distributed.is_initialized(), "a rank whose run failed leaves the group to its launcher"
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_defaults_follow_the_recipe_and_raise_no_warning(recwarn: pytest.WarningsRecorder) -> None:
    strategy = MGPUDDPStrategy()
    assert strategy._ddp_kwargs == {
        buffer_sync_keyword(): False,
        "find_unused_parameters": False,
        "static_graph": False,
        "gradient_as_bucket_view": False,
    }
    # torch 2.13 renamed broadcast_buffers to forward_sync_buffers, deprecating the old name; older torch has only it
    renamed = "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    assert buffer_sync_keyword() == ("forward_sync_buffers" if renamed else "broadcast_buffers")
    model = torch.nn.Linear(2, 2)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        wrapped = torch.nn.parallel.DistributedDataParallel(model, **strategy._ddp_kwargs)
        assert getattr(wrapped, buffer_sync_keyword()) is False
    finally:
        torch.distributed.destroy_process_group()
    assert not [w for w in recwarn if issubclass(w.category, FutureWarning)]


def test_buffer_broadcasting_can_be_switched_on_and_other_keywords_pass_through() -> None:
    strategy = MGPUDDPStrategy(broadcast_buffers=True, find_unused_parameters=True, static_graph=False, bucket_cap_mb=5)
    assert strategy._ddp_kwargs == {
        buffer_sync_keyword(): True,
        "find_unused_parameters": True,
        "static_graph": False,
        "gradient_as_bucket_view": False,
        "bucket_cap_mb": 5,
    }
    assert MGPUDDPStrategy(forward_sync_buffers=True).broadcast_buffers is True
    assert MGPUDDPStrategy(broadcast_buffers=True, forward_sync_buffers=None).broadcast_buffers is True


BOTH_NAMESPACES = pytest.mark.parametrize(
    "strategy_class",
    [MGPUDDPStrategy, bound_to_pytorch_lightning.MGPUDDPStrategy],
    ids=["lightning.pytorch", "pytorch_lightning"],
)


@BOTH_NAMESPACES
@pytest.mark.parametrize(
    ("misspelt", "meant", "value"),
    [
        ("find_unused_parameter", "find_unused_parameters", True),  # the strategy's own
        ("broadcast_buffer", "broadcast_buffers", False),
        ("static_graphs", "static_graph", True),
        ("gather_step_ends", "gather_step_end", True),
        ("forward_sync_buffer", "forward_sync_buffers", True),  # torch 2.13's name, taken on any torch
        ("ddp_comm_hooks", "ddp_comm_hook", None),  # Lightning's DDPStrategy's
        ("bucket_cap_m", "bucket_cap_mb", 10),  # DistributedDataParallel's
    ],
)
def test_a_misspelt_keyword_stops_the_build_naming_the_keyword_meant(
    strategy_class: type[MGPUDDPStrategy], misspelt: str, meant: str, value: Any
) -> None:
    with pytest.raises(ConfigurationError, match=f"Did you mean {meant}\\?") as refused:
        strategy_class(**{misspelt: value})
    assert refused.value.setting == f"MGPUDDPStrategy.{misspelt}"
    strategy_class(**{meant: value})


def test_a_misspelt_keyword_is_named_with_where_keywords_come_from() -> None:
    with pytest.raises(ConfigurationError) as refused:
        MGPUDDPStrategy(find_unused_parameter=True)
    assert str(refused.value) == (
        "MGPUDDPStrategy takes no keyword 'find_unused_parameter': neither it, Lightning's DDPStrategy nor torch's"
        f" DistributedDataParallel (torch {torch.__version__}) has one of that name. Did you mean"
        " find_unused_parameters?"
    )


def test_a_keyword_close_to_none_is_refused_with_every_keyword_taken() -> None:
    with pytest.raises(ConfigurationError, match="The keywords it takes: ") as refused:
        MGPUDDPStrategy(colour="red")
    assert refused.value.setting == "MGPUDDPStrategy.colour"
    taken = str(refused.value).rpartition("The keywords it takes: ")[2].rstrip(".").split(", ")
    assert {"uneven_batches", "model_averaging_period", "bucket_cap_mb", "gradient_as_bucket_view"} <= set(taken)
    assert not {"module", "device_ids", "output_device", "self", "kwargs"} & set(taken)


@BOTH_NAMESPACES
@pytest.mark.parametrize(("keyword", "value"), [("device_ids", [0]), ("output_device", 0), ("module", object())])
def test_what_the_strategy_gives_ddp_itself_is_refused_with_why(
    strategy_class: type[MGPUDDPStrategy], keyword: str, value: Any
) -> None:
    with pytest.raises(ConfigurationError, match=r"the strategy gives DistributedDataParallel its module") as refused:
        strategy_class(**{keyword: value})
    assert refused.value.setting == f"MGPUDDPStrategy.{keyword}"
    assert "Choose the devices with Trainer(devices=...)" in str(refused.value)


def test_none_for_what_the_strategy_gives_ddp_is_left_to_the_strategy() -> None:
    # LightningCLI spells out output_device: null in a class_path config's init_args
    strategy = MGPUDDPStrategy(output_device=None, device_ids=None, module=None, bucket_cap_mb=10)
    assert strategy._ddp_kwargs["bucket_cap_mb"] == 10
    assert not {"output_device", "device_ids", "module"} & set(strategy._ddp_kwargs)


class _WithAKeywordOfItsOwn(MGPUDDPStrategy):
    def __init__(self, gather_step_end: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.gather_step_end = gather_step_end


def test_a_keyword_the_strategy_class_adds_is_suggested_without_a_list_to_update() -> None:
    with pytest.raises(ConfigurationError, match=r"Did you mean gather_step_end\?"):
        _WithAKeywordOfItsOwn(gather_step_ends=True)
    assert _WithAKeywordOfItsOwn(gather_step_end=True).gather_step_end


def test_registration_leaves_lightnings_own_ddp_names_alone() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    assert StrategyRegistry["mgpu_ddp"]["strategy"] is MGPUDDPStrategy
    assert StrategyRegistry["ddp"]["strategy"] is L.pytorch.strategies.DDPStrategy
    assert StrategyRegistry["ddp_spawn"]["strategy"] is L.pytorch.strategies.DDPStrategy


_LIGHTNING_DDP_NAMES = [
    "ddp_spawn",
    "ddp_fork",
    "ddp_notebook",
    "ddp_find_unused_parameters_false",
    "ddp_find_unused_parameters_true",
    "ddp_spawn_find_unused_parameters_false",
    "ddp_spawn_find_unused_parameters_true",
    "ddp_fork_find_unused_parameters_false",
    "ddp_fork_find_unused_parameters_true",
    "ddp_notebook_find_unused_parameters_false",
    "ddp_notebook_find_unused_parameters_true",
]


@pytest.mark.parametrize("lightning_name", _LIGHTNING_DDP_NAMES)
def test_each_of_lightnings_ddp_names_has_an_mgpu_counterpart_with_its_settings(lightning_name: str) -> None:
    def built(name: str) -> L.pytorch.strategies.DDPStrategy:
        return L.Trainer(accelerator="cpu", devices=2, strategy=name, logger=False).strategy

    ours, lightnings = built(f"mgpu_{lightning_name}"), built(lightning_name)
    assert type(ours) is MGPUDDPStrategy
    assert ours._start_method == lightnings._start_method
    unused = "find_unused_parameters"
    assert ours._ddp_kwargs.get(unused, False) == lightnings._ddp_kwargs.get(unused, False)  # DDP's default: False


class _UnusedBranch(Regressor):
    """Has a layer no step uses: DDP's reducer fails on it unless told to look for unused parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = torch.nn.Linear(4, 1)


@pytest.mark.slow
def test_mgpu_ddp_spawn_find_unused_parameters_true_trains_a_model_with_an_unused_layer(tmp_path: Path) -> None:
    model = _UnusedBranch()
    before = parameters(model)
    run = trainer(tmp_path, devices=2, max_epochs=2, strategy="mgpu_ddp_spawn_find_unused_parameters_true")
    run.fit(model, loader(regression_data(), 4))
    after = parameters(model)  # the spawned rank 0's weights, brought back to this process
    assert torch.isfinite(run.callback_metrics["train_loss"])
    assert not torch.equal(after["net.0.weight"], before["net.0.weight"])
    assert torch.equal(after["unused.weight"], before["unused.weight"])


@pytest.mark.parametrize("strategy", ["mgpu_ddp", "instance"])
def test_trainer_accepts_the_name_and_an_instance(strategy: str) -> None:
    chosen = MGPUDDPStrategy(find_unused_parameters=True) if strategy == "instance" else strategy
    built = L.Trainer(accelerator="cpu", devices=2, strategy=chosen, logger=False)
    assert isinstance(built.strategy, MGPUDDPStrategy)
    assert built.strategy.num_processes == 2


def test_cuda_devices_the_machine_lacks_fail_before_any_process_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    devices = [torch.device("cuda", 0), torch.device("cuda", 1)]
    with pytest.raises(lightning_mgpu.ConfigurationError) as caught:
        MGPUDDPStrategy(parallel_devices=devices)
    assert caught.value.setting == "Trainer.devices"


def test_a_configuration_error_keeps_its_setting_when_pickled() -> None:
    sent = lightning_mgpu.ConfigurationError("num_nodes=2 is refused", setting="Trainer.num_nodes")
    error = pickle.loads(pickle.dumps(sent))
    assert (type(error), str(error), error.setting) == (
        lightning_mgpu.ConfigurationError,
        str(sent),
        "Trainer.num_nodes",
    )


def test_parse_local_rank_accepts_both_spellings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "environ", dict(os.environ))  # parse_local_rank sets LOCAL_RANK; keep it in this test
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert lightning_mgpu.parse_local_rank(["train.py", "--local-rank=3", "--lr", "1"]) == 3
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert lightning_mgpu.parse_local_rank(["train.py", "--local_rank", "2"]) == 2
    monkeypatch.setenv("LOCAL_RANK", "5")
    assert lightning_mgpu.parse_local_rank(["train.py"]) == 5
    monkeypatch.setattr(sys, "argv", ["train.py", "fit", "--local_rank=1", "--config", "c.yaml"])
    assert lightning_mgpu.parse_local_rank() == 1
    assert sys.argv == ["train.py", "fit", "--config", "c.yaml"]


def test_stop_iteration_in_a_step_stops_training_with_an_error() -> None:
    class Exhausted(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            next(iter(torch.nn.Identity().parameters()))
            return super().training_step(batch, batch_idx)

    ddp_trainer = trainer(strategy="mgpu_ddp", devices=1, max_steps=2)
    with pytest.raises(RuntimeError, match=r"StopIteration was raised inside training_step.*ended silently"):
        ddp_trainer.fit(Exhausted(), loader(regression_data(), 4))
    assert ddp_trainer.global_step == 0
