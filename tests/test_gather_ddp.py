"""``MGPUDDPStrategy(gather_step_end=True)``: a loss or metric over the whole batch under ``mgpu_ddp`` is one device's.

tests/scripts/gather_ddp_train.py trains each model of tests/batch_losses.py on 2 and 3 gloo processes with
``uneven_batches=True`` (23 training rows in steps of 4 rows per rank: the last step uneven, on 3 ranks a rank with a
padding row... or none); here the same model trains on one device with batches of every rank's rows together, and
every rank must match it to 1e-6 in float64: the loss at every step, the values logged, the first step's gradients
(after DDP's average), the parameters at the end. Without the option each rank's hook sees its own rows, and the
parameters differ.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from batch_losses import MODELS, views
from processes import clean_env, free_port, run, still_running
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "gather_ddp_train.py"
ROWS, VAL_ROWS, BATCH, EPOCHS = 23, 13, 4, 2

sys.path.insert(0, str(ROOT / "tests" / "scripts"))
from gather_ddp_train import Recorder, Report, fit_and_test  # noqa: E402


def _run(out: Path, model: str, ranks: int, *flags: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, str(SCRIPT), "--model", model, "--out", str(out), "--devices", str(ranks)]
    command += ["--rows", str(ROWS), "--val-rows", str(VAL_ROWS), "--batch", str(BATCH), "--epochs", str(EPOCHS)]
    return run([*command, *flags], clean_env(MASTER_PORT=str(free_port())), timeout=180)


def _launch(out: Path, model: str, ranks: int, *flags: str) -> list[dict[str, Any]]:
    result = _run(out, model, ranks, *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(ranks)]


def _one_device(model: str, ranks: int, out: Path, **trainer: Any) -> dict[str, Any]:
    """The same training on one device (unless ``trainer`` says otherwise), each batch holding what the ranks'
    batches of one step hold together."""
    out.mkdir(parents=True)
    logger = Recorder()
    fit = L.Trainer(
        accelerator="cpu",
        devices=trainer.pop("devices", 1),
        max_epochs=EPOCHS,
        logger=logger,
        log_every_n_steps=1,
        callbacks=[Report(out, logger)],
        enable_checkpointing=False,
        default_root_dir=out,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **trainer,
    )
    train = DataLoader(views(ROWS), batch_size=ranks * BATCH, shuffle=False)
    val = DataLoader(views(VAL_ROWS, seed=1), batch_size=ranks * BATCH)
    fit_and_test(fit, MODELS[model](), train, val)
    return json.loads((out / "rank0.json").read_text())


def _close(actual: Any, expected: Any, what: str) -> None:
    torch.testing.assert_close(
        torch.tensor(actual, dtype=torch.float64),
        torch.tensor(expected, dtype=torch.float64),
        atol=1e-6,
        rtol=0,
        msg=what,
    )


def _logged(entries: list[dict[str, float]]) -> list[dict[str, float]]:
    return [{key: value for key, value in entry.items() if key != "epoch"} for entry in entries]


def _assert_trains_as(report: dict[str, Any], expected: dict[str, Any], who: str) -> None:
    _close(report["losses"], expected["losses"], f"{who}: the loss at each step")
    assert report["gradients"].keys() == expected["gradients"].keys()
    for name, gradient in expected["gradients"].items():
        _close(report["gradients"][name], gradient, f"{who}: the first step's gradient of {name}")
    for name, value in expected["parameters"].items():
        _close(report["parameters"][name], value, f"{who}: parameter {name}")
    logged, wanted = _logged(report["logged"]), _logged(expected["logged"])
    assert [sorted(entry) for entry in logged] == [sorted(entry) for entry in wanted]
    for index, (entry, want) in enumerate(zip(logged, wanted, strict=True)):
        _close([entry[key] for key in sorted(want)], [want[key] for key in sorted(want)], f"logged values {index}")
    assert (report["tested"] is None) == (expected["tested"] is None)
    for tested, want in zip(report["tested"] or [], expected["tested"] or [], strict=True):
        assert sorted(tested) == sorted(want)
        _close([tested[key] for key in sorted(want)], [want[key] for key in sorted(want)], f"{who}: tested")


@pytest.mark.parametrize("repeat", range(2))  # the replicas are threads: the result must not depend on their timing
@pytest.mark.parametrize("model", sorted(MODELS))
def test_the_same_modules_under_mgpu_dp_equal_one_device(model: str, repeat: int, tmp_path: Path) -> None:
    expected = _one_device(model, 2, tmp_path / "one")
    _assert_trains_as(_one_device(model, 2, tmp_path / "dp", devices=2, strategy="mgpu_dp"), expected, "mgpu_dp")


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_a_whole_batch_loss_under_mgpu_ddp_equals_one_device(model: str, ranks: int, tmp_path: Path) -> None:
    expected = _one_device(model, ranks, tmp_path / "one")
    reports = _launch(tmp_path / "ddp", model, ranks)
    for rank, report in enumerate(reports):
        _assert_trains_as(report, expected, f"rank {rank}")


def _launches(launcher: str, out: Path) -> list[tuple[list[str], dict[str, str]]]:
    """The command and environment of each process a launcher starts for the retrieval model on 2 ranks."""
    port, script = str(free_port()), [str(SCRIPT), "--model", "retrieval", "--out", str(out)]
    sizes = ["--rows", str(ROWS), "--val-rows", str(VAL_ROWS), "--batch", str(BATCH), "--epochs", str(EPOCHS)]
    if launcher == "torchrun, two nodes":  # one process on each of two nodes: two torchrun agents on this machine
        return [
            (
                [
                    sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                    "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", port,
                    *script, "--devices", "1", "--num-nodes", "2", *sizes,
                ],
                clean_env(),
            )
            for node in (0, 1)
        ]  # fmt: skip
    return [  # SLURM's srun: both tasks started with the variables it sets, on one node
        (
            [sys.executable, *script, "--devices", "2", *sizes],
            clean_env(
                SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2", SLURM_NNODES="1", SLURM_NODEID="0",
                SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_JOB_ID="4242", SLURM_JOB_NAME="train",
                SLURM_NODELIST="127.0.0.1", MASTER_PORT=port,
            ),
        )
        for rank in (0, 1)
    ]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun, two nodes", "slurm"])
def test_other_launchers_gather_as_one_device(launcher: str, tmp_path: Path) -> None:
    """The retrieval model, trained, validated and tested, against one device."""
    expected = _one_device("retrieval", 2, tmp_path / "one")
    out = tmp_path / "ranks"
    processes = [
        subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
        for command, env in _launches(launcher, out)
    ]
    errors = [process.communicate(timeout=180)[1] for process in processes]
    assert [process.returncode for process in processes] == [0, 0], "".join(error[-3000:] for error in errors)
    for rank in (0, 1):
        _assert_trains_as(json.loads((out / f"rank{rank}.json").read_text()), expected, f"rank {rank}")


@pytest.mark.slow
@pytest.mark.parametrize("model", sorted(MODELS))
def test_without_gather_step_end_each_ranks_rows_alone_give_other_parameters(model: str, tmp_path: Path) -> None:
    expected = _one_device(model, 2, tmp_path / "one")
    report = _launch(tmp_path / "ddp", model, 2, "--no-gather")[0]
    differences = [
        max(abs(a - b) for a, b in zip(report["parameters"][name], value, strict=True))
        for name, value in expected["parameters"].items()
    ]
    assert max(differences) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize(
    ("broken", "path", "says"),
    [
        ("keys", "output", r"output of rank 1 has keys \['a', 'b', 'extra'\] but rank 0 returned \['a', 'b'\]"),
        (
            "dtype",
            "output['a']",
            r"output\['a'\] is a torch.float32 tensor in rank 1 but a torch.float64 tensor elsewhere",
        ),
        ("object", "output['lock']", r"output\['lock'\] in rank 0 is a lock"),
    ],
)
def test_outputs_that_cannot_be_gathered_stop_every_rank_at_the_first_step(
    broken: str, path: str, says: str, tmp_path: Path
) -> None:
    started = time.monotonic()
    result = _run(tmp_path, "clip", 2, "--break", broken, "--slow-rank", "1")
    assert result.returncode != 0
    assert len(re.findall(says, result.stderr)) == 2, result.stderr[-3000:]  # raised on both ranks, not one
    assert "every rank raises this error" in result.stderr
    assert len(list(tmp_path.glob("pid-*"))) == 2
    assert not still_running(tmp_path), "a rank kept running after the gather refused the outputs"
    assert time.monotonic() - started < 60


@pytest.mark.slow
def test_a_rank_that_raises_while_another_is_busy_ends_every_rank(tmp_path: Path) -> None:
    """Rank 0's step raises while rank 1 computes outside any collective; rank 1 then fails at the gather."""
    started = time.monotonic()
    result = _run(tmp_path, "clip", 2, "--break", "raise", "--slow-rank", "1")
    assert result.returncode != 0
    assert "rank 0 fails on purpose" in result.stderr
    assert len(list(tmp_path.glob("pid-*"))) == 2
    assert not still_running(tmp_path), "a rank kept running after another one raised"
    assert time.monotonic() - started < 60
