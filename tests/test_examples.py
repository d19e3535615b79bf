"""The examples end to end: the density model and the digits classifier, as scripts, under strategies, and the doctor.

The example scripts' defaults (``python examples/density.py``, ``python examples/classifier.py``) run here in full, in
this process; ``tests/test_cli.py`` runs the same scripts as subprocesses from another directory and under mgpu_ddp.
``lightning-mgpu test`` and ``predict`` run here on a checkpoint of a short ``fit`` of each example's config, in this
process under mgpu_dp and, for ``configs/ddp_cpu.yaml``, as 2 real processes.
"""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import struct
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import yaml
from processes import clean_env, free_port
from run_folders import column, read_metrics

import lightning_mgpu
from lightning_mgpu.cli import main as lightning_mgpu_main

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # examples is a package at the repository root

from examples import classifier, density  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
QUIET = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False}
CONFIGS = ROOT / "configs"
PROCESS_TIMEOUT = 120
# The quickstart's data, smaller; 1001 test samples make the last batch a single row (fewer rows than replicas, and
# one more row on DDP's rank 0 than on rank 1).
DENSITY_DATA = ["--data.init_args.num_samples", "2000", "--data.init_args.num_val_samples", "500"]
DENSITY_DATA += ["--data.init_args.num_test_samples", "1001"]
NUM_TEST_DIGITS = 180  # 10 % of the 1797 images


@pytest.fixture(autouse=True)
def _plain_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["example"])  # pytest's own arguments are not the CLI's


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from the PNG's IHDR chunk, which must come first."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    length, kind, width, height = struct.unpack(">I4sII", data[8:24])
    assert (length, kind) == (13, b"IHDR")
    assert data.endswith(b"IEND\xaeB`\x82")  # the closing chunk: the file was written whole
    return width, height


def read_predictions(path: Path) -> tuple[list[str], list[list[float]]]:
    """The header and the rows of a predictions file, read with the csv module alone (no torch needed)."""
    with open(path, newline="") as predictions_file:
        header, *rows = csv.reader(predictions_file)
    return header, [[float(value) for value in row] for row in rows]


def predictions_column(path: Path, name: str) -> torch.Tensor:
    header, rows = read_predictions(path)
    return torch.tensor([row[header.index(name)] for row in rows], dtype=torch.float64)


def _fit_checkpoint(root: Path, config: str, *overrides: str) -> Path:
    """The one checkpoint of ``lightning-mgpu fit --config configs/<config> --trainer.max_epochs 1 <overrides>``."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", ["lightning-mgpu"])
        args = ["fit", "--config", str(CONFIGS / config), "--trainer.max_epochs", "1", *overrides]
        assert lightning_mgpu_main([*args, "--trainer.default_root_dir", str(root)]) == 0
    (checkpoint,) = (root / "version_0" / "checkpoints").iterdir()
    return checkpoint


@pytest.fixture(scope="module")
def density_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _fit_checkpoint(tmp_path_factory.mktemp("density_fit"), "quickstart.yaml", *DENSITY_DATA)


@pytest.fixture(scope="module")
def classifier_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _fit_checkpoint(tmp_path_factory.mktemp("classifier_fit"), "classifier.yaml")


def _run_command(root: Path, subcommand: str, config: str, checkpoint: Path, *overrides: str) -> Path:
    """Run ``lightning-mgpu <subcommand> --config configs/<config> --ckpt_path <checkpoint>``; its run folder."""
    args = [subcommand, "--config", str(CONFIGS / config), "--ckpt_path", str(checkpoint), *overrides]
    assert lightning_mgpu_main([*args, "--trainer.default_root_dir", str(root)]) == 0
    return root / "version_0"


def _initial_weight(model: Any, k: int) -> float:
    scale = model.hparams.init_scale ** (1 / model.num_layers)
    return math.log(math.expm1(1 / scale / model.filters[k + 1]))


# The density example


def test_density_script_default_is_the_quickstart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)  # configs/quickstart.yaml writes to runs/quickstart under the current directory

    assert density.main([]) == 0  # python examples/density.py

    run_folder = tmp_path / "runs" / "quickstart" / "version_0"
    assert f"run folder:    {Path('runs/quickstart/version_0')}" in capsys.readouterr().out
    val_nll = column(read_metrics(run_folder), "val_nll")
    assert len(val_nll) == 15  # max_epochs
    assert val_nll[0] > val_nll[-1]
    assert val_nll[-1] < 4.9  # bits; the mixture's own entropy is ~4.78, the run ends near 4.82
    assert sorted(path.name for path in (run_folder / "checkpoints").iterdir()) == ["epoch=14-step=600.ckpt"]
    assert png_size(run_folder / "density.png") == (700, 350)


def _fit_density(root: Path, devices: int = 2, strategy: Any = "mgpu_dp") -> L.Trainer:
    data = density.GaussianMixtureData(num_samples=200, num_val_samples=50, batch_size=100, seed=1)
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=2, default_root_dir=root, **QUIET
    )
    trainer.fit(density.DensityModel(), data)
    return trainer


@pytest.mark.parametrize(("devices", "strategy"), [(1, "auto"), (2, "mgpu_dp")])
def test_density_plot_is_drawn_into_the_run_folder(tmp_path: Path, devices: int, strategy: str) -> None:
    _fit_density(tmp_path, devices, strategy)

    assert png_size(tmp_path / "density.png") == (700, 350)  # no logger: the run folder is default_root_dir


def test_density_plot_is_skipped_with_one_warning_without_matplotlib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit_density(tmp_path)

    about_matplotlib = [str(warning.message) for warning in caught if "matplotlib" in str(warning.message)]
    assert about_matplotlib == [
        'DensityPlot: matplotlib is not installed, so density.png is not drawn; pip install "lightning-mgpu[examples]"'
        " to get it."
    ]
    assert not (tmp_path / "density.png").exists()


def _fit_three_steps(
    model: L.LightningModule, devices: int, strategy: Callable[[], Any], root: Path
) -> tuple[dict[str, torch.Tensor], float]:
    # 7 rows on 2 replicas split 4 + 3: an uneven split, where a plain mean of replica losses would be wrong.
    data = density.GaussianMixtureData(num_samples=21, num_val_samples=9, batch_size=7, shuffle=False, seed=3)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy(),
        max_steps=3,
        limit_val_batches=0,
        default_root_dir=root,
        **QUIET,
    )
    trainer.fit(model, data)
    assert png_size(root / "density.png") == (700, 350)  # DensityPlot: without a logger, into default_root_dir
    params = {name: param.detach().clone() for name, param in model.named_parameters()}
    validator = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy(), **QUIET)
    (metrics,) = validator.validate(model, data, verbose=False)
    return params, metrics["val_nll"]


@pytest.mark.parametrize(
    "strategy",
    [lambda: "mgpu_dp", lambda: lightning_mgpu.MGPUDPStrategy()],
    ids=["name", "instance"],
)
def test_two_replicas_match_one_device_under_the_default_strategy(strategy: Callable[[], Any], tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = density.DensityModel(hidden_filters=(3, 3))
    reference = density.DensityModel(hidden_filters=(3, 3))  # MGPUMixin runs its *_step_end on one device too
    reference.load_state_dict(model.state_dict())
    initial = {name: param.detach().clone() for name, param in model.named_parameters()}

    params, val_nll = _fit_three_steps(model, devices=2, strategy=strategy, root=tmp_path / "two")
    expected_params, expected_val_nll = _fit_three_steps(reference, 1, strategy=lambda: "auto", root=tmp_path / "one")

    assert params.keys() == expected_params.keys() == initial.keys()
    for name in params:
        assert not torch.equal(params[name], initial[name]), f"{name} was not trained"
        torch.testing.assert_close(params[name], expected_params[name], rtol=0, atol=1e-6, msg=name)
    assert val_nll == pytest.approx(expected_val_nll, abs=1e-6)
    assert 0 < val_nll < 30  # bits per sample


def test_parameters_are_registered_by_name() -> None:
    model = density.DensityModel(channels=2, hidden_filters=(3, 4))
    shapes = {name: tuple(param.shape) for name, param in model.named_parameters()}
    assert shapes == {
        "H_0": (2, 3, 1),
        "a_0": (2, 3, 1),
        "b_0": (2, 3, 1),
        "H_1": (2, 4, 3),
        "a_1": (2, 4, 1),
        "b_1": (2, 4, 1),
        "H_2": (2, 1, 4),
        "b_2": (2, 1, 1),
    }
    for k in range(model.num_layers):
        torch.testing.assert_close(
            model.get_parameter(f"H_{k}"), torch.full(shapes[f"H_{k}"], _initial_weight(model, k))
        )
    for k in range(model.num_layers - 1):
        assert torch.count_nonzero(model.get_parameter(f"a_{k}")) == 0
    biases = torch.cat([model.get_parameter(f"b_{k}").flatten() for k in range(model.num_layers)])
    assert biases.min() >= -0.5
    assert biases.max() <= 0.5


def test_softplus_keeps_weights_non_negative_and_the_cdf_monotonic() -> None:
    torch.manual_seed(0)
    model = density.DensityModel(hidden_filters=(3, 3, 3))
    with torch.no_grad():
        for k in range(model.num_layers):
            model.get_parameter(f"H_{k}").normal_(mean=-3.0, std=5.0)  # raw weights mostly negative
    assert min(model.get_parameter(f"H_{k}").min() for k in range(model.num_layers)) < 0
    for k in range(model.num_layers):
        assert torch.nn.functional.softplus(model.get_parameter(f"H_{k}")).min() >= 0

    grid = torch.linspace(-100.0, 100.0, 4001).unsqueeze(1)
    with torch.no_grad():
        logits = model.logits_cdf(grid).squeeze(1)
    assert torch.all(logits[1:] >= logits[:-1])


def test_likelihoods_are_bounded_and_sum_to_one_over_unit_bins() -> None:
    torch.manual_seed(0)
    model = density.DensityModel()
    bins = torch.arange(-300.0, 301.0).unsqueeze(1)
    with torch.no_grad():
        likelihoods = model(bins)
        far = model(torch.tensor([[-1e6], [1e6]]))
    assert likelihoods.shape == (601,)
    assert likelihoods.min() >= density.LIKELIHOOD_BOUND
    assert likelihoods.max() <= 1
    # Masses of adjacent unit bins telescope to CDF(300.5) - CDF(-300.5), which is 1 up to the tail bound.
    assert likelihoods.sum().item() == pytest.approx(1.0, abs=1e-4)
    torch.testing.assert_close(far, torch.full((2,), density.LIKELIHOOD_BOUND))
    assert torch.isfinite(density.nll_bits(far))


FLOAT32_CDF_DIFFERENCE = 32 * torch.finfo(torch.float32).eps
"""How far two float32 evaluations of the density model's likelihoods may be apart: 3.8e-6.

A likelihood is the difference of two CDF values in [0, 1] (the mass on ``[x - 0.5, x + 0.5]``), each computed in
float32 through the model's layers, so it is exact to a few units of float32 rounding at 1 (eps = 1.19e-7) per layer,
whatever its own size. Evaluations of different shapes round differently, because CPU kernels vectorise the rows
and handle the leftover ones apart: the 1001 test samples in one batch, ``predict``'s batches, each split across 2
replicas, and one device's batches disagree by 0.3 eps on one machine and by 12 eps on another (1.43e-6). 32 eps
bounds that with room, and stays far below the test samples' likelihoods themselves (the test checks 100 times).
"""


def _density_test_samples(checkpoint: Path, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """The test samples of ``DENSITY_DATA`` and their likelihoods under the checkpoint, computed directly in ``dtype``.

    All 1001 samples go through the model in one batch.
    """
    data = density.GaussianMixtureData(num_samples=2000, num_val_samples=500, num_test_samples=1001, seed=0)
    data.setup("test")
    assert data.test_data is not None
    model = density.DensityModel.load_from_checkpoint(checkpoint, map_location="cpu").to(dtype)
    with torch.no_grad():
        return data.test_data, model(data.test_data.to(dtype))


def test_density_test_scores_the_held_out_samples(
    density_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_folder = _run_command(tmp_path, "test", "quickstart.yaml", density_checkpoint, *DENSITY_DATA)

    (test_nll,) = column(read_metrics(run_folder), "test_nll")
    samples, likelihoods = _density_test_samples(density_checkpoint)
    assert test_nll == pytest.approx(density.nll_bits(likelihoods).item(), abs=1e-5)  # 500 + 500 + 1 rows, weighted
    assert 4 < test_nll < 10  # bits; one short epoch
    assert "test_nll=" in capsys.readouterr().out

    data = density.GaussianMixtureData(num_samples=2000, num_val_samples=500, num_test_samples=1001, seed=0)
    data.setup("fit")
    assert data.train_data is not None
    assert data.val_data is not None
    assert not set(samples.flatten().tolist()) & set(torch.cat([data.train_data, data.val_data]).flatten().tolist())


def test_density_predict_writes_every_test_sample_likelihood_in_order(density_checkpoint: Path, tmp_path: Path) -> None:
    two = _run_command(tmp_path / "two", "predict", "quickstart.yaml", density_checkpoint, *DENSITY_DATA)
    one = _run_command(
        tmp_path / "one", "predict", "quickstart.yaml", density_checkpoint, *DENSITY_DATA, "--trainer.devices", "1"
    )

    header, rows = read_predictions(two / "predictions.csv")
    assert header == ["index", "x", "likelihood", "nll_bits"]
    assert [row[0] for row in rows] == list(range(1001))  # one row per test sample, in dataset order
    samples, likelihoods = _density_test_samples(density_checkpoint)
    exact = _density_test_samples(density_checkpoint, torch.float64)[1]
    path = two / "predictions.csv"
    torch.testing.assert_close(predictions_column(path, "x"), samples.squeeze(1).double(), rtol=0, atol=0)
    likelihood = predictions_column(path, "likelihood")
    assert exact.min() > 100 * FLOAT32_CDF_DIFFERENCE, "the tolerance is small beside every likelihood"
    for reference in (likelihoods.double(), exact):
        torch.testing.assert_close(likelihood, reference, rtol=0, atol=FLOAT32_CDF_DIFFERENCE)
    assert density.LIKELIHOOD_BOUND <= likelihood.min() <= likelihood.max() <= 1
    torch.testing.assert_close(predictions_column(path, "nll_bits"), -torch.log2(likelihood), rtol=1e-6, atol=1e-6)
    for name in header:  # mgpu_dp on 2 replicas gives one device's predictions
        torch.testing.assert_close(
            predictions_column(one / "predictions.csv", name),
            predictions_column(path, name),
            rtol=0,
            atol=FLOAT32_CDF_DIFFERENCE,
        )


@pytest.fixture
def stop_on_exit() -> Iterator[list[subprocess.Popen[str]]]:
    processes: list[subprocess.Popen[str]] = []
    yield processes
    for process in processes:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)  # its own session: the rank it started goes with it
            process.wait()


@pytest.mark.slow
def test_ddp_cpu_predict_gathers_both_processes_rows_into_one_file(
    density_checkpoint: Path, tmp_path: Path, stop_on_exit: list[subprocess.Popen[str]]
) -> None:
    args = ["-m", "lightning_mgpu", "predict", "--config", "configs/ddp_cpu.yaml", *DENSITY_DATA]
    args += ["--ckpt_path", str(density_checkpoint), "--trainer.default_root_dir", str(tmp_path)]
    process = subprocess.Popen(
        [sys.executable, *args],
        cwd=ROOT,
        env=clean_env(MASTER_PORT=str(free_port())),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    stop_on_exit.append(process)
    try:
        output, _ = process.communicate(timeout=PROCESS_TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"lightning-mgpu predict under mgpu_ddp did not end within {PROCESS_TIMEOUT} s")

    assert process.returncode == 0, output[-4000:]
    assert "Starting with 2 processes" in output
    run_folder = tmp_path / "version_0"
    assert sorted(path.name for path in run_folder.glob("predictions*")) == ["predictions.csv"]  # rank 0's alone
    path = run_folder / "predictions.csv"
    header, rows = read_predictions(path)
    assert header == ["index", "x", "likelihood", "nll_bits"]
    assert [row[0] for row in rows] == list(range(1001))  # rank 0's 501 and rank 1's 500 rows, interleaved back
    samples, likelihoods = _density_test_samples(density_checkpoint)
    torch.testing.assert_close(predictions_column(path, "x"), samples.squeeze(1).double(), rtol=0, atol=0)
    torch.testing.assert_close(predictions_column(path, "likelihood"), likelihoods.double(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("subcommand", ["test", "predict"])
@pytest.mark.parametrize("config", ["dp_gpu.yaml", "ddp_gpu.yaml"])
def test_gpu_configs_parse_for_test_and_predict(
    config: str, subcommand: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        lightning_mgpu_main([subcommand, "--config", str(CONFIGS / config), "--print_config"])
    assert exit_.value.code in (0, None)
    parsed = yaml.safe_load(capsys.readouterr().out)
    assert parsed["trainer"]["accelerator"] == "gpu"
    assert parsed["data"]["init_args"]["num_test_samples"] == 4000


@pytest.mark.parametrize("example", [density, classifier])
def test_scripts_reject_an_unknown_subcommand_with_the_usage(example: Any, capsys: pytest.CaptureFixture[str]) -> None:
    assert example.main(["train"]) == 2
    name = Path(example.__file__).name
    assert capsys.readouterr().err == f"usage: python examples/{name} [fit|validate|test|predict] [options]\n"


# The digits classifier


def test_digits_are_split_by_seed_into_float_images() -> None:
    data = classifier.DigitsData(seed=0)
    data.setup("fit")
    assert data.train_set is not None
    assert data.val_set is not None
    assert data.test_set is not None
    train_images, train_labels = data.train_set.tensors
    val_images, val_labels = data.val_set.tensors
    test_images, test_labels = data.test_set.tensors
    assert (len(train_labels), len(val_labels), len(test_labels)) == (1437, 180, NUM_TEST_DIGITS)
    assert train_images.shape[1:] == (1, 8, 8)
    assert train_images.dtype == torch.float32
    assert 0 <= train_images.min() <= train_images.max() <= 1
    # Every image in exactly one split: no image twice, and together the splits hold the whole dataset.
    from sklearn.datasets import load_digits

    digits = load_digits()
    everything = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    splits = torch.cat([train_images, val_images, test_images]).flatten(1)
    assert len(torch.unique(splits, dim=0)) == len(torch.unique(everything.flatten(1), dim=0))
    assert torch.equal(torch.sort(splits, dim=0).values, torch.sort(everything.flatten(1), dim=0).values)
    labels = torch.cat([train_labels, val_labels, test_labels])
    assert torch.equal(torch.bincount(labels), torch.bincount(torch.tensor(digits.target)))
    assert torch.bincount(val_labels).min() > 10  # every class in the validation split
    assert torch.bincount(test_labels).min() > 10  # and in the test split
    predict_images, predict_labels = next(iter(data.predict_dataloader()))
    torch.testing.assert_close(predict_images, test_images[:64], rtol=0, atol=0)  # predict: the test images, in order

    again = classifier.DigitsData(seed=0)
    again.setup("fit")
    assert again.val_set is not None
    torch.testing.assert_close(again.val_set.tensors[0], val_images, rtol=0, atol=0)
    other = classifier.DigitsData(seed=1)
    other.setup("fit")
    assert other.val_set is not None
    assert not torch.equal(other.val_set.tensors[1], val_labels)

    (images, labels), *_ = data.train_dataloader()
    assert images.shape == (64, 1, 8, 8)
    assert labels.dtype == torch.long


def test_classifier_script_default_reaches_90_percent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)  # configs/classifier.yaml writes to runs/classifier under the current directory

    assert classifier.main([]) == 0  # python examples/classifier.py

    run_folder = tmp_path / "runs" / "classifier" / "version_0"
    output = capsys.readouterr().out
    assert "lightning-mgpu fit: done" in output
    val_acc = column(read_metrics(run_folder), "val_acc")
    assert len(val_acc) == 10  # max_epochs
    assert val_acc[-1] > 0.9  # ~0.97
    assert val_acc[-1] > val_acc[0]
    # ModelCheckpoint(monitor="val_acc", mode="max") keeps the best epoch.
    (checkpoint,) = (run_folder / "checkpoints").iterdir()
    best_epoch = max(range(len(val_acc)), key=lambda epoch: (val_acc[epoch], -epoch))
    assert checkpoint.name.startswith(f"epoch={best_epoch}-")


def test_val_acc_counts_every_gathered_prediction_once() -> None:
    torch.manual_seed(0)
    model = classifier.DigitsClassifier(hidden=16)
    data = classifier.DigitsData(batch_size=50)  # 359 images: 7 batches of 50 and one of 9, each split 2 ways
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="mgpu_dp", **QUIET)

    (metrics,) = trainer.validate(model, data, verbose=False)

    assert data.val_set is not None
    images, labels = data.val_set.tensors
    with torch.no_grad():
        logits = model(images)
    assert metrics["val_acc"] == pytest.approx((logits.argmax(dim=1) == labels).float().mean().item(), abs=1e-6)
    expected_loss = torch.nn.functional.cross_entropy(logits, labels).item()
    assert metrics["val_loss"] == pytest.approx(expected_loss, rel=1e-5)  # batch means weighted by batch size


def _classifier_test_logits(checkpoint: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of the test images under the checkpoint, computed directly, and the images' labels."""
    data = classifier.DigitsData()
    data.setup("test")
    assert data.test_set is not None
    images, labels = data.test_set.tensors
    model = classifier.DigitsClassifier.load_from_checkpoint(checkpoint, map_location="cpu")
    with torch.no_grad():
        return model(images), labels


def test_classifier_test_scores_the_test_split(
    classifier_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_folder = _run_command(tmp_path, "test", "classifier.yaml", classifier_checkpoint)

    metrics = read_metrics(run_folder)
    (test_acc,), (test_loss,) = column(metrics, "test_acc"), column(metrics, "test_loss")
    logits, labels = _classifier_test_logits(classifier_checkpoint)
    assert test_acc == pytest.approx((logits.argmax(dim=1) == labels).double().mean().item(), abs=1e-6)
    assert test_loss == pytest.approx(torch.nn.functional.cross_entropy(logits, labels).item(), rel=1e-5)
    assert test_acc > 0.5  # one epoch: ~0.8
    output = capsys.readouterr().out
    assert "test_acc=" in output
    assert "test_loss=" in output


def test_classifier_predict_writes_each_test_image_probabilities_in_order(
    classifier_checkpoint: Path, tmp_path: Path
) -> None:
    two = _run_command(tmp_path / "two", "predict", "classifier.yaml", classifier_checkpoint)
    one = _run_command(tmp_path / "one", "predict", "classifier.yaml", classifier_checkpoint, "--trainer.devices", "1")

    path = two / "predictions.csv"
    header, rows = read_predictions(path)
    probability_columns = [f"probability_{digit}" for digit in range(10)]
    assert header == ["index", "label", "predicted", *probability_columns]
    assert [row[0] for row in rows] == list(range(NUM_TEST_DIGITS))  # one row per test image, in dataset order
    probabilities = torch.stack([predictions_column(path, name) for name in probability_columns], dim=1)
    assert 0 <= probabilities.min() <= probabilities.max() <= 1
    ones = torch.ones(NUM_TEST_DIGITS, dtype=torch.float64)
    torch.testing.assert_close(probabilities.sum(dim=1), ones, rtol=0, atol=1e-6)  # float32 softmax
    logits, labels = _classifier_test_logits(classifier_checkpoint)
    torch.testing.assert_close(probabilities, logits.softmax(dim=1).double(), rtol=0, atol=1e-6)
    assert torch.equal(predictions_column(path, "label").long(), labels)
    assert torch.equal(predictions_column(path, "predicted").long(), probabilities.argmax(dim=1))
    for name in header:  # mgpu_dp on 2 replicas gives one device's predictions
        torch.testing.assert_close(
            predictions_column(one / "predictions.csv", name), predictions_column(path, name), rtol=0, atol=1e-6
        )


@pytest.mark.parametrize(
    ("model", "target", "exit_code"),
    [
        ("examples.classifier.DigitsClassifier", "mgpu_dp", 0),
        ("examples.classifier.DigitsClassifier", "mgpu_ddp", 0),
        ("examples.classifier.BatchNormDigitsClassifier", "mgpu_dp", 0),
        ("examples.classifier.BatchNormDigitsClassifier", "mgpu_ddp", 1),
    ],
)
def test_doctor_flags_batchnorm_in_the_classifier_only_where_it_differs(
    model: str, target: str, exit_code: int, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["doctor", "--model", model, "--data", "examples.classifier.DigitsData", "--target", target, "--json"]
    assert lightning_mgpu_main(args) == exit_code

    report = json.loads(capsys.readouterr().out)
    assert report["chunk_sizes"] == [32, 32]  # the default batch of 64 on 2 virtual replicas
    findings = {(finding["level"], finding["check"], finding["where"]) for finding in report["findings"]}
    if exit_code == 0:
        # mgpu_dp exchanges BatchNorm statistics between its replicas, so the BatchNorm twin is exact there too.
        assert not [finding for finding in findings if finding[0] == "error"]
        assert {comparison["verdict"] for comparison in report["comparisons"]} == {"same"}
    else:
        assert ("error", "batch-dependent", "step output['logits']") in findings
        assert {("warning", "batchnorm", "net.2"), ("warning", "batchnorm", "net.5")} <= findings
        verdicts = {comparison["what"]: comparison["verdict"] for comparison in report["comparisons"]}
        assert verdicts["step output['logits']"] == "differs"
        assert verdicts["net.1.weight.grad"] == "differs"
        assert verdicts["net.2.running_mean"] == "differs"


def test_doctor_reads_the_classifier_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert lightning_mgpu_main(["doctor", "--config", str(ROOT / "configs" / "classifier.yaml"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["findings"] == []
    assert report["seed"] == 0  # the config's seed_everything
    assert report["batch_rows"] == 64
