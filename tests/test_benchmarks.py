"""The benchmark entry point runs end to end in its quickest mode, so it cannot rot. No timing is asserted here."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from processes import clean_env
from torch import nn

from benchmarks.phases import PHASES, PhaseTimer
from lightning_mgpu.engine import MGPUDataParallel, data_parallel

ROOT = Path(__file__).resolve().parents[1]
ROW_NAMES = (
    "ddp/mgpu_ddp_vs_ddp",
    "ddp/mgpu_ddp_vs_torch",
    "ddp/ddp_vs_torch",
    "ddp/lightning_ms",
    "ddp/package_ms",
    "ddp/mgpu_ddp_vs_ddp_1proc",
    "ddp/ddp_vs_torch_1proc",
    "ddp/package_ms_1proc",
    "ddp/mgpu_ddp_vs_ddp_cpu",
    "ddp/package_cpu_us_1proc",
    "scaling/mgpu_ddp",
    "scaling/torch",
    "dp/mgpu_dp_vs_single",
    "dp/mgpu_dp_vs_single_2t",
    "dp/engine_vs_raw",
    "dp/single_vs_raw",
    "dp/overhead_share",
    "dp/engine_overhead_share",
    "mixin/mixin_vs_single",
    "mixin/mixin_vs_single_cpu",
    "mixin/per_step_share",
)
OVERHEAD_ROWS = ("overhead/1_replica", "overhead/2_replicas", "overhead/4_replicas")


@pytest.mark.slow
def test_smoke_mode_writes_every_row(tmp_path: Path) -> None:
    env = clean_env()
    command = [sys.executable, "-m", "benchmarks.run", "--smoke", "--device", "cpu", "--out", str(tmp_path)]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    results = json.loads((tmp_path / "results.json").read_text())
    assert results["meta"]["mode"] == "smoke"
    rows = {row["id"]: row for row in results["rows"]}
    expected = {f"{name}/{model}" for name in ROW_NAMES for model in ("mlp", "conv")}
    assert expected <= set(rows), sorted(expected - set(rows))
    for row in rows.values():
        assert row["values"], row["id"]
        assert row["min"] <= row["median"] <= row["max"], row["id"]
    assert {entry["variant"] for entry in results["phases"]} == {"mgpu_dp", "raw_engine"}
    assert set(results["profile_dp"]) == set(results["profile_ddp"]) == {"mlp", "conv"}
    for profile in results["profile_dp"].values():
        labels = {entry["name"]: entry for entry in profile["labels"]}
        assert labels["mgpu::parallel_apply"]["calls_per_step"] > 0
        if profile["replica_threads_profiled"]:
            assert labels["mgpu::replica_thread"]["calls_per_step"] > 0, "the replica threads are in the profile"

    overhead = {f"{row}/linear4x{depth}" for row in OVERHEAD_ROWS for depth in (1, 16)}
    assert overhead <= set(rows), sorted(overhead - set(rows))
    for row_id in overhead:
        assert rows[row_id]["unit"] == "us"
        assert rows[row_id]["target"].startswith("<= ")
        assert rows[row_id]["met"] in (True, False)
    assert {(case["depth"], case["replicas"]) for case in results["overhead"]} == {
        (depth, replicas) for depth in (1, 16) for replicas in (1, 2, 4)
    }

    for case in results["raw"]["overhead"]:
        floor = case["floor_us"]
        assert all(value == 0.0 for value in floor) if case["replicas"] == 1 else all(value > 0 for value in floor)
        assert case["above_floor_us"] == [cost - trip for cost, trip in zip(case["overhead_us"], floor, strict=True)]

    from benchmarks import batchnorm

    batchnorm_rows = {f"batchnorm/{name}/{model}" for name in ("sync_on_vs_off", "per_layer_above_handoff")
                      for model in batchnorm.MODELS}  # fmt: skip
    assert batchnorm_rows <= set(rows), sorted(batchnorm_rows - set(rows))
    assert rows["batchnorm/sync_on_vs_off/conv16_bn16"]["target"] == "<= 1.15"
    assert {entry["model"] for entry in results["batchnorm"]} == set(batchnorm.MODELS)
    assert results["profile_batchnorm"]["layers"] == 16

    table = (tmp_path / "results.md").read_text()
    assert "| id | what | median | min | max | target | met |" in table
    assert all(f"| {row_id} |" in table for row_id in expected | overhead | batchnorm_rows)
    assert "## Engine overhead per call" in table
    assert "## Exact BatchNorm under mgpu_dp" in table
    assert "mgpu::bn_meeting" in table


def test_the_phase_timer_times_every_phase_from_outside_and_puts_the_engine_back() -> None:
    wrapper = MGPUDataParallel(nn.Linear(3, 2), [torch.device("cpu")] * 2)
    originals = (wrapper._replicate, wrapper._apply_in_threads, dict(vars(data_parallel)))
    x = torch.randn(6, 3)
    try:
        expected = wrapper(x)
        with PhaseTimer(wrapper) as timer:
            first = wrapper(x)
            wrapper(x)
            assert wrapper._replicate.structure is originals[0].structure
        after = wrapper(x)
    finally:
        wrapper.close()
    assert set(timer.seconds) == set(PHASES)
    assert all(seconds > 0 for seconds in timer.seconds.values()), timer.seconds
    torch.testing.assert_close(first, expected, rtol=0, atol=0)
    torch.testing.assert_close(after, expected, rtol=0, atol=0)
    assert (wrapper._replicate, wrapper._apply_in_threads, dict(vars(data_parallel))) == originals
    assert "gather" not in vars(wrapper), "the class's gather is back"


@pytest.mark.slow
def test_a_run_writes_outside_the_tracked_tree_unless_told_where() -> None:
    from benchmarks.run import RESULTS

    default = RESULTS / "cpu-quick" / "results.json"
    ignored = subprocess.run(["git", "check-ignore", "-q", str(default)], cwd=ROOT, check=False)
    assert ignored.returncode == 0, f"{default} is not ignored by git"
    assert RESULTS.is_relative_to(ROOT)


def test_the_batchnorm_benchmark_measures_every_model_and_variant(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import batchnorm

    result = batchnorm.measure("smoke")
    layers = {"conv8_bn1": 1, "conv8_bn8": 8, "conv16_bn1": 1, "conv16_bn16": 16, "resnet4": 8}
    if importlib.util.find_spec("timm") is not None:
        layers["timm_resnet4"] = 8  # four blocks, each one timm BatchNormAct2d and one BatchNorm2d
    assert result["layers"] == layers
    rows = {row["model"]: row for row in batchnorm.summary(result)}
    assert set(rows) == set(batchnorm.MODELS)
    for row in rows.values():
        assert all(row[f"{variant}_ms"] > 0 for variant in batchnorm.VARIANTS), row
        assert row["ratio_min"] <= row["ratio"] <= row["ratio_max"], row
    assert batchnorm.main(["--smoke"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("2 CPU replicas")
    assert len(printed) == 1 + len(batchnorm.MODELS)


@pytest.mark.slow
def test_the_ddp_batchnorm_benchmark_times_both_variants_on_two_processes(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import ddp_batchnorm

    assert ddp_batchnorm.main(["--smoke"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("| model | sync_off ms | sync_on ms |")
    assert [line.split(" | ")[0] for line in printed[1:]] == [f"| {model}" for model in ddp_batchnorm.MODELS]
    for line in printed[1:]:
        off, on = (float(cell) for cell in line.split(" | ")[1:3])
        assert off > 0, line
        assert on > 0, line


def test_the_batchnorm_profile_labels_every_part_of_the_exchange_in_the_replica_threads(tmp_path: Path) -> None:
    from benchmarks import batchnorm

    trace = tmp_path / "trace" / "batchnorm.json"
    profiled = batchnorm.profile("smoke", trace)
    calls = {entry["name"]: entry["calls_per_step"] for entry in profiled["labels"]}
    layers = profiled["layers"]
    assert layers == 16
    assert calls["mgpu::bn_backward"] == layers, "the backward runs in the calling thread, once per layer"
    if profiled["replica_threads_profiled"]:  # a torch without profile_all_threads records the calling thread only
        assert calls["mgpu::bn_whole_batch"] == calls["mgpu::bn_statistics"] == layers, "by the last to arrive"
        assert calls["mgpu::bn_call"] == calls["mgpu::bn_meeting"] == 2 * layers, "once per layer in each replica"
        assert calls["mgpu::replica_thread"] == 2
        assert calls["mgpu::function_mode"] > calls["mgpu::bn_call"], "every torch call of a replica goes through it"
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(event.get("name") == "mgpu::bn_backward" for event in events)
    from lightning_mgpu.replica_state import batchnorm as engine_batchnorm

    assert not hasattr(engine_batchnorm._fused_backward, "__wrapped__"), "the labels come off after the profile"


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the script runs for real")
def test_the_gpu_check_runs_each_part_and_fails_without_a_gpu(tmp_path: Path) -> None:
    """Without CUDA the CUDA tests are all skipped and the CUDA benchmarks refuse: the script says so by its status."""
    env = clean_env(OUT=str(tmp_path))
    command = ["bash", "benchmarks/gpu_check.sh"]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert (tmp_path / "machine.txt").read_text().startswith(f"python {sys.version.split()[0]}, torch ")
    tests = (tmp_path / "cuda-tests.log").read_text()
    assert "skipped" in tests, tests[-2000:]
    assert "failed" not in tests, tests[-2000:]
    assert "error" not in tests.lower(), tests[-2000:]
    assert "test_cuda.py" in tests, "the skip reasons are listed"
    assert "torch sees no CUDA device here" in (tmp_path / "benchmarks.log").read_text()


def test_the_replica_rule_benchmark_measures_each_case_with_and_without_the_rule(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from benchmarks import replica_rule

    rows = replica_rule.summary(replica_rule.measure(loops=1, repeats=2, warmup=1))
    cases = [(depth, replicas) for depth in (1, 16) for replicas in (2, 4)]
    assert [(row["kind"], row["depth"], row["replicas"]) for row in rows] == [
        (kind, depth, replicas) for kind in ("linear", "bn") for depth, replicas in cases
    ]
    for row in rows:
        assert row["with_rule_us"] > 0
        assert row["without_rule_us"] > 0
        low, high = row["ratio_range"]
        assert low <= row["ratio"] <= high
    replica_rule.main(["--loops", "1", "--repeats", "1"])
    printed = capsys.readouterr().out.splitlines()
    cases = ["depth  1 x2", "depth  1 x4", "depth 16 x2", "depth 16 x4"]
    expected = [f"{kind:6s} {case}" for kind in ("linear", "bn") for case in cases]
    assert [line.split(":")[0] for line in printed] == expected


def test_the_replica_rule_benchmark_measures_a_conv_net_on_images_when_asked(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from benchmarks import replica_rule

    case = replica_rule._case("conv", 4, 2)
    try:
        assert tuple(case.x.shape) == replica_rule.CONV_IMAGES
        kinds = [type(module).__name__ for module in case.net]
        assert kinds.count("Conv2d") == 5, kinds
        assert kinds.count("BatchNorm2d") == 4, kinds
        assert case.wrapper.module is case.net
    finally:
        case.close()
    replica_rule.main(["--model", "conv", "--loops", "1", "--repeats", "1"])
    printed = capsys.readouterr().out.splitlines()
    cases = ["depth  1 x2", "depth  1 x4", "depth  4 x2", "depth  4 x4"]
    assert [line.split(":")[0] for line in printed] == [f"conv   {case}" for case in cases]
    for line in printed:
        assert float(line.split("with the rule")[1].split("us")[0]) > 0


@pytest.mark.slow
def test_the_side_by_side_benchmark_times_two_trees_in_alternating_worker_processes(tmp_path: Path) -> None:
    from benchmarks import against

    root = Path(against.__file__).resolve().parents[1]
    (row,) = against.measure(root, loops=1, repeats=2, warmup=1, cases=[("bn", 1, 2)], this=root)
    assert (row["kind"], row["depth"], row["replicas"]) == ("bn", 1, 2)
    assert row["this_us"] > 0
    assert row["other_us"] > 0
    low, high = row["ratio_range"]
    assert 0 < low <= row["ratio"] <= high
    with pytest.raises(SystemExit) as stopped:
        against.main([str(tmp_path)])
    assert stopped.value.code == 2


@pytest.mark.slow
def test_the_side_by_side_benchmark_times_lightning_training_steps_when_asked() -> None:
    from benchmarks import against

    root = Path(against.__file__).resolve().parents[1]
    (row,) = against.measure(root, loops=2, repeats=2, warmup=1, cases=[("linear", 1, 2)], this=root, step="lightning")
    assert (row["kind"], row["depth"], row["replicas"]) == ("linear", 1, 2)
    assert row["this_us"] > 0
    assert row["other_us"] > 0
    low, high = row["ratio_range"]
    assert 0 < low <= row["ratio"] <= high


@pytest.mark.slow
def test_the_metrics_benchmark_measures_what_a_collection_adds_on_one_device_and_on_replicas() -> None:
    from benchmarks import metrics

    rows = metrics.measure(loops=2, repeats=2, warmup=1, cases=[("auto", 1), ("mgpu_dp", 2)], uses=["update"])
    assert [(row["use"], row["strategy"], row["devices"]) for row in rows] == [
        ("update", "auto", 1),
        ("update", "mgpu_dp", 2),
    ]
    for row in rows:
        assert row["with_us"] > 0
        assert row["without_us"] > 0
        low, high = row["added_range"]
        assert low <= row["added_us"] <= high
    assert rows[0]["over_one_device"] == pytest.approx(1.0)
    assert rows[1]["over_one_device"] == pytest.approx(rows[1]["added_us"] / rows[0]["added_us"])
