"""Balanced mgpu_dp: ``device_weights`` / ``chunk_weights`` give each device a chosen share of every batch.

The split must stay exact (sizes sum to the batch, each within one row of its share, contiguous chunks in batch
order), training must equal one device's, and every bad weight vector must fail before any step with a message
that names the cause and the fix.
"""

from __future__ import annotations

import math
import random
import re
from fractions import Fraction
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import lightning_mgpu
from lightning_mgpu import ConfigurationError, MGPUDataParallel, MGPUDPStrategy
from lightning_mgpu.engine.scatter import chunk_sizes, scatter, scatter_to_devices, weighted_chunk_sizes
from lightning_mgpu.step.replicas import run_replica_step

REPOSITORY = Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")

# --------------------------------------------------------------------------------------------- chunk sizes


@pytest.mark.parametrize(
    ("batch_size", "weights", "expected"),
    [
        (7, [1, 2, 2, 2], [1, 2, 2, 2]),
        (8, [1, 3], [2, 6]),
        (10, [1, 1, 1], [4, 3, 3]),  # equal weights: the even split, earlier devices take the extra rows
        (10, [0.1, 0.2, 0.7], [1, 2, 7]),  # floats that are not binary fractions still split exactly
        (9, [0, 1, 1, 1], [0, 3, 3, 3]),  # the root takes no rows
        (6, [1, 2, 2], [1, 3, 2]),  # 1.2, 2.4, 2.4: the tie of remainders goes to the earlier device
        (3, [1, 2, 2, 2], [0, 1, 1, 1]),  # shares 3/7, 6/7, 6/7, 6/7
        (5, [1, 10], [0, 5]),  # 5/11 rounds to no rows
        (1, [1, 1], [1, 0]),
        (100, [1, 2, 2, 2], [14, 29, 29, 28]),  # 14.29, 28.57 x3: the largest remainders win, the first on a tie
    ],
)
def test_weighted_chunk_sizes(batch_size: int, weights: list[float], expected: list[int]) -> None:
    assert weighted_chunk_sizes(batch_size, weights) == expected


def test_weighted_chunk_sizes_hold_their_properties_for_random_weights() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        devices = rng.randint(1, 6)
        weights: list[float] = [rng.choice([0, 1, 2, 3, 7, 0.5, 1e-3, 2.75, 1e6]) for _ in range(devices)]
        if not any(weights):
            weights[rng.randrange(devices)] = 1
        batch_size = rng.randint(1, 300)
        sizes = weighted_chunk_sizes(batch_size, weights)
        total = sum(Fraction(weight) for weight in weights)
        assert len(sizes) == devices
        assert sum(sizes) == batch_size
        assert all(size >= 0 for size in sizes)
        for size, weight in zip(sizes, weights, strict=True):
            ideal = batch_size * Fraction(weight) / total
            assert abs(size - ideal) < 1, (batch_size, weights, sizes)
            if weight == 0:
                assert size == 0
        for i in range(devices):  # a larger share never gets fewer rows
            for j in range(devices):
                if weights[i] > weights[j]:
                    assert sizes[i] >= sizes[j], (batch_size, weights, sizes)
        assert weighted_chunk_sizes(batch_size, list(weights)) == sizes  # deterministic


@pytest.mark.parametrize("devices", [1, 2, 3, 4, 7])
def test_equal_weights_split_as_the_even_split(devices: int) -> None:
    for batch_size in range(1, 40):
        even = chunk_sizes(batch_size, devices)
        assert weighted_chunk_sizes(batch_size, [2.5] * devices) == even + [0] * (devices - len(even))


def test_scatter_gives_contiguous_chunks_in_batch_order_to_the_devices_with_rows() -> None:
    devices = [torch.device("cpu", index) for index in range(4)]  # distinct names, so the placement shows
    batch = {"x": torch.arange(20.0).view(10, 2), "ids": [f"s{row}" for row in range(10)]}

    chunks, sizes, used = scatter_to_devices(batch, devices, weights=[0, 1, 3, 1])
    assert sizes == [2, 6, 2]
    assert used == devices[1:]
    assert torch.equal(torch.cat([chunk["x"] for chunk in chunks]), batch["x"])
    assert [chunk["ids"] for chunk in chunks] == [["s0", "s1"], [f"s{row}" for row in range(2, 8)], ["s8", "s9"]]

    # Without weights nothing changes: the even split onto the first devices.
    even_chunks, even_sizes, even_used = scatter_to_devices(batch, devices)
    assert (even_sizes, even_used) == ([3, 3, 2, 2], devices)
    plain_chunks, plain_sizes = scatter(batch, devices)
    assert plain_sizes == even_sizes
    for plain, even in zip(plain_chunks, even_chunks, strict=True):
        assert torch.equal(plain["x"], even["x"])
        assert plain["ids"] == even["ids"]
    _, tiny_sizes, tiny_used = scatter_to_devices(torch.zeros(2, 1), devices)
    assert (tiny_sizes, tiny_used) == ([1, 1], devices[:2])


# --------------------------------------------------------------------------------------------- the engine


class RowRecorder(nn.Module):
    """Returns its input and the rows of the replica that saw each row, so placement and order both show."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"x": x * self.scale, "rows": torch.full((x.shape[0],), x.shape[0])}


def test_the_engine_splits_by_chunk_weights_and_gathers_in_batch_order() -> None:
    module = RowRecorder()
    seen: list[int] = []
    module.register_forward_hook(lambda _, inputs, __: seen.append(inputs[0].shape[0]))  # runs in every replica
    wrapper = MGPUDataParallel(module, [CPU] * 4, chunk_weights=[1, 2, 2, 2])
    try:
        x = torch.randn(14, 3)
        out = wrapper(x)
        assert sorted(seen) == [2, 4, 4, 4]
        assert torch.equal(out["x"], x)  # gathered in batch order
        assert out["rows"].tolist() == [2] * 2 + [4] * 12  # the root's 2 rows come first, then 4 per device
        assert wrapper.run("forward", torch.randn(7, 3)).sizes == [1, 2, 2, 2]
        assert wrapper.run("forward", torch.randn(3, 3)).sizes == [1, 1, 1]  # the root rounds to no rows
    finally:
        wrapper.close()


def test_the_engine_without_chunk_weights_splits_evenly_as_before() -> None:
    module = RowRecorder()
    wrapper = MGPUDataParallel(module, [CPU] * 4)
    try:
        assert wrapper.chunk_weights is None
        assert wrapper.run("forward", torch.randn(5, 3)).sizes == [2, 1, 1, 1]
        assert wrapper.run("forward", torch.randn(3, 3)).sizes == [1, 1, 1]
        x = torch.randn(9, 3)
        out = wrapper(x)
        assert torch.equal(out["x"], x)
        assert out["rows"].tolist() == [3] * 3 + [2] * 6
    finally:
        wrapper.close()


def _net(norm: str) -> nn.Sequential:
    torch.manual_seed(0)
    middle: nn.Module = nn.LayerNorm(16) if norm == "layer" else nn.BatchNorm1d(16)
    return nn.Sequential(nn.Linear(5, 16), middle, nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))


@pytest.mark.parametrize("norm", ["layer", "batch"])
def test_the_engine_with_uneven_weights_computes_what_one_device_computes(norm: str) -> None:
    torch.manual_seed(1)
    x, y = torch.randn(11, 5), torch.randn(11, 1)
    reference, split = _net(norm), _net(norm)
    expected = F.mse_loss(reference(x), y)
    expected.backward()
    wrapper = MGPUDataParallel(split, [CPU] * 3, chunk_weights=[1, 3, 3])  # 11 rows: 2 + 5 + 4
    try:
        loss = F.mse_loss(wrapper(x), y)
        loss.backward()
    finally:
        wrapper.close()
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-6)
    for (name, mine), theirs in zip(split.named_parameters(), reference.parameters(), strict=True):
        assert mine.grad is not None, name
        assert theirs.grad is not None, name
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=0, atol=1e-6, msg=name)
    for mine, theirs in zip(split.buffers(), reference.buffers(), strict=True):  # running statistics
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)


def test_running_statistics_are_kept_when_the_root_device_gets_no_rows() -> None:
    # Distinct device names make replica 0, on the first device with rows, work on copies of the module's buffers,
    # as it does on a second GPU; the module must still end with the whole batch's running statistics.
    devices = [torch.device("cpu", index) for index in range(3)]
    reference, split = _net("batch"), _net("batch")
    wrapper = MGPUDataParallel(split, devices, chunk_weights=[0, 1, 2])
    try:
        torch.manual_seed(1)
        for _ in range(3):
            x = torch.randn(6, 5)
            assert scatter_to_devices(x, devices, weights=[0, 1, 2])[1:] == ([2, 4], devices[1:])
            wrapper(x).sum().backward()
            reference(x).sum().backward()
    finally:
        wrapper.close()
    assert split[1].num_batches_tracked.item() == 3
    assert split[1].running_mean.abs().max().item() > 1e-2  # the statistics moved from their initial zeros
    for mine, theirs in zip(split.buffers(), reference.buffers(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)
    for mine, theirs in zip(split.parameters(), reference.parameters(), strict=True):
        assert mine.grad is not None
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=0, atol=1e-5)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_a_root_gpu_without_rows_keeps_its_buffers_and_matches_one_device() -> None:
    devices = [torch.device("cuda", 0), torch.device("cuda", 1)]
    reference, split = _net("batch").to(devices[0]), _net("batch").to(devices[0])
    wrapper = MGPUDataParallel(split, devices, chunk_weights=[0, 1])
    try:
        torch.manual_seed(1)
        for _ in range(3):
            x = torch.randn(8, 5, device=devices[0])
            wrapper(x).sum().backward()
            reference(x).sum().backward()
    finally:
        wrapper.close()
    for name, buffer in split.named_buffers():
        assert buffer.device == devices[0], name
    for mine, theirs in zip(split.buffers(), reference.buffers(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-5)
    for mine, theirs in zip(split.parameters(), reference.parameters(), strict=True):
        assert mine.grad is not None
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=0, atol=1e-5)


# --------------------------------------------------------------------------------------------- the strategy


class Net(L.LightningModule):
    """A stock network; the loss is a mean over the replica's rows, combined by mgpu_dp's default."""

    def __init__(self, norm: str) -> None:
        super().__init__()
        self.net = _net(norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.5)


class StepEndNet(Net):
    """The loss is computed over the gathered predictions in ``training_step_end``."""

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:  # type: ignore[override]
        x, y = batch
        return {"pred": self(x), "target": y}

    def training_step_end(self, outputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.mse_loss(outputs["pred"], outputs["target"])


def _data(rows: int = 42) -> DataLoader:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(rows, 5, generator=generator)
    y = x.sum(dim=1, keepdim=True).sin() + 0.1 * torch.randn(rows, 1, generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=10)  # 10, 10, 10, 10 and a last batch of 2


def _fit(model: L.LightningModule, devices: int, strategy: Any) -> dict[str, torch.Tensor]:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, _data())
    assert trainer.global_step == 10
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


@pytest.mark.parametrize("model_class", [Net, StepEndNet])
@pytest.mark.parametrize("norm", ["layer", "batch"])
@pytest.mark.parametrize("weights", [[1, 2, 2], [0, 1, 3]])
def test_training_with_device_weights_equals_one_device(
    model_class: type[Net], norm: str, weights: list[float]
) -> None:
    # 10 rows on [1, 2, 2]: 2 + 4 + 4, the last 2 rows: 0 + 1 + 1; on [0, 1, 3]: 0 + 3 + 7 and 0 + 0 + 2.
    expected = _fit(model_class(norm), 1, "mgpu_dp")
    untrained = model_class(norm).state_dict()
    actual = _fit(model_class(norm), len(weights), MGPUDPStrategy(device_weights=weights))
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=0, atol=1e-6, msg=name)
    moved = max((expected[name].float() - untrained[name].float()).abs().max().item() for name in expected)
    assert moved > 1e-2  # the comparison is between trained parameters


def test_the_default_loss_is_weighted_by_the_rows_each_replica_received() -> None:
    module = Net("layer")
    torch.manual_seed(2)
    batch = [torch.randn(8, 5), torch.randn(8, 1)]
    wrapper = MGPUDataParallel(module, [CPU] * 2, chunk_weights=[1, 3])
    try:
        replica_outputs = wrapper.run("training_step", batch, (0,))
        assert replica_outputs.sizes == [2, 6]
        plain_mean = torch.stack(replica_outputs.outputs).mean()
        loss = run_replica_step(wrapper, module, "training_step", (batch, 0), {})
    finally:
        wrapper.close()
    expected = module.training_step(batch, 0)
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-6)
    assert abs(plain_mean.item() - expected.item()) > 1e-3  # an unweighted mean would be wrong here


def test_device_weights_reach_the_engine(tmp_path: Path) -> None:
    strategy = MGPUDPStrategy(device_weights=[1, 3])
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=1, logger=False, default_root_dir=tmp_path
    )
    seen: list[list[int]] = []

    class Recording(Net):
        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            wrapper = self.trainer.strategy.model
            assert isinstance(wrapper, MGPUDataParallel)
            seen.append(list(wrapper.chunk_weights or ()))

    trainer.fit(Recording("layer"), _data())
    assert strategy.device_weights == (1, 3)
    assert seen == [[1, 3]]


# --------------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize("weights", [[1, -1], [1, math.nan], [math.inf, 1], [0, 0.0], [1, "2"], [True, 1], "12", 3])
def test_bad_device_weights_are_refused_when_the_strategy_is_made(weights: Any) -> None:
    with pytest.raises(ConfigurationError) as refused:
        MGPUDPStrategy(device_weights=weights)
    assert refused.value.setting == "MGPUDPStrategy.device_weights"


@pytest.mark.parametrize(
    ("weights", "match"),
    [
        ([1, -1], r"device_weights\[1\] is -1, but a device cannot take a negative share of the batch\. Give every"),
        ([1, math.nan], r"device_weights\[1\] is nan, which is not a finite number.*finite weight of 0 or more"),
        ([0, 0.0], r"device_weights is \[0, 0\.0\]: every weight is zero, so no device would get any rows\. Give at"),
        ([1, "2"], r"device_weights\[1\] is '2', but each weight must be a number"),
        (3, r"device_weights must be a list with one number per device.*got 3\. For example"),
    ],
    ids=["negative", "not finite", "all zero", "not a number", "not a list"],
)
def test_each_refusal_of_weights_names_the_entry_and_an_example(weights: Any, match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        MGPUDPStrategy(device_weights=weights)


@pytest.mark.parametrize(("devices", "weights"), [(2, [1, 2, 2]), (3, [1, 2]), (1, [1, 1])])
def test_a_weight_count_that_does_not_match_the_devices_fails_when_the_trainer_is_made(
    devices: int, weights: list[float]
) -> None:
    strategy = MGPUDPStrategy(device_weights=weights)
    match = (
        rf"device_weights has {len(weights)} weight\(s\), .* but MGPUDPStrategy has {devices} device\(s\) \(cpu.*\),"
        r" set by Trainer\(devices=\.\.\.\)\. Give one weight per device, in device order \(the first is the root"
        rf" device\), for example device_weights=\[{', '.join(['1'] * devices)}\]"
    )
    with pytest.raises(ConfigurationError, match=match):
        L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, logger=False)


def test_a_weight_count_that_does_not_match_parallel_devices_fails_at_once() -> None:
    with pytest.raises(ConfigurationError) as refused:
        MGPUDPStrategy(parallel_devices=[CPU, CPU], device_weights=[1])
    assert refused.value.setting == "MGPUDPStrategy.device_weights"


@pytest.mark.parametrize("weights", [[1, 1, 1], [-0.5, 1], [0, 0], [1, math.inf]])
def test_bad_chunk_weights_are_refused_by_the_engine(weights: list[float]) -> None:
    with pytest.raises(ConfigurationError) as refused:
        MGPUDataParallel(nn.Linear(2, 2), [CPU, CPU], chunk_weights=weights)
    assert refused.value.setting == "MGPUDataParallel.chunk_weights"
    wrapper = MGPUDataParallel(nn.Linear(2, 2), [CPU, CPU])
    try:
        with pytest.raises(ConfigurationError) as refused:
            wrapper.chunk_weights = weights
        assert refused.value.setting == "MGPUDataParallel.chunk_weights"
        assert wrapper.chunk_weights is None  # a refused value leaves the split as it was
    finally:
        wrapper.close()


# --------------------------------------------------------------------------------------------- LightningCLI


def test_device_weights_from_a_lightning_cli_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from lightning_mgpu.cli.lightning_cli import MGPULightningCLI

    monkeypatch.chdir(REPOSITORY)  # the quickstart config's model is examples.density, found from the repository root
    config = tmp_path / "balanced.yaml"
    config.write_text(
        "trainer:\n"
        "  strategy:\n"
        "    class_path: lightning_mgpu.MGPUDPStrategy\n"
        "    init_args:\n"
        "      device_weights: [1, 3]\n"
    )
    cli = MGPULightningCLI(
        args=["fit", "--config", str(REPOSITORY / "configs" / "quickstart.yaml"), "--config", str(config)]
        + ["--trainer.max_steps", "2", "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1"]
        + ["--trainer.default_root_dir", str(tmp_path / "runs")]
    )
    capsys.readouterr()
    strategy = cli.trainer.strategy
    assert type(strategy) is lightning_mgpu.MGPUDPStrategy
    assert strategy.device_weights == (1, 3)
    assert cli.trainer.global_step == 2
    assert math.isfinite(cli.trainer.callback_metrics["val_nll"].item())


def test_bad_device_weights_in_a_config_end_the_command_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from lightning_mgpu.cli import main

    monkeypatch.chdir(REPOSITORY)
    config = tmp_path / "bad.yaml"
    config.write_text(
        "trainer:\n"
        "  strategy:\n"
        "    class_path: lightning_mgpu.MGPUDPStrategy\n"
        "    init_args:\n"
        "      device_weights: [1, 1, 1]\n"
    )
    args = ["fit", "--config", str(REPOSITORY / "configs" / "quickstart.yaml"), "--config", str(config)]
    assert main([*args, "--trainer.default_root_dir", str(tmp_path / "runs")]) == 2
    message = capsys.readouterr().err
    assert re.search(
        r"^lightning-mgpu fit: device_weights has 3 weight\(s\), \[1\.0, 1\.0, 1\.0\], but MGPUDPStrategy has 2"
        r" device\(s\) \(cpu, cpu\), set by Trainer\(devices=\.\.\.\)\. Give one weight per device",
        message,
        re.MULTILINE,
    ), message
    assert not (tmp_path / "runs" / "version_0" / "checkpoints").exists()  # it stopped before training
