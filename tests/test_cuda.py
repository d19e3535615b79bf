"""What only a GPU can show: mgpu_dp on CUDA replicas, autocast in replica threads, mgpu_ddp's device and NCCL.

Every test here is skipped on a machine without enough CUDA devices (the CPU suite covers the same code paths with
virtual replicas and gloo); on a GPU machine ``python -m pytest -q tests/test_cuda.py`` runs them.

Lightning refuses a repeated GPU list (``Trainer(accelerator="gpu", devices=[0, 0])`` fails in
``lightning.fabric.utilities.device_parser._check_unique``), so two replicas on one GPU are asked for with
``MGPUDPStrategy(parallel_devices=[cuda:0, cuda:0])``, which Lightning keeps as the strategy's devices.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from models import Regressor, trainer
from processes import clean_env, free_port
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from zoo import DP_BATCH, ZOO, assert_same_training, train

from lightning_mgpu import MGPUDPStrategy

needs_one_gpu = pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs 1 CUDA GPU")
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")

ROOT = Path(__file__).resolve().parents[1]
DDP_SCRIPT = Path(__file__).parent / "scripts" / "cuda_ddp.py"
SUBPROCESS_TIMEOUT = 300
CUDA0 = torch.device("cuda", 0)
CUDA1 = torch.device("cuda", 1)
FEATURES = 8
ROWS = 64
BATCH = 16  # 8 rows per replica with 2 replicas: every step runs both


# --- shared pieces ---------------------------------------------------------------------------------------------------


@pytest.fixture
def exact_float32() -> Iterator[None]:
    """TF32 rounds matmul inputs to 10 mantissa bits, which alone would break a 1e-5 comparison; restored after."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture
def restore_environment() -> Iterator[None]:
    """Lightning's launcher writes MASTER_PORT, LOCAL_RANK, WORLD_SIZE, ... into os.environ even for one process.

    Left there, a later in-process Trainer would take LOCAL_RANK as a sign of an external launcher.
    """
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _data() -> DataLoader:
    """The same rows on every run, in the same order, independent of any global seed."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, FEATURES, generator=generator)
    y = x @ torch.randn(FEATURES, 1, generator=generator) + 0.1 * torch.randn(ROWS, 1, generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)


class BatchNormNet(L.LightningModule):
    """A real small model whose BatchNorm makes a wrong split visible: mgpu_dp must use the whole batch's statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers (BatchNorm's running statistics included), on the CPU wherever fit left the module."""
    return {name: tensor.detach().cpu().clone() for name, tensor in module.state_dict().items()}


def _fit(model: L.LightningModule, **trainer_kwargs: Any) -> dict[str, torch.Tensor]:
    trainer(**{"accelerator": "gpu", "max_epochs": 2, **trainer_kwargs}).fit(model, _data())
    return _state(model)


def _fit_on_one_gpu(model_class: type[L.LightningModule]) -> dict[str, torch.Tensor]:
    """The reference: Lightning's own single-device strategy on cuda:0."""
    L.seed_everything(0)
    return _fit(model_class(), devices=[0])


def _assert_same_state(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> None:
    assert left.keys() == right.keys()
    for name in left:
        torch.testing.assert_close(left[name], right[name], atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def _assert_trained(state: dict[str, torch.Tensor], model_class: type[L.LightningModule]) -> None:
    """Equal to the reference is only meaningful if training moved the weights away from the initial ones."""
    L.seed_everything(0)
    initial = _state(model_class())
    assert not torch.allclose(state["net.0.weight"], initial["net.0.weight"], atol=1e-3)


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype]:
    """Whether this thread autocasts on ``device_type``, and to what; the per-device-type calls are torch 2.4+."""
    if hasattr(torch, "get_autocast_dtype"):
        return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    if device_type == "cuda":  # torch 2.3
        return torch.is_autocast_enabled(), torch.get_autocast_gpu_dtype()
    return torch.is_autocast_cpu_enabled(), torch.get_autocast_cpu_dtype()


def _run(command: list[str]) -> subprocess.CompletedProcess:
    env = clean_env(MASTER_PORT=str(free_port()))
    return subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT, check=False
    )


# --- mgpu_dp: replicas on CUDA devices --------------------------------------------------------------------------------


@needs_one_gpu
def test_two_replicas_on_one_gpu_train_like_one_gpu(exact_float32: None) -> None:
    """Replicas on a repeated device alias the parameters; with synced BatchNorm the result equals one GPU's."""
    reference = _fit_on_one_gpu(BatchNormNet)
    L.seed_everything(0)
    strategy = MGPUDPStrategy(parallel_devices=[CUDA0] * 2)
    fitted = trainer(accelerator="gpu", devices="auto", strategy=strategy, max_epochs=2)
    model = BatchNormNet()
    fitted.fit(model, _data())
    assert fitted.strategy.num_replicas == 2
    assert fitted.strategy.root_device == CUDA0
    _assert_same_state(_state(model), reference)
    _assert_trained(reference, BatchNormNet)


@needs_two_gpus
def test_two_gpus_train_like_one_gpu_with_each_chunk_on_its_own_gpu(exact_float32: None) -> None:
    """Each replica computes on its own card (its chunk, its parameter copies), and the result equals one GPU's."""
    seen: list[tuple[int, torch.device, torch.device, torch.device]] = []

    class Recorder(BatchNormNet):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            seen.append((self.replica_index, batch[0].device, next(self.parameters()).device, self.device))
            return super().training_step(batch, batch_idx)

    reference = _fit_on_one_gpu(BatchNormNet)
    L.seed_everything(0)
    model = Recorder()
    state = _fit(model, devices=[0, 1], strategy="mgpu_dp")
    steps = 2 * ROWS // BATCH
    assert len(seen) == 2 * steps, "both replicas run every step"
    where = {index: {entry[1:] for entry in seen if entry[0] == index} for index in (0, 1)}
    assert where == {0: {(CUDA0, CUDA0, CUDA0)}, 1: {(CUDA1, CUDA1, CUDA1)}}
    _assert_same_state(state, reference)
    _assert_trained(reference, BatchNormNet)


@needs_one_gpu
@pytest.mark.parametrize(
    ("precision", "dtype"), [("bf16-mixed", torch.bfloat16), ("16-mixed", torch.float16)], ids=["bf16", "fp16"]
)
def test_replica_threads_run_under_the_precision_plugins_autocast(precision: str, dtype: torch.dtype) -> None:
    """Autocast is thread-local: mgpu_dp must enter the precision plugin's context in every replica thread."""
    if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bfloat16")
    seen: list[tuple[int, bool, bool, torch.dtype, torch.dtype]] = []

    class Recorder(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            out = self(x)
            enabled, autocast_dtype = _autocast_state("cuda")
            in_worker = threading.current_thread() is not threading.main_thread()
            seen.append((self.replica_index, in_worker, enabled, autocast_dtype, out.dtype))
            return F.mse_loss(out.float(), y)

    strategy = MGPUDPStrategy(parallel_devices=[CUDA0] * 2)
    model = Recorder(features=FEATURES)
    trainer(accelerator="gpu", devices="auto", strategy=strategy, precision=precision, max_steps=2).fit(model, _data())
    assert sorted(entry[0] for entry in seen) == [0, 0, 1, 1], "2 steps of 2 replicas"
    assert {entry[1:] for entry in seen} == {(True, True, dtype, dtype)}


# --- the zoo on CUDA: every stock module and training pattern under mgpu_dp ----------------------------------------


def _cuda_zoo_replicas() -> list[Any]:
    """Two replicas on one GPU, and where there are two GPUs, one replica on each."""
    return [
        pytest.param([CUDA0, CUDA0], id="2-on-cuda0", marks=needs_one_gpu),
        pytest.param([CUDA0, CUDA1], id="cuda0+cuda1", marks=needs_two_gpus),
    ]


@pytest.mark.parametrize("replicas", _cuda_zoo_replicas())
@pytest.mark.parametrize("name", sorted(ZOO))
def test_the_zoo_trains_on_cuda_replicas_like_one_gpu(
    name: str, replicas: list[torch.device], exact_float32: None
) -> None:
    """The CPU suite's zoo of stock modules and training patterns, its BatchNorm entries included, on CUDA.

    Compared to 1e-5, as the other CUDA tests here: the GPU's kernels for a chunk and for the whole batch may add in
    another order.
    """
    expected = train(ZOO[name], DP_BATCH, accelerator="gpu", devices=1)
    strategy = MGPUDPStrategy(parallel_devices=replicas)
    got = train(ZOO[name], DP_BATCH, accelerator="gpu", devices="auto", strategy=strategy)
    assert_same_training(got, expected, atol=1e-5)


# --- mgpu_ddp: the device is set before NCCL starts -----------------------------------------------------------------


@pytest.mark.parametrize("index", [pytest.param(0, marks=needs_one_gpu), pytest.param(1, marks=needs_two_gpus)])
def test_ddp_sets_the_device_before_nccl_starts(
    index: int, monkeypatch: pytest.MonkeyPatch, restore_environment: None
) -> None:
    """One process in this one: cuda:1 proves set_device ran (cuda:0 is torch's default), the spies prove the order."""
    events: list[tuple[str, Any]] = []
    set_device, init_process_group = torch.cuda.set_device, torch.distributed.init_process_group

    def spy_set_device(device: Any) -> None:
        events.append(("set_device", device if isinstance(device, int) else torch.device(device).index))
        set_device(device)

    def spy_init_process_group(*args: Any, **kwargs: Any) -> None:
        events.append(("init_process_group", args[0] if args else kwargs.get("backend")))
        init_process_group(*args, **kwargs)

    monkeypatch.setattr(torch.cuda, "set_device", spy_set_device)
    monkeypatch.setattr(torch.distributed, "init_process_group", spy_init_process_group)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    seen: list[dict[str, Any]] = []

    class Recorder(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            wrapper = self.trainer.strategy.model
            seen.append(
                {
                    "current_device": torch.cuda.current_device(),
                    "backend": torch.distributed.get_backend(),
                    "param_device": next(self.parameters()).device,
                    "batch_device": batch[0].device,
                    "device_ids": getattr(wrapper, "device_ids", None),
                    "output_device": getattr(wrapper, "output_device", None),
                }
            )
            return super().training_step(batch, batch_idx)

    try:
        trainer(accelerator="gpu", devices=[index], strategy="mgpu_ddp", max_steps=2).fit(
            Recorder(features=FEATURES), _data()
        )
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    device = torch.device("cuda", index)
    assert ("set_device", index) in events, events
    assert ("init_process_group", "nccl") in events, events
    assert events.index(("set_device", index)) < events.index(("init_process_group", "nccl")), events
    expected = {
        "current_device": index,
        "backend": "nccl",
        "param_device": device,
        "batch_device": device,
        "device_ids": [index],
        "output_device": index,
    }
    assert seen == [expected, expected]


@pytest.mark.slow
@needs_two_gpus
def test_ddp_on_two_gpus_each_rank_on_its_own_gpu_over_nccl(tmp_path: Path) -> None:
    """Lightning's launcher starts rank 1; each rank must train on cuda:<rank> and end with rank 0's parameters."""
    result = _run([sys.executable, str(DDP_SCRIPT), "--out", str(tmp_path)])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report == {
            "rank": rank,
            "world_size": 2,
            "current_device": rank,
            "backend": "nccl",
            "param_device": f"cuda:{rank}",
            "batch_device": f"cuda:{rank}",
            "wrapper": "DistributedDataParallel",
            "device_ids": [rank],
            "output_device": rank,
        }
    first, second = (torch.load(tmp_path / f"params-rank{rank}.pt") for rank in (0, 1))
    assert first.keys() == second.keys()
    for name in first:
        torch.testing.assert_close(first[name], second[name], atol=0, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


# --- the CUDA benchmarks --------------------------------------------------------------------------------------------

CUDA_ROWS = (
    "dp/mgpu_dp_vs_single",
    "dp/mgpu_dp_vs_torch_dp",
    "dp/engine_vs_torch_dp",
    "dp/engine_vs_raw",
    "dp/single_vs_raw",
    "dp/overhead_share",
    "dp/engine_overhead_share",
    "mixin/mixin_vs_single",
    "mixin/mixin_vs_single_cpu",
    "mixin/per_step_share",
)
"""The single-process rows of ``--device cuda`` (benchmarks/README.md); ``*_2t`` is CPU-only, ddp rows are skipped."""


@pytest.mark.slow
@needs_one_gpu
def test_cuda_benchmarks_smoke_mode_writes_the_cuda_rows(tmp_path: Path) -> None:
    """The CUDA path of the benchmarks had never run: smoke mode checks it end to end (no timing is asserted)."""
    command = [sys.executable, "-m", "benchmarks.run", "--smoke", "--device", "cuda", "--skip-ddp"]
    result = _run([*command, "--out", str(tmp_path)])
    output = result.stdout[-3000:] + result.stderr[-3000:]
    assert result.returncode == 0, output

    results = json.loads((tmp_path / "results.json").read_text())
    assert results["meta"]["mode"] == "smoke"
    assert results["meta"]["device"] == "cuda"
    assert results["meta"]["world_size"] == torch.cuda.device_count()
    rows = {row["id"]: row for row in results["rows"]}
    expected = {f"{name}/{model}" for name in CUDA_ROWS for model in ("mlp", "conv")}
    assert expected <= set(rows), sorted(expected - set(rows))
    assert not {row_id for row_id in rows if row_id.startswith("dp/mgpu_dp_vs_single_2t/")}, "a CPU-only row"
    for row_id in expected:
        assert rows[row_id]["values"], row_id
        assert rows[row_id]["min"] <= rows[row_id]["median"] <= rows[row_id]["max"], row_id
    table = (tmp_path / "results.md").read_text()
    assert all(f"| {row_id} |" in table for row_id in expected)
