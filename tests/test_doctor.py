"""The doctor: what it finds in models with and without multi-GPU traps, its command line, its JSON, the example."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from doctor_models import BatchNormNet, CenteredNet, ProbeData

from lightning_mgpu.cli import main
from lightning_mgpu.doctor import DoctorReport, diagnose, probe_batch, run_doctor

ROOT = Path(__file__).resolve().parents[1]
MODELS = "tests/doctor_models.py"
DATA = ["--data", f"{MODELS}:ProbeData"]


@pytest.fixture(autouse=True)
def _in_repo_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the class paths below are relative to the repository, as a user would type them


def doctor(name: str, **kwargs: Any) -> DoctorReport:
    return run_doctor(f"{MODELS}:{name}", data=f"{MODELS}:ProbeData", **kwargs)


def found(report: DoctorReport) -> set[tuple[str, str, str]]:
    return {(finding.level, finding.check, finding.where) for finding in report.findings}


def verdicts(report: DoctorReport) -> dict[str, str]:
    return {comparison.what: comparison.verdict for comparison in report.comparisons}


def test_batchnorm_in_the_step_is_batch_dependent() -> None:
    report = doctor("BatchNormNet")
    assert ("error", "batch-dependent", "output") in found(report)
    assert ("warning", "batchnorm", "layer.1") in found(report)
    assert report.chunk_sizes == [4, 4]
    assert verdicts(report)["output"] == "differs"
    assert verdicts(report)["layer.1.weight.grad"] == "differs"
    output = next(comparison for comparison in report.comparisons if comparison.what == "output")
    assert output.max_abs_diff is not None
    assert output.max_abs_diff > 1e-2
    gradients = next(finding for finding in report.findings if finding.where.startswith("layer.0.weight"))
    assert gradients.check == "batch-dependent"
    assert "BatchNorm (layer.1)" in gradients.message
    message = next(finding.message for finding in report.findings if finding.where == "output")
    assert "training_step_end" in message
    assert "per-replica statistics" in message


def test_batchnorm_under_ddp_suggests_sync_batchnorm() -> None:
    report = doctor("BatchNormNet", target="mgpu_ddp")
    batchnorm = next(finding for finding in report.findings if finding.check == "batchnorm")
    assert batchnorm.level == "warning"
    assert "Trainer(sync_batchnorm=True)" in batchnorm.message


def test_batch_mean_inside_the_step_is_found_on_its_key_with_the_difference() -> None:
    datamodule = ProbeData()
    torch.manual_seed(0)
    model = CenteredNet()
    batch = probe_batch(datamodule, model)
    report = diagnose(model, batch)

    assert found(report) == {("error", "batch-dependent", "output['centered']")}
    assert verdicts(report) == {
        "output['loss']": "same",
        "output['centered']": "differs",
        "layer.weight.grad": "same",
        "layer.bias.grad": "same",
    }
    with torch.no_grad():
        preds = model.layer(batch[0]).squeeze(1)
    chunk_means = torch.stack([preds[:4].mean(), preds[4:].mean()])
    expected = float((chunk_means - preds.mean()).abs().max())
    centered = next(comparison for comparison in report.comparisons if comparison.what == "output['centered']")
    assert centered.max_abs_diff == pytest.approx(expected, rel=1e-5)


def test_loss_divided_by_a_batch_statistic_differs_in_loss_and_gradients() -> None:
    report = doctor("BatchNormalisedLossNet")
    assert report.loss == "output"
    assert ("error", "batch-dependent", "output") in found(report)
    assert ("error", "batch-dependent", "layer.weight, layer.bias") in found(report)


def test_clean_model_exits_0_with_every_comparison_the_same(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--model", f"{MODELS}:CleanNet", *DATA]) == 0
    out = capsys.readouterr().out
    assert "Findings: none" in out
    assert "differs" not in out
    assert "Dropout modules in eval mode in both runs" in out
    report = doctor("CleanNet")
    assert report.findings == []
    assert report.loss == "output['loss']"
    assert len(report.comparisons) == 6  # loss, preds and 4 gradients
    assert set(verdicts(report).values()) == {"same"}


def test_default_loss_of_uneven_chunks_is_exact() -> None:
    # 7 rows: 4 + 3. The chunk-weighted mean of the replicas' mean losses equals the one-device loss.
    report = doctor("MeanLossNet", data_init_args={"rows": 7, "batch_size": 7})
    assert report.chunk_sizes == [4, 3]
    assert report.findings == []
    assert set(verdicts(report).values()) == {"same"}


def test_parameters_in_a_plain_list_are_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--model", f"{MODELS}:ListParamsNet", *DATA]) == 1
    assert "plain-container" in capsys.readouterr().out
    report = doctor("ListParamsNet")
    assert ("error", "plain-container", "scales") in found(report)


def test_unused_parameter_is_a_warning_for_dp_and_an_error_for_ddp(capsys: pytest.CaptureFixture[str]) -> None:
    unused = {"unused.weight", "unused.bias"}
    dp = doctor("UnusedParamNet")
    assert {(f.level, f.where) for f in dp.findings if f.check == "no-gradient"} == {("warning", w) for w in unused}
    ddp = doctor("UnusedParamNet", target="mgpu_ddp")
    assert {(f.level, f.where) for f in ddp.findings if f.check == "no-gradient"} == {("error", w) for w in unused}
    assert "find_unused_parameters=True" in ddp.findings[0].message

    assert main(["doctor", "--model", f"{MODELS}:UnusedParamNet", *DATA]) == 0
    assert main(["doctor", "--model", f"{MODELS}:UnusedParamNet", *DATA, "--target", "mgpu_ddp"]) == 1


def test_string_in_the_output_is_not_gatherable() -> None:
    report = doctor("StringOutputNet")
    assert found(report) == {("error", "not-gatherable", "output['note']")}
    assert "str" in report.findings[0].message
    assert report.comparisons == []


def test_self_parameters_in_the_step_fails_only_in_replicas() -> None:
    report = doctor("ParametersInStepNet")
    assert found(report) == {("error", "replica-error", "training_step")}
    assert "self.parameters() was called inside a replica" in report.findings[0].message


def test_randomness_outside_dropout_turns_differences_into_warnings() -> None:
    report = doctor("RandomShiftNet")
    assert report.errors == []
    assert ("warning", "random-step", "output['loss']") in found(report)
    assert ("warning", "batch-dependent", "output['preds']") in found(report)


def test_the_model_itself_is_left_untouched() -> None:
    torch.manual_seed(0)
    model = BatchNormNet()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    diagnose(model, probe_batch(ProbeData(), model))
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())
    assert all(parameter.grad is None for parameter in model.parameters())
    assert model.training


def test_json_round_trip(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--model", f"{MODELS}:BatchNormNet", *DATA, "--json"]) == 1
    printed = json.loads(capsys.readouterr().out)
    expected = doctor("BatchNormNet").to_dict()
    assert (
        printed["summary"]
        == expected["summary"]
        == {
            "errors": 2,
            "warnings": 1,
            "compared": 7,
            "differ": 6,
            "ok": False,
        }
    )
    assert printed["findings"] == expected["findings"]
    assert [(c["what"], c["verdict"]) for c in printed["comparisons"]] == [
        (c["what"], c["verdict"]) for c in expected["comparisons"]
    ]
    for ours, theirs in zip(printed["comparisons"], expected["comparisons"], strict=True):
        assert ours["max_abs_diff"] == pytest.approx(theirs["max_abs_diff"])
    assert printed["chunk_sizes"] == [4, 4]
    assert printed["target"] == "mgpu_dp"


def test_density_example_through_its_config_is_clean(capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "doctor",
        "--model",
        "examples/density.py:DensityModel",
        "--data",
        "examples/density.py:GaussianMixtureData",
        "--config",
        "configs/quickstart.yaml",
        "--data-init-args",
        '{"num_samples": 1000, "num_val_samples": 10}',
        "--json",
    ]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["findings"] == []
    assert report["seed"] == 0  # the config's seed_everything
    assert report["batch_rows"] == 500  # the config's batch_size
    assert report["chunk_sizes"] == [250, 250]
    assert report["loss"] == "output"  # training_step_end returns the loss
    assert {c["verdict"] for c in report["comparisons"]} == {"same"}
    assert {c["what"] for c in report["comparisons"]} >= {"output", "H_0.grad", "a_0.grad", "b_3.grad"}


def test_config_with_class_paths_and_seed(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(
        "seed_everything: 3\n"
        "trainer: {max_epochs: 2}\n"
        f"model: {{class_path: '{MODELS}:CleanNet', init_args: {{hidden: 16}}}}\n"
        "data: {class_path: tests.doctor_models.ProbeData, init_args: {rows: 10, batch_size: 5}}\n"
    )
    report = run_doctor(config=config, data_init_args={"batch_size": 7})
    assert report.seed == 3
    assert report.batch_rows == 7
    assert report.chunk_sizes == [4, 3]
    assert "layer.0.weight.grad" in verdicts(report)
    assert report.findings == []


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        ([], "no command given"),
        (["train"], "unknown command 'train'"),
        (["doctor", "--model", "nopkg.Net", *DATA], "Pass --model as package.module.ClassName"),
        (["doctor", "--model", f"{MODELS}:Nope", *DATA], "no class 'Nope' there (it defines BatchNormNet"),
        (["doctor", "--model", f"{MODELS}:CleanNet"], "No data class: pass --data"),
        (["doctor", "--model", f"{MODELS}:CleanNet", *DATA, "--init-args", "[1]"], "pass an object such as"),
        (["doctor", "--model", f"{MODELS}:CleanNet", *DATA, "--init-args", '{"width": 3}'], "'width'"),
        (["doctor", "--model", f"{MODELS}:ProbeData", *DATA], "not a LightningModule"),
        (["doctor", "--model", f"{MODELS}:CleanNet", *DATA, "--replicas", "1"], "pass 2 or more"),
    ],
)
def test_bad_arguments_exit_2_saying_what_to_pass(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert says in captured.err
    assert captured.out == ""


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert "doctor" in capsys.readouterr().out
    assert main(["doctor", "--help"]) == 0
    assert "--target {mgpu_dp,mgpu_ddp}" in capsys.readouterr().out


def test_python_dash_m_runs_the_doctor() -> None:
    command = [sys.executable, "-m", "lightning_mgpu", "doctor", "--model", f"{MODELS}:BatchNormNet", *DATA]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 1, result.stderr
    assert "batch-dependent" in result.stdout
    assert "batchnorm" in result.stdout
    assert "2 errors, 1 warning: exit 1" in result.stdout
