"""The density example end to end: its CLI and config, its model under mgpu_dp against one device, its parameters."""

from __future__ import annotations

import csv
import importlib.util
import math
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import lightning as L
import pytest
import torch

import lightning_mgpu

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "quickstart.yaml"


def _load_example() -> ModuleType:
    # examples/ is not a package; register the module so jsonargparse and checkpoints can resolve its classes.
    spec = importlib.util.spec_from_file_location("density_example", ROOT / "examples" / "density.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


density = _load_example()


class _OneDeviceDensityModel(density.DensityModel):
    """The reference: on one device, Lightning 1.x handed each step's output straight to its ``*_step_end``."""

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.training_step_end(super().training_step(batch, batch_idx))

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.validation_step_end(super().validation_step(batch, batch_idx))


def _initial_weight(model: Any, k: int) -> float:
    scale = model.hparams.init_scale ** (1 / model.num_layers)
    return math.log(math.expm1(1 / scale / model.filters[k + 1]))


def test_quickstart_cli_fits_logs_and_checkpoints(tmp_path: Path) -> None:
    cli = density.main(
        [
            "fit",
            "--config",
            str(CONFIG),
            "--trainer.max_steps",
            "3",
            "--trainer.limit_train_batches",
            "3",
            "--trainer.limit_val_batches",
            "2",
            "--trainer.log_every_n_steps",
            "1",
            "--trainer.default_root_dir",
            str(tmp_path),
        ]
    )

    trainer = cli.trainer
    assert isinstance(trainer.strategy, lightning_mgpu.DataParallelStrategy)
    assert trainer.num_devices == 2
    assert trainer.global_step == 3
    for name in ("train_nll", "val_nll"):
        value = trainer.callback_metrics[name]
        assert value.numel() == 1
        assert math.isfinite(value.item())
        assert 0 < value.item() < 30  # bits per sample: ~5 for this mixture
    assert trainer.model is cli.model  # after fit the LightningModule itself, not a wrapper

    with open(Path(trainer.logger.log_dir) / "metrics.csv") as metrics_file:
        rows = list(csv.DictReader(metrics_file))
    train_nll = [float(row["train_nll"]) for row in rows if row.get("train_nll")]
    val_nll = [float(row["val_nll"]) for row in rows if row.get("val_nll")]
    assert len(train_nll) == 3
    assert len(val_nll) == 1
    assert all(math.isfinite(value) for value in train_nll + val_nll)
    assert (Path(trainer.logger.log_dir) / "config.yaml").is_file()

    checkpoints = sorted(tmp_path.rglob("*.ckpt"))
    assert [path.name for path in checkpoints] == ["epoch=0-step=3.ckpt"]
    state = torch.load(checkpoints[0], map_location="cpu", weights_only=False)["state_dict"]
    assert not any(key.startswith("module.") for key in state)
    loaded = density.DensityModel.load_from_checkpoint(checkpoints[0], map_location="cpu")
    assert loaded.hparams.lr == cli.model.hparams.lr
    for name, param in cli.model.named_parameters():
        torch.testing.assert_close(loaded.get_parameter(name), param, rtol=0, atol=0)

    # Three Adam steps moved every parameter off its initial value.
    for k in range(loaded.num_layers):
        H_k = loaded.get_parameter(f"H_{k}")
        assert not torch.allclose(H_k, torch.full_like(H_k, _initial_weight(loaded, k)))
        if k < loaded.num_layers - 1:
            assert loaded.get_parameter(f"a_{k}").abs().max() > 0


def _fit_three_steps(
    model: L.LightningModule, devices: int, strategy: Callable[[], Any]
) -> tuple[dict[str, torch.Tensor], float]:
    # 7 rows on 2 replicas split 4 + 3: an uneven split, where a plain mean of replica losses would be wrong.
    data = density.GaussianMixtureData(num_samples=21, num_val_samples=9, batch_size=7, shuffle=False, seed=3)
    quiet = {
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy(), max_steps=3, limit_val_batches=0, **quiet
    )
    trainer.fit(model, data)
    params = {name: param.detach().clone() for name, param in model.named_parameters()}
    validator = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy(), **quiet)
    (metrics,) = validator.validate(model, data, verbose=False)
    return params, metrics["val_nll"]


@pytest.mark.parametrize(
    "strategy",
    [lambda: "mgpu_dp", lambda: lightning_mgpu.DataParallelStrategy()],
    ids=["name", "instance"],
)
def test_two_replicas_match_one_device(strategy: Callable[[], Any]) -> None:
    torch.manual_seed(0)
    model = density.DensityModel(hidden_filters=(3, 3))
    reference = _OneDeviceDensityModel(hidden_filters=(3, 3))
    reference.load_state_dict(model.state_dict())
    initial = {name: param.detach().clone() for name, param in model.named_parameters()}

    params, val_nll = _fit_three_steps(model, devices=2, strategy=strategy)
    expected_params, expected_val_nll = _fit_three_steps(reference, devices=1, strategy=lambda: "auto")

    assert params.keys() == expected_params.keys() == initial.keys()
    for name in params:
        assert not torch.equal(params[name], initial[name]), f"{name} was not trained"
        torch.testing.assert_close(params[name], expected_params[name], rtol=0, atol=1e-6, msg=name)
    assert val_nll == pytest.approx(expected_val_nll, abs=1e-6)


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
