"""A launch whose process counts disagree with Trainer(devices=..., num_nodes=...) fails on every rank at once.

Without the check, such a launch waits for ranks that do not exist until the collective timeout (30 minutes by
default), or fails with an error that names neither number.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import pytorch_lightning as pl
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.environments import (
    KubeflowEnvironment,
    LightningEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
)
from processes import clean_env, free_port

from lightning_mgpu import ConfigurationError, MGPUDDPStrategy
from lightning_mgpu.strategies.launch_checks import check_launch_matches_trainer

SCRIPT = Path(__file__).parent / "scripts" / "launch_mismatch.py"
FAIL_FAST_S = 60
"""Far below the 30-minute collective timeout a mismatch would otherwise wait for."""

_LAUNCH_VARIABLES = ("TORCHELASTIC_RUN_ID", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "LOCAL_RANK", "GROUP_RANK",
                     "NODE_RANK")  # fmt: skip


@pytest.fixture
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """This process's environment without any launcher's variables (earlier in-process runs leave LOCAL_RANK)."""
    for name in [*_LAUNCH_VARIABLES, *(key for key in os.environ if key.startswith("SLURM_"))]:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _slurm() -> SLURMEnvironment:
    """A SLURMEnvironment built outside SLURM: its constructor reads only SLURM_NTASKS, absent under ``no_launcher``."""
    return SLURMEnvironment()


def _torchrun(world: int, local: int, **extra: str) -> dict[str, str]:
    return {"TORCHELASTIC_RUN_ID": "none", "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(local), "RANK": "0",
            "LOCAL_RANK": "0", "GROUP_RANK": "0", **extra}  # fmt: skip


def _slurm_vars(**values: str) -> dict[str, str]:
    return {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_JOB_NAME": "train", **values}


AGREEING: dict[str, tuple[str, dict[str, str], int, int]] = {
    "torchrun, one node": ("torchrun", _torchrun(2, 2), 2, 1),
    "torchrun, two nodes": ("torchrun", _torchrun(4, 2, GROUP_RANK="1", RANK="3", LOCAL_RANK="1"), 2, 2),
    "torch.distributed.launch on torch 2 (torchrun underneath)": ("torchrun", _torchrun(2, 2, LOCAL_RANK="1"), 2, 1),
    "legacy launch without torchrun's variables": (
        "lightning", {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}, 2, 1,
    ),
    "a rank that Lightning's own launcher started": (
        "lightning", {"WORLD_SIZE": "2", "LOCAL_RANK": "1", "NODE_RANK": "0"}, 2, 1,
    ),
    "Lightning starts the processes (a stale WORLD_SIZE is not read)": ("lightning", {"WORLD_SIZE": "5"}, 2, 1),
    "SLURM --ntasks-per-node": (
        "slurm", _slurm_vars(SLURM_NTASKS="4", SLURM_NTASKS_PER_NODE="2", SLURM_NNODES="2"), 2, 2,
    ),
    "SLURM tasks per node in SLURM's compressed form": (
        "slurm", _slurm_vars(SLURM_NTASKS="6", SLURM_TASKS_PER_NODE="2(x3)", SLURM_NNODES="3"), 2, 3,
    ),
    "an environment whose variables are not known here": ("kubeflow", {"WORLD_SIZE": "7"}, 2, 1),
}  # fmt: skip

MISMATCHED: dict[str, tuple[str, dict[str, str], int, int, str, str]] = {
    "torchrun started fewer processes": (
        "torchrun", _torchrun(2, 2), 3, 1, "Trainer.devices",
        r"torchrun started 2 processes \(WORLD_SIZE=2\) but Trainer\(devices=3, num_nodes=1\) expects 3\n"
        r".*torchrun started 2 processes per node \(LOCAL_WORLD_SIZE=2\) .* expects 3 per node"
        r"(.|\n)*Fix: start torchrun with --nproc-per-node 3 --nnodes 1 .* or build the Trainer with devices=2,"
        r" num_nodes=1",
    ),
    "torchrun started more processes": (
        "torchrun", _torchrun(2, 2), 1, 1, "Trainer.devices",
        r"torchrun started 2 processes \(WORLD_SIZE=2\) but Trainer\(devices=1, num_nodes=1\) expects 1",
    ),
    "torchrun with the right total but the wrong split over nodes": (
        "torchrun", _torchrun(2, 1, GROUP_RANK="1"), 2, 1, "Trainer.devices",
        r"torchrun started 1 process per node \(LOCAL_WORLD_SIZE=1\) but Trainer\(devices=2, num_nodes=1\) expects 2"
        r" per node\n.*torchrun runs on 2 nodes \(WORLD_SIZE=2 / LOCAL_WORLD_SIZE=1\) but .* expects 1"
        r"(.|\n)*or build the Trainer with devices=1, num_nodes=2",
    ),
    "torchrun on two nodes, the Trainer told one": (
        "torchrun", _torchrun(4, 2), 2, 1, "Trainer.num_nodes",
        r"torchrun started 4 processes \(WORLD_SIZE=4\) but Trainer\(devices=2, num_nodes=1\) expects 2\n"
        r".*torchrun runs on 2 nodes \(WORLD_SIZE=4 / LOCAL_WORLD_SIZE=2\) .* expects 1",
    ),
    "legacy launch with more processes than devices": (
        "lightning", {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}, 1, 1, "Trainer.devices",
        r"the launcher started 2 processes \(WORLD_SIZE=2\) but Trainer\(devices=1, num_nodes=1\) expects 1\n"
        r".*this process has local rank 1 \(LOCAL_RANK=1\) but .* allows local rank 0 only",
    ),
    "legacy launch with fewer processes than devices": (
        "lightning", {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}, 3, 1, "Trainer.devices",
        r"the launcher started 2 processes \(WORLD_SIZE=2\) but Trainer\(devices=3, num_nodes=1\) expects 3"
        r"(.|\n)*Fix: start 3 processes per node on 1 node \(WORLD_SIZE=3,",
    ),
    "hand-made launch on a second node the Trainer does not know": (
        "lightning", {"LOCAL_RANK": "0", "NODE_RANK": "1"}, 2, 1, "Trainer.num_nodes",
        r"this process has node rank 1 \(NODE_RANK=1\) but Trainer\(devices=2, num_nodes=1\) allows node rank 0 only",
    ),
    "SLURM started fewer tasks": (
        "slurm", _slurm_vars(SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2", SLURM_NNODES="1"), 3, 1, "Trainer.devices",
        r"SLURM started 2 processes \(SLURM_NTASKS=2\) but Trainer\(devices=3, num_nodes=1\) expects 3\n"
        r".*SLURM started 2 processes per node \(SLURM_NTASKS_PER_NODE=2\) .* expects 3 per node"
        r"(.|\n)*Fix: ask SLURM for --ntasks-per-node=3 --nodes=1 .* or build the Trainer with devices=2, num_nodes=1",
    ),
    "SLURM nodes with different task counts": (
        "slurm", _slurm_vars(SLURM_NTASKS="5", SLURM_TASKS_PER_NODE="2(x2),1", SLURM_NNODES="3"), 2, 3,
        "Trainer.devices",
        r"SLURM started 5 processes \(SLURM_NTASKS=5\) .* expects 6\n"
        r".*SLURM started 2, 2 and 1 processes \(SLURM_TASKS_PER_NODE=2\(x2\),1\) .* expects 2 per node",
    ),
    "SLURM allocated more nodes": (
        "slurm", _slurm_vars(SLURM_NTASKS="4", SLURM_NTASKS_PER_NODE="2", SLURM_JOB_NUM_NODES="2"), 2, 1,
        "Trainer.num_nodes",
        r"SLURM runs on 2 nodes \(SLURM_JOB_NUM_NODES=2\) but Trainer\(devices=2, num_nodes=1\) expects 1",
    ),
}  # fmt: skip


def _environment(kind: str) -> ClusterEnvironment:
    kinds = {"torchrun": TorchElasticEnvironment, "slurm": _slurm, "lightning": LightningEnvironment,
             "kubeflow": KubeflowEnvironment}  # fmt: skip
    return kinds[kind]()


@pytest.mark.usefixtures("no_launcher")
@pytest.mark.parametrize("case", list(AGREEING))
def test_agreeing_counts_pass(case: str) -> None:
    kind, environ, devices, num_nodes = AGREEING[case]
    check_launch_matches_trainer(_environment(kind), devices, num_nodes, environ)


@pytest.mark.usefixtures("no_launcher")
@pytest.mark.parametrize("case", list(MISMATCHED))
def test_each_mismatch_names_both_numbers_their_source_and_the_fix(case: str) -> None:
    kind, environ, devices, num_nodes, setting, message = MISMATCHED[case]
    with pytest.raises(ConfigurationError, match=message) as caught:
        check_launch_matches_trainer(_environment(kind), devices, num_nodes, environ)
    assert caught.value.setting == setting


def test_without_a_cluster_environment_nothing_is_checked() -> None:
    check_launch_matches_trainer(None, 2, 1, {"WORLD_SIZE": "9", "LOCAL_RANK": "7"})


def test_unreadable_variables_leave_their_rule_unchecked(no_launcher: pytest.MonkeyPatch) -> None:
    environ = _slurm_vars(SLURM_NTASKS="2", SLURM_TASKS_PER_NODE="weird", SLURM_NNODES="1", SLURM_LOCALID="1")
    check_launch_matches_trainer(_slurm(), 2, 1, environ)
    with pytest.raises(
        ConfigurationError, match=r"local rank 1 \(SLURM_LOCALID=1\) .* allows local rank 0 only"
    ) as caught:
        check_launch_matches_trainer(_slurm(), 1, 2, {**environ, "SLURM_NTASKS": "x"})
    assert caught.value.setting == "Trainer.devices"


@pytest.mark.parametrize("trainer_class", [L.Trainer, pl.Trainer], ids=["lightning.pytorch", "pytorch_lightning"])
def test_the_trainer_raises_while_it_is_built_under_torchrun(
    no_launcher: pytest.MonkeyPatch, trainer_class: type[L.Trainer]
) -> None:
    for name, value in _torchrun(2, 2, MASTER_ADDR="127.0.0.1", MASTER_PORT="1").items():
        no_launcher.setenv(name, value)
    with pytest.raises(ConfigurationError) as caught:
        trainer_class(accelerator="cpu", devices=3, strategy="mgpu_ddp", logger=False)
    assert caught.value.setting == "Trainer.devices"
    trainer = trainer_class(accelerator="cpu", devices=2, strategy="mgpu_ddp", logger=False)
    assert trainer.world_size == 2


@pytest.mark.parametrize("trainer_class", [L.Trainer, pl.Trainer], ids=["lightning.pytorch", "pytorch_lightning"])
def test_the_trainer_raises_while_it_is_built_under_slurm(
    no_launcher: pytest.MonkeyPatch, trainer_class: type[L.Trainer]
) -> None:
    for name, value in _slurm_vars(SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2", SLURM_NNODES="1").items():
        no_launcher.setenv(name, value)
    with pytest.raises(ConfigurationError) as caught:
        trainer_class(accelerator="cpu", devices=1, strategy=MGPUDDPStrategy(), logger=False)
    assert caught.value.setting == "Trainer.devices"


def test_when_lightning_starts_the_processes_nothing_changes(no_launcher: pytest.MonkeyPatch) -> None:
    no_launcher.setenv("WORLD_SIZE", "5")  # read only when a launcher started this process (LOCAL_RANK set)
    trainer = L.Trainer(accelerator="cpu", devices=3, strategy="mgpu_ddp", logger=False)
    assert trainer.world_size == 3
    assert not trainer.strategy.cluster_environment.creates_processes_externally


# Real launchers: every process must exit with the message within seconds, and none may be left behind.


def _launch(runs: list[tuple[list[str], dict[str, str]]]) -> tuple[list[tuple[int, str]], float]:
    """Start every (command, environment) in a session of its own at once; return each exit code and output.

    Fails the test when a run outlives ``FAIL_FAST_S`` or leaves a process of its session behind; every session
    still alive at the end is killed.
    """
    start = time.monotonic()
    processes = [
        subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        for command, env in runs
    ]
    try:
        results = []
        for process in processes:
            remaining = max(1.0, FAIL_FAST_S - (time.monotonic() - start))
            try:
                output, _ = process.communicate(timeout=remaining)
            except subprocess.TimeoutExpired:
                pytest.fail(f"{process.args!r} still ran after {FAIL_FAST_S} s: the mismatch was not caught")
            results.append((process.returncode, output))
        elapsed = time.monotonic() - start
        for process in processes:
            _assert_session_ended(process.pid)
        return results, elapsed
    finally:
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, 9)


def _assert_session_ended(session: int, grace_s: float = 5.0) -> None:
    """No process of the session that ``session`` leads is left (the launcher's children included)."""
    deadline = time.monotonic() + grace_s
    while True:
        try:
            os.killpg(session, 0)
        except ProcessLookupError:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"processes of session {session} are still running after the launch failed")
        time.sleep(0.1)


def _assert_rank_failed_fast(output: str, rank_prefix: str, pattern: str) -> None:
    """The lines of one rank (those starting with ``rank_prefix``) carry the error and both numbers."""
    lines = "\n".join(line[len(rank_prefix) :] for line in output.splitlines() if line.startswith(rank_prefix))
    assert "ConfigurationError" in lines, output[-3000:]
    assert re.search(pattern, lines), output[-3000:]


def _torchrun_command(module: str, *args: str) -> list[str]:
    port = ["--master-port" if module == "torch.distributed.run" else "--master_port", str(free_port())]
    return [sys.executable, "-m", module, *args, *port, "--tee", "3", str(SCRIPT)]


def _two_processes_for(devices: int, launcher: str, variable: str) -> str:
    """The message line for 2 started processes and ``Trainer(devices=devices, num_nodes=1)``."""
    trainer = rf"Trainer\(devices={devices}, num_nodes=1\)"
    return rf"{launcher} started 2 processes \({variable}=2\) but {trainer} expects {devices}"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("module", "devices"),
    [("torch.distributed.run", 3), ("torch.distributed.launch", 1)],
    ids=["torchrun-2-processes-devices-3", "legacy-launch-2-processes-devices-1"],
)
def test_torchrun_with_other_process_counts_fails_fast_on_every_rank(module: str, devices: int) -> None:
    pattern = _two_processes_for(devices, "torchrun", "WORLD_SIZE")
    nproc = "--nproc-per-node" if module == "torch.distributed.run" else "--nproc_per_node"
    command = [*_torchrun_command(module, nproc, "2"), "--devices", str(devices)]
    [(code, output)], elapsed = _launch([(command, clean_env())])
    assert code != 0, output[-3000:]
    for rank in (0, 1):
        _assert_rank_failed_fast(output, f"[default{rank}]:", pattern)
    print(f"{module}, 2 processes, devices={devices}: failed on both ranks in {elapsed:.1f} s")


@pytest.mark.slow
def test_two_torchrun_nodes_for_a_one_node_trainer_fail_fast() -> None:
    """The total (2) matches devices=2 x num_nodes=1, which Lightning accepts; the split over nodes does not."""
    port = str(free_port())
    runs = []
    for node in (0, 1):
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
            "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", port, "--tee", "3",
            str(SCRIPT), "--devices", "2", "--num-nodes", "1",
        ]  # fmt: skip
        runs.append((command, clean_env()))
    results, elapsed = _launch(runs)
    for code, output in results:
        assert code != 0, output[-3000:]
        _assert_rank_failed_fast(
            output, "[default0]:", r"torchrun runs on 2 nodes \(WORLD_SIZE=2 / LOCAL_WORLD_SIZE=1\) but Trainer"
        )
    print(f"two torchrun nodes, Trainer(devices=2, num_nodes=1): failed on both in {elapsed:.1f} s")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("launcher", "devices"),
    [("slurm", 3), ("slurm", 1), ("by hand", 3)],
    ids=["slurm-2-tasks-devices-3", "slurm-2-tasks-devices-1", "hand-made-2-processes-devices-3"],
)
def test_processes_started_with_other_counts_fail_fast_on_every_rank(launcher: str, devices: int) -> None:
    """Two processes started here, as srun or a hand-made launch script would start them."""
    if launcher == "slurm":
        pattern = _two_processes_for(devices, "SLURM", "SLURM_NTASKS")
    else:
        pattern = _two_processes_for(devices, "the launcher", "WORLD_SIZE")
    port = str(free_port())
    runs = []
    for rank in (0, 1):
        if launcher == "slurm":
            env = clean_env(
                SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2", SLURM_NNODES="1", SLURM_NODEID="0",
                SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_JOB_ID="4242", SLURM_JOB_NAME="train",
                SLURM_NODELIST="127.0.0.1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
            )  # fmt: skip
        else:
            env = clean_env(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=port)  # fmt: skip
        runs.append(([sys.executable, str(SCRIPT), "--devices", str(devices)], env))
    results, elapsed = _launch(runs)
    for code, output in results:
        assert code != 0, output[-3000:]
        _assert_rank_failed_fast(output, "", pattern)
    print(f"{launcher}, 2 processes, devices={devices}: failed on both in {elapsed:.1f} s")
