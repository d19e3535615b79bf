"""The doctor: what it finds in models with and without multi-GPU traps, its command line, its JSON, the example."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from doctor_models import BatchNormNet, CenteredNet, ClipNet, MeanErrorsNet, ProbeData

from lightning_mgpu.cli import main
from lightning_mgpu.doctor import Comparison, DoctorReport, diagnose, format_report, probe_batch, run_doctor
from lightning_mgpu.doctor.findings import Differences, difference_findings

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


def message_of(report: DoctorReport, check: str, where: str) -> str:
    return next(f.message for f in report.findings if (f.check, f.where) == (check, where))


def test_step_output_names_the_batch_normalised_key_and_not_the_others() -> None:
    report = doctor("NormalisedPredNet")
    assert report.step_end
    assert verdicts(report) == {
        "step output['pred']": "differs",
        "step output['y']": "same",
        "output": "differs",
        "layer.weight.grad": "differs",
        "layer.bias.grad": "same",  # the normalisation removes the bias from pred
    }
    assert found(report) == {
        ("error", "batch-dependent", "step output['pred']"),
        ("error", "batch-dependent", "output"),
        ("error", "batch-dependent", "layer.weight"),
    }
    assert not any("['y']" in finding.where or "['y']" in finding.message for finding in report.findings)
    pred = message_of(report, "batch-dependent", "step output['pred']")
    assert pred.startswith("`step output['pred']`, which training_step_end receives, differs between one device and")
    assert "training_step does batch-wise work that each replica does on its own chunk only" in pred
    assert "into training_step_end, which receives the outputs of every replica gathered." in pred
    result = message_of(report, "batch-dependent", "output")
    assert result.startswith("training_step_end's result `output` differs")
    assert "a consequence of `step output['pred']`, which training_step computes batch-wise" in result
    gradient = message_of(report, "batch-dependent", "layer.weight")
    assert gradient.startswith("The gradient of `layer.weight` differs")
    assert "The fix above applies." in gradient


def test_step_output_difference_that_the_hook_absorbs_is_a_warning() -> None:
    # Each replica returns its chunk's mean loss; training_step_end averages them, which equal chunks make exact.
    report = doctor("ChunkMeanLossNet")
    assert found(report) == {("warning", "batch-dependent", "step output['loss']")}
    loss = next(c for c in report.comparisons if c.what == "step output['loss']")
    assert loss.note == "one value on one device, one per replica (2) in the split run"
    assert verdicts(report)["output"] == "same"
    assert "it may not for chunks of unequal size" in report.findings[0].message


@pytest.mark.parametrize("name", ["BatchNormNet", "BatchNormSubclassNet"])
def test_batchnorm_in_the_step_is_exact_with_the_whole_batch_statistics(name: str) -> None:
    # mgpu_dp's default: every replica normalises with the statistics of the whole batch, subclasses included.
    report = doctor(name)
    assert report.findings == []
    assert set(verdicts(report).values()) == {"same"}
    assert {"layer.1.running_mean", "layer.1.running_var", "step output", "output"} <= set(verdicts(report))


def test_batchnorm_with_per_replica_statistics_is_named_as_the_cause() -> None:
    report = doctor("BatchNormNet", sync_batchnorm=False)
    assert found(report) == {
        ("error", "batch-dependent", "step output"),
        ("error", "batch-dependent", "output"),
        ("error", "batch-dependent", "layer.0.weight, layer.1.weight, layer.1.bias, layer.3.weight (+1 more)"),
        ("warning", "batchnorm", "layer.1"),
    }
    assert verdicts(report)["layer.1.running_mean"] == "differs"
    step = message_of(report, "batch-dependent", "step output")
    assert "here BatchNorm (layer.1) normalising each chunk by its own statistics" in step
    assert "leave MGPUDPStrategy's sync_batchnorm at its default, True" in step
    batchnorm = message_of(report, "batchnorm", "layer.1")
    assert "its running statistics `layer.1.running_mean`, `layer.1.running_var` differ after the step" in batchnorm
    assert "BatchNorm layers normalise each chunk by its own statistics in the split run" in report.notes[0]


def test_batchnorm_that_normalises_by_hand_is_not_told_to_keep_the_exchange_it_already_has() -> None:
    # Its running mean, updated from each replica's chunk, stops the split step before anything else is compared.
    report = doctor("HandMadeBatchNormNet")
    assert found(report) == {("error", "buffer-update", "layer.1.running_mean")}
    message = report.findings[0].message
    assert "changed the buffer self.layer.1.running_mean inside the replicas" in message
    assert "sync_batchnorm" not in message


def test_batchnorm_under_ddp_suggests_sync_batchnorm() -> None:
    report = doctor("BatchNormNet", target="mgpu_ddp")
    batchnorm = next(finding for finding in report.findings if finding.check == "batchnorm")
    assert batchnorm.level == "warning"
    assert "Trainer(sync_batchnorm=True)" in batchnorm.message
    assert "on GPUs (torch's SyncBatchNorm) and on CPU processes alike" in batchnorm.message


def test_batch_mean_inside_the_step_is_found_on_its_key_with_the_difference() -> None:
    datamodule = ProbeData()
    torch.manual_seed(0)
    model = CenteredNet()
    batch = probe_batch(datamodule, model)
    report = diagnose(model, batch)

    assert found(report) == {
        ("error", "batch-dependent", "step output['centered']"),
        ("error", "batch-dependent", "output['centered']"),
    }
    assert verdicts(report) == {
        "step output['errors']": "same",
        "step output['centered']": "differs",
        "output['loss']": "same",
        "output['centered']": "differs",
        "layer.weight.grad": "same",
        "layer.bias.grad": "same",
    }
    with torch.no_grad():
        preds = model.layer(batch[0]).squeeze(1)
    chunk_means = torch.stack([preds[:4].mean(), preds[4:].mean()])
    expected = float((chunk_means - preds.mean()).abs().max())
    centered = next(comparison for comparison in report.comparisons if comparison.what == "step output['centered']")
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
    assert len(report.comparisons) == 8  # preds and errors into training_step_end, loss and preds out, 4 gradients
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


def test_a_plain_dict_of_registered_metrics_is_no_finding(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--model", f"{MODELS}:MetricsByNameNet", *DATA]) == 0
    assert "plain-container" not in capsys.readouterr().out
    assert doctor("MetricsByNameNet").findings == []


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


def test_a_batch_that_cannot_be_split_is_named_where_it_fails() -> None:
    model = CenteredNet()
    report = diagnose(model, {"x": torch.randn(4, 3), "y": torch.randn(3, 1)})
    assert found(report) == {("error", "not-splittable", "batch['y']")}
    assert "batch['y']: 3" in report.findings[0].message


def test_a_probe_batch_whose_list_reads_both_ways_is_named_before_any_run() -> None:
    """Two alike tensors of 2 rows are fields or one item per sample, and the probe batch has none before it."""
    report = diagnose(CenteredNet(), [torch.randn(2, 4), torch.randn(2, 4)])
    assert found(report) == {("error", "not-splittable", "batch")}
    assert "lightning_mgpu.PerSample(...)" in report.findings[0].message
    assert "lightning_mgpu.Fields(...)" in report.findings[0].message
    assert (report.batch_rows, report.comparisons) == (None, [])


@pytest.mark.parametrize("name", ["ParametersInStepNet", "EncoderPenaltyNet"])
def test_weight_penalty_inside_the_step_is_exact(name: str) -> None:
    # A penalty over self.parameters() or a submodule's parameters() sees the replica's own, so nothing differs.
    report = doctor(name)
    assert report.findings == []
    assert set(verdicts(report).values()) == {"same"}


def test_buffer_updated_from_the_chunk_is_named() -> None:
    # Under mgpu_dp the replicas leave the buffer at different values, which the step refuses: the doctor says so.
    # The row count is alike in both chunks of 4 rows, so only the running mean of the inputs shows the chunks.
    report = doctor("ChunkStatisticsBufferNet")
    assert found(report) == {("error", "buffer-update", "input_mean")}
    message = report.findings[0].message
    assert message.startswith("Under mgpu_dp: training_step changed the buffer self.input_mean inside the replicas")
    assert "replicas 0 and 1 left it at different values (by up to" in message
    assert "training_step_end" in message

    ddp = doctor("ChunkStatisticsBufferNet", target="mgpu_ddp")
    assert found(ddp) == {("error", "buffer-update", "input_mean")}
    assert "combine the update over the ranks (self.all_gather)" in ddp.findings[0].message


def test_a_row_count_alike_in_every_chunk_is_named_though_the_step_runs() -> None:
    report = doctor("RowCountBufferNet")
    assert found(report) == {("error", "buffer-update", "rows_seen")}
    rows_seen = next(c for c in report.comparisons if c.what == "rows_seen")
    assert rows_seen.max_abs_diff == 4  # 8 rows counted on one device, 4 by each replica, kept once
    message = report.findings[0].message
    assert "Under mgpu_dp every replica left it at the same value, each from its own chunk" in message
    assert "update the buffer in training_step_end" in message


def test_attribute_assigned_in_the_step_and_read_in_step_end_blames_the_hook() -> None:
    report = doctor("StepAttributeNet")
    assert found(report) == {
        ("error", "step-end-state", "output"),
        ("error", "step-end-state", "layer.weight, layer.bias"),
    }
    assert verdicts(report)["step output"] == "same"
    assert verdicts(report)["output"] == "differs"
    message = message_of(report, "step-end-state", "output")
    assert "although every step output it receives is the same" in message
    assert "training_step assigns `self.rows`; inside a replica it is computed from that replica's chunk" in message
    assert "Return what training_step_end needs from training_step" in message
    assert "a consequence of `output`" in message_of(report, "step-end-state", "layer.weight, layer.bias")

    ddp = doctor("StepAttributeNet", target="mgpu_ddp")
    assert {(f.level, f.check) for f in ddp.findings} == {("warning", "step-end-state")}
    assert "so this concerns mgpu_dp only" in message_of(ddp, "step-end-state", "output")


def test_gradient_scaled_by_a_chunk_statistic_is_backward_dependent() -> None:
    report = doctor("ScaledGradientNet")
    assert found(report) == {("error", "backward-dependent", "layer.weight, layer.bias")}
    assert {verdicts(report)["step output"], verdicts(report)["output"]} == {"same"}
    message = report.findings[0].message
    assert message.startswith("The gradients of 2 parameters (`layer.weight`, `layer.bias`) differ between one device")
    assert "although every output of the step is the same" in message
    assert "a straight-through estimator" in message


def split_report() -> DoctorReport:
    return DoctorReport("Net", "mgpu_dp", 2, 0, 1e-5, 1e-4, batch_rows=8, chunk_sizes=[4, 4], step_end=True)


def test_per_replica_batchnorm_statistics_are_named_with_the_cause() -> None:
    # As when BatchNorm normalises each chunk by its own statistics: its outputs and running statistics differ.
    differing = [
        Comparison("step output['logits']", "step-output", 0.5, False),
        Comparison("output", "output", 0.2, False),
        Comparison("net.1.running_mean", "buffer", 0.03, False),
        Comparison("net.1.running_var", "buffer", 0.01, False),
    ]
    differences = Differences(differing, step_end=True, batchnorms=("net.1", "net.4"))
    findings = {(f.level, f.check, f.where): f.message for f in difference_findings(differences, split_report())}
    assert set(findings) == {
        ("error", "batch-dependent", "step output['logits']"),
        ("error", "batch-dependent", "output"),
        ("warning", "batchnorm", "net.1"),
    }
    assert (
        "here BatchNorm (net.1) normalising each chunk by its own statistics"
        in findings[("error", "batch-dependent", "step output['logits']")]
    )
    batchnorm = findings[("warning", "batchnorm", "net.1")]
    assert "its running statistics `net.1.running_mean`, `net.1.running_var` differ after the step" in batchnorm
    assert "only replica 0's running statistics are kept, computed from replica 0's chunk of 4 rows" in batchnorm
    assert "Keep MGPUDPStrategy's default sync_batchnorm=True" in batchnorm
    assert "under mgpu_ddp, use SyncBatchNorm (Trainer(sync_batchnorm=True))" in batchnorm


def test_differences_that_remain_with_one_replica_are_not_blamed_on_batch_wise_work() -> None:
    differing = [
        Comparison("output", "output", 0.1, False),
        Comparison("head.weight.grad", "gradient", 0.2, False),
        Comparison("count", "buffer", 1.0, False),
    ]
    differences = Differences(differing, whole_batch=frozenset({"output", "head.weight.grad", "count"}))
    report = split_report()
    report.step_end = False
    findings = {(f.level, f.check, f.where): f.message for f in difference_findings(differences, report)}
    assert set(findings) == {
        ("error", "replica-state", "output"),
        ("error", "replica-state", "head.weight"),
        ("error", "buffer-update", "count"),
    }
    assert (
        "and also when one replica runs the whole batch, so it is not batch-wise work"
        in findings[("error", "replica-state", "output")]
    )
    assert (
        "the update training_step makes inside a replica does not reach the module"
        in findings[("error", "buffer-update", "count")]
    )
    assert not any("batch-wise work that each replica does" in message for message in findings.values())


def test_randomness_outside_dropout_turns_differences_into_warnings() -> None:
    report = doctor("RandomShiftNet")
    assert report.errors == []
    assert ("warning", "random-step", "step output['preds']") in found(report)
    assert ("warning", "batch-dependent", "step output['preds']") in found(report)
    assert "so this may be that randomness only" in message_of(report, "batch-dependent", "step output['preds']")


def test_the_model_itself_is_left_untouched() -> None:
    torch.manual_seed(0)
    model = BatchNormNet()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    diagnose(model, probe_batch(ProbeData(), model))
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())
    assert all(parameter.grad is None for parameter in model.parameters())
    assert model.training


def test_json_round_trip(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--model", f"{MODELS}:NormalisedPredNet", *DATA, "--json"]) == 1
    printed = json.loads(capsys.readouterr().out)
    expected = doctor("NormalisedPredNet").to_dict()
    assert (
        printed["summary"]
        == expected["summary"]
        == {
            "errors": 3,
            "warnings": 0,
            "compared": 5,
            "differ": 3,
            "ok": False,
        }
    )
    assert printed["findings"] == expected["findings"]
    assert [(c["what"], c["kind"], c["verdict"]) for c in printed["comparisons"]] == [
        ("step output['pred']", "step-output", "differs"),
        ("step output['y']", "step-output", "same"),
        ("output", "output", "differs"),
        ("layer.weight.grad", "gradient", "differs"),
        ("layer.bias.grad", "gradient", "same"),
    ]
    for ours, theirs in zip(printed["comparisons"], expected["comparisons"], strict=True):
        assert ours["max_abs_diff"] == pytest.approx(theirs["max_abs_diff"])
    assert printed["chunk_sizes"] == [4, 4]
    assert printed["target"] == "mgpu_dp"
    assert printed["step_end"] is True


def test_the_table_shows_each_stage_under_its_heading() -> None:
    lines = format_report(doctor("BatchNormNet", sync_batchnorm=False), width=120).splitlines()
    start = lines.index("Comparisons: one device vs 2 replicas (atol 1e-05, rtol 0.0001); the loss is output")
    table = lines[start + 1 : lines.index("", start)]
    assert table[0].split() == ["what", "max", "abs", "diff", "verdict"]
    assert [line for line in table[2:] if not line.startswith("  ")] == [
        "training_step's output, gathered from the replicas: what training_step_end receives",
        "training_step_end's result: what Lightning receives",
        "gradients",
        "buffers after the step",
    ]
    rows = [line.split() for line in table[2:] if line.startswith("  ")]
    assert [(row[0], row[-1]) for row in rows] == [
        ("step", "differs"),  # step output
        ("output", "differs"),
        ("layer.0.weight.grad", "differs"),
        ("layer.0.bias.grad", "same"),
        ("layer.1.weight.grad", "differs"),
        ("layer.1.bias.grad", "differs"),
        ("layer.3.weight.grad", "differs"),
        ("layer.3.bias.grad", "differs"),
        ("layer.1.running_mean", "differs"),
        ("layer.1.running_var", "differs"),
        ("layer.1.num_batches_tracked", "same"),
    ]
    assert rows[-1] == ["layer.1.num_batches_tracked", "0", "same"]


def test_long_stages_list_only_their_differing_rows() -> None:
    comparisons = [Comparison("output", "output", 0.0, True)]
    comparisons += [Comparison(f"layer{i}.weight.grad", "gradient", 0.0, True) for i in range(40)]
    comparisons += [Comparison(f"bn{i}.running_mean", "buffer", 0.0, True) for i in range(35)]
    comparisons.append(Comparison("bn0.running_var", "buffer", 0.5, False))
    report = split_report()
    report.step_end = False
    report.comparisons = comparisons
    text = format_report(report, width=100)
    assert "  bn0.running_var" in text
    assert "layer3.weight.grad" not in text
    assert "... and 40 more gradients and 35 more buffers, all the same (--json lists them)" in text


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


@pytest.mark.slow
def test_python_dash_m_runs_the_doctor() -> None:
    command = [sys.executable, "-m", "lightning_mgpu", "doctor", "--model", f"{MODELS}:NormalisedPredNet", *DATA]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 1, result.stderr
    assert "batch-dependent  step output['pred']" in result.stdout
    assert "3 errors, 0 warnings: exit 1" in result.stdout


def test_a_mean_over_a_count_other_than_rows_points_to_loss_weight() -> None:
    report = doctor("CountMeanLossNet")
    message = message_of(report, "batch-dependent", "output['loss']")
    assert "return {'loss': loss, 'loss_weight': count} from training_step" in message
    assert message.index("loss_weight") < message.index("Move the batch-wise computation")
    data = ProbeData()
    data.setup("fit")
    assert data.dataset is not None
    counted = [int((data.dataset.tensors[1][rows] > 0).sum()) for rows in (slice(0, 4), slice(4, 8))]
    expected = " : ".join(f"{count / sum(counted):.3g}" for count in counted)
    assert f"the chunks' own weighted {expected}, not by rows" in message
    weighted = doctor("CountMeanLossNet", init_args={"weighted": True})
    assert [finding for finding in weighted.findings if finding.level == "error"] == []
    assert verdicts(weighted)["output['loss']"] == "same"


def test_in_batch_negatives_point_to_training_step_end_not_to_loss_weight() -> None:
    report = doctor("InBatchNegativesNet")
    message = message_of(report, "batch-dependent", "output")
    assert "No weighting of the chunks' own losses gives the whole batch's loss and gradients" in message
    assert "{'loss': loss, 'loss_weight': count}" not in message
    assert message.index("loss_weight cannot fix it") < message.index("Move the batch-wise computation")


GATHER_STEP_END = "MGPUDDPStrategy(gather_step_end=True)"
GATHER_STEP_END_YAML = (
    "trainer.strategy: {class_path: lightning_mgpu.MGPUDDPStrategy, init_args: {gather_step_end: true}}"
)


def per_rank(report: DoctorReport) -> dict[str, str]:
    return {c.what: c.verdict for c in report.comparisons if c.kind == "per-rank"}


def test_a_contrastive_loss_in_training_step_end_needs_every_rank_under_ddp_only() -> None:
    dp = doctor("ClipNet")
    assert dp.findings == []
    assert per_rank(dp) == {}

    torch.manual_seed(0)
    model = ClipNet()
    batch = probe_batch(ProbeData(), model)
    ddp = diagnose(model, batch, target="mgpu_ddp")
    assert found(ddp) == {
        ("error", "step-end-needs-every-rank", "training_step_end: output"),
        ("warning", "step-end-needs-every-rank", "validation_step_end: self.log('val_recall')"),
    }
    assert per_rank(ddp) == {
        "training_step_end: output": "differs",
        "training_step_end: step output['image'].grad": "differs",
        "training_step_end: step output['text'].grad": "differs",
        "training_step_end: logit_scale.grad": "differs",
        "training_step_end: self.log('train_loss')": "differs",
        "validation_step_end: self.log('val_recall')": "differs",
    }
    # Each rank's loss over its 4 rows, averaged as DDP averages the gradients, against the loss over all 8.
    with torch.no_grad():
        output = model.training_step(batch, 0)

        def clip(rows: slice) -> torch.Tensor:
            logits = output["image"][rows] @ output["text"][rows].T * model.logit_scale.exp()
            labels = torch.arange(len(logits))
            return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2

        expected = float((clip(slice(0, 8)) - (clip(slice(0, 4)) + clip(slice(4, 8))) / 2).abs())
    loss = next(c for c in ddp.comparisons if c.what == "training_step_end: output")
    assert loss.max_abs_diff == pytest.approx(expected, rel=1e-5)

    message = message_of(ddp, "step-end-needs-every-rank", "training_step_end: output")
    assert message.startswith("training_step_end's loss `output` depends on rows of more than one rank: on each")
    assert "gradients it passes back to `step output['image']`, `step output['text']`, `logit_scale`" in message
    assert "It also logs `train_loss`, which differs the same way." in message
    assert GATHER_STEP_END in message
    assert GATHER_STEP_END_YAML in message
    validation = message_of(ddp, "step-end-needs-every-rank", "validation_step_end: self.log('val_recall')")
    assert validation.startswith("validation_step_end logs `val_recall` with values that depend on rows of more")
    assert "as self.log(..., sync_dist=True) combines them" in validation
    assert GATHER_STEP_END in validation


@pytest.mark.parametrize("rows", [8, 7])
def test_a_mean_of_per_sample_errors_in_step_end_needs_no_rank_but_its_own(rows: int) -> None:
    data = {"rows": rows, "batch_size": rows}
    assert doctor("MeanErrorsNet", data_init_args=data).findings == []
    ddp = doctor("MeanErrorsNet", data_init_args=data, target="mgpu_ddp")
    assert ddp.findings == []
    assert per_rank(ddp) == {
        "training_step_end: output": "same",
        "training_step_end: step output.grad": "same",
        "training_step_end: self.log('train_loss')": "same",
        "validation_step_end: self.log('val_loss')": "same",
    }
    cut = "The *_step_end hooks ran on each rank's rows with the first 6 of the 7 rows, 3 per rank"
    assert any(note.startswith(cut) for note in ddp.notes) == (rows == 7)


def test_a_mean_of_the_ranks_own_means_in_step_end_needs_no_rank_but_its_own() -> None:
    # Each rank returns its chunk's 0-dim mean; the hook averages what it receives, which a rank's hook is given alone.
    ddp = doctor("ChunkMeanLossNet", target="mgpu_ddp")
    assert found(ddp) == {("warning", "batch-dependent", "step output['loss']")}
    assert set(per_rank(ddp).values()) == {"same"}


def test_a_summed_loss_in_step_end_is_off_by_the_ranks_under_ddp() -> None:
    torch.manual_seed(0)
    model = MeanErrorsNet(reduction="sum")
    batch = probe_batch(ProbeData(), model)
    assert diagnose(model, batch).findings == []
    ddp = diagnose(model, batch, target="mgpu_ddp")
    assert found(ddp) == {("error", "step-end-needs-every-rank", "training_step_end: output")}
    with torch.no_grad():
        total = float(model.training_step(batch, 0).sum())
    loss = next(c for c in ddp.comparisons if c.what == "training_step_end: output")
    assert loss.max_abs_diff == pytest.approx(total / 2, rel=1e-5)  # DDP averages 2 ranks' sums of half the rows
    assert "a sum where a mean over the rows is meant" in ddp.findings[0].message


def test_a_hook_that_raises_on_a_rank_share_of_the_rows_needs_every_rank() -> None:
    assert doctor("HardestErrorsNet").errors == []
    ddp = doctor("HardestErrorsNet", target="mgpu_ddp")
    assert ("error", "step-end-needs-every-rank", "training_step_end") in found(ddp)
    message = message_of(ddp, "step-end-needs-every-rank", "training_step_end")
    assert message.startswith("training_step_end raises on rank 0's 4 rows (RuntimeError: ")
    assert "but not on all 8 rows of the 2 ranks" in message
    assert GATHER_STEP_END in message


def test_ddp_step_end_finding_on_the_command_line_and_in_json(capsys: pytest.CaptureFixture[str]) -> None:
    clip = ["doctor", "--model", f"{MODELS}:ClipNet", *DATA]
    assert main(clip) == 0
    assert "step-end-needs-every-rank" not in capsys.readouterr().out
    assert main([*clip, "--target", "mgpu_ddp"]) == 1
    out = capsys.readouterr().out
    assert "step-end-needs-every-rank" in out
    assert "mgpu_ddp: each *_step_end hook on every rank's rows (gather_step_end=True) vs on each rank's own" in out
    assert main([*clip, "--target", "mgpu_ddp", "--json"]) == 1
    printed = json.loads(capsys.readouterr().out)
    assert [(f["level"], f["check"], f["where"]) for f in printed["findings"]] == [
        ("error", "step-end-needs-every-rank", "training_step_end: output"),
        ("warning", "step-end-needs-every-rank", "validation_step_end: self.log('val_recall')"),
    ]
    assert printed["summary"] == {"errors": 1, "warnings": 1, "compared": 14, "differ": 6, "ok": False}
    assert [c["what"] for c in printed["comparisons"] if c["kind"] == "per-rank"][0] == "training_step_end: output"
    assert main(["doctor", "--model", f"{MODELS}:MeanErrorsNet", *DATA, "--target", "mgpu_ddp", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["findings"] == []


def test_batch_wise_work_in_the_step_under_ddp_points_to_gather_step_end() -> None:
    message = message_of(doctor("InBatchNegativesNet", target="mgpu_ddp"), "batch-dependent", "output")
    assert "into training_step_end and construct MGPUDDPStrategy(gather_step_end=True)" in message
    assert "self.all_gather" not in message
