"""``MGPUDDPStrategy(uneven_batches=True)``: every training sample once per epoch, every step equal to one device's."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import yaml
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from models import Regressor, assert_same_parameters, loader, parameters, regression_data, trainer
from processes import clean_env, free_port, run
from torch import nn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    TensorDataset,
)

from lightning_mgpu import ConfigurationError, MGPUDDPStrategy
from lightning_mgpu.cli import main
from lightning_mgpu.resume import ResumableSampler
from lightning_mgpu.strategies.samplers import UnevenShardSampler

SCRIPT = Path(__file__).parent / "scripts" / "uneven_ddp_train.py"
CONFIGS = Path(__file__).parents[1] / "configs"
BATCH, EPOCHS = 2, 2


@dataclass(frozen=True)
class Launch:
    """How the script runs: in which Lightning namespace, on how many ranks and rows, checkpointing when.

    Attributes:
        flags: the script's namespace flag, if any.
        rows: the training rows.
        ranks: the processes.
        checkpoint_every: the steps between checkpoints; the first lands one batch into the second epoch.
        last_step: each rank's (real rows, rows of the step) in the last step of an epoch.
    """

    flags: tuple[str, ...]
    rows: int
    ranks: int
    checkpoint_every: int
    last_step: list[list[int]]


LAUNCHES = {
    # 3 steps per epoch: two full ones of 6 rows, then 2 rows split 1, 1, 0, so rank 2 runs a padding row.
    "lightning.pytorch": Launch((), rows=14, ranks=3, checkpoint_every=4, last_step=[[1, 2], [1, 2], [0, 2]]),
    # 4 steps per epoch: three full ones of 4 rows, then 1 row split 1, 0, so rank 1 runs a padding row; the
    # strategy is a lightning_mgpu.MGPUDDPStrategy instance, which pytorch_lightning's Trainer turns into its own.
    "pytorch_lightning": Launch(
        ("--pytorch-lightning",), rows=13, ranks=2, checkpoint_every=5, last_step=[[1, 1], [0, 1]]
    ),
}


def _dataset(rows: int) -> TensorDataset:
    return TensorDataset(torch.arange(float(rows)))


def _global_order(rows: int, shuffle: bool, seed: int, epoch: int) -> list[int]:
    """The rule the sampler promises, written out independently: DistributedSampler's permutation."""
    if not shuffle:
        return list(range(rows))
    return torch.randperm(rows, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def _shards(rows: int, batch: int, ranks: int, **options: object) -> list[UnevenShardSampler]:
    return [UnevenShardSampler(_dataset(rows), batch, num_replicas=ranks, rank=r, **options) for r in range(ranks)]


def _batches(sampler: UnevenShardSampler) -> list[list[int]]:
    indices = list(sampler)
    return [indices[start : start + sampler.batch_size] for start in range(0, len(indices), sampler.batch_size)]


@pytest.mark.parametrize(("rows", "batch", "ranks"), [(10, 4, 3), (13, 2, 3), (7, 2, 2), (12, 2, 3), (2, 4, 3)])
@pytest.mark.parametrize("shuffle", [False, True])
def test_every_sample_once_in_the_global_steps_of_one_device(rows: int, batch: int, ranks: int, shuffle: bool) -> None:
    for epoch in (0, 1):
        samplers = _shards(rows, batch, ranks, shuffle=shuffle, seed=5)
        for sampler in samplers:
            sampler.set_epoch(epoch)
        per_rank = [_batches(sampler) for sampler in samplers]
        assert len({len(batches) for batches in per_rank}) == 1, "every rank runs the same number of steps"
        assert [len(list(sampler)) for sampler in samplers] == [len(sampler) for sampler in samplers]

        order = _global_order(rows, shuffle, seed=5, epoch=epoch)
        step_size = ranks * batch
        global_steps = [order[start : start + step_size] for start in range(0, rows, step_size)]
        assert len(per_rank[0]) == len(global_steps)
        for step, expected in enumerate(global_steps):
            real = [per_rank[r][step][: samplers[r].rows(step)[0]] for r in range(ranks)]
            assert sum(real, []) == expected, f"step {step}: the ranks' real rows, in rank order, are the global batch"
            assert [sampler.rows(step)[1] for sampler in samplers] == [len(expected)] * ranks
            for r in range(ranks):
                mine, _ = samplers[r].rows(step)
                if mine == 0:
                    assert per_rank[r][step] == [expected[0]], "an empty rank yields one padding row, the step's first"
                else:
                    assert len(per_rank[r][step]) == mine, "only a rank without rows gets a padding row"


def test_the_last_step_is_split_as_evenly_as_possible() -> None:
    assert [s.rows(0) for s in _shards(10, 4, 3)] == [(4, 10), (3, 10), (3, 10)]
    assert [s.rows(2) for s in _shards(13, 2, 3)] == [(1, 1), (0, 1), (0, 1)]
    assert [s.rows(1) for s in _shards(14, 2, 3)] == [(2, 6), (2, 6), (2, 6)]
    assert [s.rows(2) for s in _shards(14, 2, 3)] == [(1, 2), (1, 2), (0, 2)]
    assert [list(s) for s in _shards(10, 4, 3, shuffle=False)] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    with pytest.raises(IndexError, match="outside the epoch's 3 steps"):
        _shards(13, 2, 3)[0].rows(3)


def test_drop_last_drops_the_partial_global_step_only() -> None:
    samplers = _shards(13, 2, 3, shuffle=False, drop_last=True)
    assert [list(s) for s in samplers] == [[0, 1, 6, 7], [2, 3, 8, 9], [4, 5, 10, 11]]
    assert [len(s) for s in samplers] == [4, 4, 4]
    assert samplers[0].num_steps == 2


def test_like_copies_lightnings_sampler_and_differs_from_its_padding() -> None:
    data = _dataset(13)
    padded = [DistributedSampler(data, num_replicas=3, rank=r, shuffle=True, seed=11) for r in range(3)]
    assert sorted(sum((list(s) for s in padded), [])) != list(range(13)), "DistributedSampler repeats samples"
    uneven = [UnevenShardSampler.like(s, batch_size=2) for s in padded]
    assert [(u.num_replicas, u.rank, u.shuffle, u.seed, u.batch_size) for u in uneven] == [
        (3, r, True, 11, 2) for r in range(3)
    ]
    real = [index for u in uneven for step, batch in enumerate(_batches(u)) for index in batch[: u.rows(step)[0]]]
    assert sorted(real) == list(range(13))


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="batch_size >= 1, got 0"):
        UnevenShardSampler(_dataset(4), 0, num_replicas=2, rank=0)
    with pytest.raises(ValueError, match="rank 2, outside the 2 ranks 0..1"):
        UnevenShardSampler(_dataset(4), 1, num_replicas=2, rank=2)


def test_a_resumed_epoch_skips_whole_batches_of_this_rank() -> None:
    """Exact resume skips ``skip_batches * batch_size`` indices: right, because only the last step is partial."""
    for rank in range(3):
        sampler = UnevenShardSampler(_dataset(13), 2, num_replicas=3, rank=rank, seed=3)
        sampler.set_epoch(1)
        whole = _batches(sampler)
        resumable = ResumableSampler(sampler)
        resumable.set_epoch(1)
        resumable.resume(None, skip=2 * sampler.batch_size)
        assert list(resumable) == sum(whole[2:], [])


# ------------------------------------------------------------------------------------------ three gloo processes


def _one_device(launch: Launch) -> tuple[dict[str, torch.Tensor], list[dict[str, float]], list[list[list[int]]]]:
    """The run on one device with batches of ``ranks * BATCH`` rows, written out without Lightning or the package.

    Returns its parameters, what its logger would receive (step values, then each epoch's), and its global batches.
    """
    step_rows = launch.ranks * BATCH
    x, y = (tensor.double() for tensor in regression_data(rows=launch.rows).tensors)
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    logged: list[dict[str, float]] = []
    steps: list[list[list[int]]] = []
    for epoch in range(EPOCHS):
        order = torch.randperm(launch.rows, generator=torch.Generator().manual_seed(epoch))  # Lightning's seed is 0
        steps.append([order[start : start + step_rows].tolist() for start in range(0, launch.rows, step_rows)])
        epoch_errors = []
        for rows in steps[-1]:
            errors = (net(x[rows]) - y[rows]).pow(2).squeeze(1)
            optimizer.zero_grad()
            errors.mean().backward()
            optimizer.step()
            step = {
                "loss_step": errors.detach().mean(),
                "rows_step": len(rows),
                "largest_step": errors.detach().max(),
                "epoch": epoch,
            }
            logged.append({key: float(value) for key, value in step.items()})
            epoch_errors.append(errors.detach())
        errors = torch.cat(epoch_errors)
        mean, largest = float(errors.mean()), float(errors.max())
        logged.append({"loss_epoch": mean, "rows_epoch": launch.rows, "largest_epoch": largest, "error_mean": mean,
                       "epoch": epoch})  # fmt: skip
    return net.state_dict(), logged, steps


def _launch(out: Path, launch: Launch, *args: str) -> list[dict[str, Any]]:
    command = [sys.executable, str(SCRIPT), "--out", str(out), "--rows", str(launch.rows), "--batch", str(BATCH)]
    command += ["--devices", str(launch.ranks), "--epochs", str(EPOCHS), *launch.flags, *args]
    result = run(command, clean_env(MASTER_PORT=str(free_port())), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(launch.ranks)]


def _assert_logged(logged: list[dict[str, float]], expected: list[dict[str, float]]) -> None:
    assert [sorted(entry) for entry in logged] == [sorted(entry) for entry in expected]
    for got, want in zip(logged, expected, strict=True):
        for key, value in want.items():
            assert got[key] == pytest.approx(value, abs=1e-6), f"{key} in {got}"


def _assert_parameters(out: Path, rank: int, expected: dict[str, torch.Tensor]) -> None:
    params = torch.load(out / f"params{rank}.pt")
    assert params.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(params[name], value, atol=1e-6, rtol=0, msg=f"rank {rank}: {name}")


@pytest.fixture(scope="module", params=list(LAUNCHES))
def straight(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Launch, Path, list[dict[str, Any]]]:
    """Two shuffled epochs in each namespace, a checkpoint one batch into the second epoch."""
    launch = LAUNCHES[request.param]
    out = tmp_path_factory.mktemp("straight")
    return launch, out, _launch(out, launch, "--checkpoint-every", str(launch.checkpoint_every))


@pytest.mark.slow
def test_every_step_equals_one_device_on_the_union_of_the_ranks_rows(
    straight: tuple[Launch, Path, list[dict[str, Any]]],
) -> None:
    launch, out, reports = straight
    params, logged, steps = _one_device(launch)
    assert [report["global_step"] for report in reports] == [EPOCHS * len(steps[0])] * launch.ranks, "no skipped step"
    for epoch, global_steps in enumerate(steps):
        key = str(epoch)
        assert {len(report["batches"][key]) for report in reports} == {len(global_steps)}
        for step, expected in enumerate(global_steps):
            planned = [report["rows"][key][step] for report in reports]
            real = [report["batches"][key][step][:mine] for report, (mine, _) in zip(reports, planned, strict=True)]
            assert sum(real, []) == expected, f"epoch {epoch} step {step}: the ranks' rows are one device's batch"
            assert {total for _, total in planned} == {len(expected)}
            for report, (mine, _) in zip(reports, planned, strict=True):
                assert len(report["batches"][key][step]) == max(mine, 1), "one padding row, on an empty rank only"
        seen = sorted(index for rows in global_steps for index in rows)
        assert seen == list(range(launch.rows)), "every sample once per epoch"
    assert [report["rows"]["0"][-1] for report in reports] == launch.last_step
    for rank, report in enumerate(reports):
        _assert_parameters(out, rank, params)
        _assert_logged(report["logged"], logged)  # step and epoch values, synced, on every rank
    assert sum(report["rows_seen"] for report in reports) == EPOCHS * launch.rows, "the padding row left buffers"


@pytest.mark.slow
def test_a_mid_epoch_resume_trains_on_the_rest_of_the_epoch_exactly(
    straight: tuple[Launch, Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    launch, out, reports = straight
    checkpoint = out / "checkpoints" / f"step={launch.checkpoint_every}.ckpt"
    resumed = _launch(tmp_path, launch, "--ckpt-in", str(checkpoint))
    params, logged, steps = _one_device(launch)
    for rank, (report, before) in enumerate(zip(resumed, reports, strict=True)):
        assert list(report["batches"]) == ["1"]
        assert report["batches"]["1"] == before["batches"]["1"][1:], f"rank {rank} continues after batch 0"
        assert report["rows"]["1"] == before["rows"]["1"][1:], "batch_idx continues from the resumed position"
        _assert_parameters(tmp_path, rank, params)
        # the second epoch's steps after its first, then the whole second epoch's values
        _assert_logged(report["logged"], logged[-len(steps[1]) :])


@pytest.mark.slow
def test_without_the_option_training_repeats_samples_and_differs_from_one_device(tmp_path: Path) -> None:
    launch = LAUNCHES["lightning.pytorch"]
    reports = _launch(tmp_path, launch, "--no-uneven")
    seen = sorted(index for report in reports for batch in report["batches"]["0"] for index in batch)
    assert len(seen) == launch.rows + 1, "Lightning's DistributedSampler pads 14 rows to 15 on 3 ranks"
    params, _, _ = _one_device(launch)
    differences = [
        float((torch.load(tmp_path / "params0.pt")[name] - value).abs().max()) for name, value in params.items()
    ]
    assert max(differences) > 1e-3


# ------------------------------------------------------------------------------------- refusals, in one process


class _Manual(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


class _Iterating(Regressor):
    def training_step(self, dataloader_iter: Any) -> torch.Tensor:  # type: ignore[override]
        batch = next(dataloader_iter)
        return super().training_step(batch, 0)


class _FromHook(Regressor):
    """Builds its training data in ``train_dataloader``, where Lightning records how each DataLoader was built."""

    build: Callable[[], object]

    def train_dataloader(self) -> Any:
        return self.build()


def _from_hook(build: Callable[[], object]) -> _FromHook:
    model = _FromHook()
    model.build = build
    return model


class _AccumulateFromEpochStart(L.Callback):
    """Switches accumulation on by itself, after the strategy has set up."""

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.accumulate_grad_batches = 2


class _Stream(IterableDataset):
    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        yield from regression_data(rows=10)


class _Batches:
    """Batches from an iterable that is not a DataLoader."""

    def __iter__(self) -> Iterator[list[torch.Tensor]]:
        yield from loader(regression_data(rows=10), 2)


class _EveryOther(Sampler[int]):
    def __init__(self, rows: int) -> None:
        self.rows = rows

    def __iter__(self) -> Iterator[int]:
        yield from range(0, self.rows, 2)

    def __len__(self) -> int:
        return (self.rows + 1) // 2


def _batch_sampled() -> DataLoader:
    data = regression_data(rows=10)
    return DataLoader(data, batch_sampler=BatchSampler(SequentialSampler(data), 2, drop_last=False))


def _sampled(sampler: Callable[[TensorDataset], Sampler[int]]) -> Callable[[], DataLoader]:
    def build() -> DataLoader:
        data = regression_data(rows=10)
        return DataLoader(data, batch_size=2, sampler=sampler(data))

    return build


def _assert_refused_before_the_first_step(
    model: Regressor, data: object, tmp_path: Path, setting: str, match: str | None, **overrides: Any
) -> None:
    """``match``, for the one case that checks a message's wording, also checks it offers turning uneven_batches off."""
    before = parameters(model)
    run_ = trainer(tmp_path, strategy=MGPUDDPStrategy(uneven_batches=True), max_epochs=2, **overrides)
    with pytest.raises(ConfigurationError, match=match) as refused:
        run_.fit(model, data)
    assert refused.value.setting == setting
    if match is not None:
        assert "or leave uneven_batches off" in str(refused.value)
    assert run_.global_step == 0
    assert_same_parameters(parameters(model), before)


@pytest.mark.parametrize(
    ("case", "setting", "match"),
    [
        (
            "accumulate", "Trainer.accumulate_grad_batches",
            r"accumulate_grad_batches=2\): the last, smaller step .* Use accumulate_grad_batches=1",
        ),
        (
            "accumulation schedule", "Trainer.callbacks",
            r"GradientAccumulationScheduler\(\{0: 1, 1: 2\}\), which accumulates 2 batches per step from epoch 1:"
            r" the last, smaller step .* Remove the callback",
        ),
        (
            "accumulation set by a callback", "Trainer.accumulate_grad_batches",
            r"accumulate_grad_batches became 2 at epoch 0 \(a callback set it\)",
        ),
        (
            "manual", "LightningModule.automatic_optimization",
            r"_Manual sets automatic_optimization = False.* Use automatic optimization",
        ),
        (
            "dataloader_iter", "LightningModule.training_step",
            r"_Iterating.training_step takes dataloader_iter.* Take \(batch, batch_idx\)",
        ),
        (
            "SyncBatchNorm layer", "MGPUDDPStrategy.uneven_batches",
            r"cannot train torch's SyncBatchNorm layers \(net.1\).* pass Trainer\(sync_batchnorm=True\) on CPU",
        ),
    ],
)  # fmt: skip
def test_training_that_cannot_be_exact_is_refused_before_the_first_step(
    tmp_path: Path, case: str, setting: str, match: str | None
) -> None:
    model: Regressor = {"manual": _Manual, "dataloader_iter": _Iterating}.get(case, Regressor)()
    if case == "SyncBatchNorm layer":
        model.net[1] = nn.SyncBatchNorm(8)
    overrides = {
        "accumulate": {"accumulate_grad_batches": 2},
        "accumulation schedule": {"callbacks": [GradientAccumulationScheduler({0: 1, 1: 2})]},
        "accumulation set by a callback": {"callbacks": [_AccumulateFromEpochStart()]},
    }.get(case, {})
    data = loader(regression_data(rows=10), 4)
    _assert_refused_before_the_first_step(model, data, tmp_path, setting, match, **overrides)


@pytest.mark.parametrize(
    ("build", "given", "setting", "match"),
    [
        pytest.param(
            _batch_sampled, "fit", "DataLoader.batch_size",
            r"draws its batches from batch_sampler=BatchSampler, .* Give the DataLoader batch_size=\.\.\. and"
            r" shuffle=\.\.\. instead", id="batch_sampler",
        ),
        pytest.param(
            _batch_sampled, "train_dataloader", "DataLoader.batch_size", None,
            id="batch_sampler from the hook",  # Lightning would train it with batch_size=1
        ),
        pytest.param(
            lambda: DataLoader(regression_data(rows=10), batch_size=None), "fit", "DataLoader.batch_size",
            r"has batch_size=None, so every sample is a step of its own", id="batch_size=None",
        ),
        pytest.param(
            _sampled(lambda data: SequentialSampler(range(10))), "train_dataloader", "DataLoader.sampler",
            r"sampler=SequentialSampler over another data source than the DataLoader's dataset, whose order the"
            r" plan cannot follow .* Give the DataLoader shuffle=True or shuffle=False instead of a sampler",
            id="SequentialSampler of another source",
        ),
        pytest.param(
            _sampled(lambda data: RandomSampler(data, replacement=True)), "fit", "DataLoader.sampler",
            r"sampler=RandomSampler with its own replacement=True, whose order", id="RandomSampler with replacement",
        ),
        pytest.param(
            _sampled(lambda data: RandomSampler(data, generator=torch.Generator().manual_seed(3))),
            "train_dataloader", "DataLoader.sampler", None, id="RandomSampler with a generator",
        ),
        pytest.param(
            _sampled(lambda data: DistributedSampler(data, num_replicas=1, rank=0)), "fit", "DataLoader.sampler",
            None, id="DistributedSampler of one's own",
        ),
        pytest.param(
            _sampled(lambda data: _EveryOther(10)), "train_dataloader", "DataLoader.sampler", None,
            id="sampler of one's own",
        ),
        pytest.param(
            lambda: DataLoader(_Stream(), batch_size=2), "fit", "DataLoader.dataset",
            r"_Stream is an IterableDataset, .* Use a map-style Dataset", id="IterableDataset",
        ),
        pytest.param(
            _Batches, "fit", "Trainer.fit.train_dataloaders",
            r"the training data is a _Batches. Give DataLoader\(dataset, batch_size=", id="not a DataLoader",
        ),
        pytest.param(
            lambda: [loader(regression_data(rows=10), 2), loader(regression_data(rows=6), 2)], "train_dataloader",
            "Trainer.fit.train_dataloaders",
            r"plans every step from one training DataLoader, but the training data holds 2 \(DataLoader,"
            r" DataLoader\).* ConcatDataset", id="two DataLoaders",
        ),
        pytest.param(
            lambda: loader(regression_data(rows=10), 2), "use_distributed_sampler=False",
            "Trainer.use_distributed_sampler",
            r"Lightning put none there \(the sampler is SequentialSampler\): Trainer\(use_distributed_sampler=False\)"
            r" keeps it out. Keep use_distributed_sampler=True", id="use_distributed_sampler=False",
        ),
    ],
)  # fmt: skip
def test_training_data_that_cannot_be_exact_is_refused_before_the_first_step(
    tmp_path: Path, build: Callable[[], object], given: str, setting: str, match: str | None
) -> None:
    if given == "train_dataloader":
        _assert_refused_before_the_first_step(_from_hook(build), None, tmp_path, setting, match)
    else:
        overrides = {"use_distributed_sampler": False} if given == "use_distributed_sampler=False" else {}
        _assert_refused_before_the_first_step(Regressor(), build(), tmp_path, setting, match, **overrides)


def test_post_local_sgd_is_refused_when_the_strategy_is_built() -> None:
    with pytest.raises(ConfigurationError, match="cannot be combined with model_averaging_period.* Remove") as caught:
        MGPUDDPStrategy(uneven_batches=True, model_averaging_period=4)
    assert caught.value.setting == "MGPUDDPStrategy.model_averaging_period"


@pytest.mark.parametrize(
    "built",
    ["shuffle=True", "shuffle=False", "sampler=SequentialSampler", "in train_dataloader", "accumulation schedule of 1"],
)
def test_one_process_trains_as_one_device_in_the_order_the_dataloader_was_built_for(tmp_path: Path, built: str) -> None:
    """``shuffle=True`` shuffles as Lightning's DistributedSampler does (seed 0 + epoch); ``shuffle=False``, or the
    ``SequentialSampler`` it builds, keeps the dataset's order, as one device would (Lightning's own sampler would
    shuffle it)."""
    data = regression_data(rows=10)
    shuffle = built != "shuffle=False" and built != "sampler=SequentialSampler"
    sampler = SequentialSampler(data) if built == "sampler=SequentialSampler" else None
    made = DataLoader(data, batch_size=4, shuffle=shuffle if sampler is None else None, sampler=sampler)
    ddp = _from_hook(lambda: made) if built == "in train_dataloader" else Regressor()
    callbacks = [GradientAccumulationScheduler({0: 1, 1: 1})] if built == "accumulation schedule of 1" else []
    run_ = trainer(tmp_path, strategy=MGPUDDPStrategy(uneven_batches=True), max_epochs=2, callbacks=callbacks)
    run_.fit(ddp, None if built == "in train_dataloader" else made)
    assert run_.global_step == 6
    single = Regressor()
    orders = [_global_order(10, shuffle, seed=0, epoch=epoch) for epoch in range(2)]
    rows = torch.tensor(orders).reshape(-1)  # two epochs of batches 4, 4, 2 in that order
    in_order = TensorDataset(data.tensors[0][rows], data.tensors[1][rows])
    batches = [list(range(start, min(start + 4, end))) for end in (10, 20) for start in range(end - 10, end, 4)]
    trainer(tmp_path, max_epochs=1).fit(single, DataLoader(in_order, batch_sampler=batches))
    assert_same_parameters(parameters(ddp), parameters(single))


@pytest.mark.filterwarnings("ignore:You are trying to `self.log")
def test_the_batchnorm_warning_advises_what_uneven_batches_accepts(monkeypatch: pytest.MonkeyPatch) -> None:
    model = Regressor()
    model.net[1] = nn.BatchNorm1d(8)
    environment = LightningEnvironment()
    environment.set_world_size(2)
    strategy = MGPUDDPStrategy(uneven_batches=True, cluster_environment=environment)
    strategy.connect(model)
    with pytest.warns(UserWarning, match=r"BatchNorm layers \(net.1\) normalise each rank's batch") as warned:
        strategy.training_step(next(iter(loader(regression_data(rows=4), 4))), 0)
    advice = next(str(warning.message) for warning in warned if "BatchNorm" in str(warning.message))
    assert "Pass Trainer(sync_batchnorm=True)" in advice, "on CPU processes it syncs exactly with uneven_batches"
    on_gpus = property(lambda _: [torch.device("cuda", 0)])  # what Lightning sets on a machine with GPUs
    monkeypatch.setattr(MGPUDDPStrategy, "parallel_devices", on_gpus)
    assert "With uneven_batches=True on GPUs, use GroupNorm or LayerNorm" in strategy._batchnorm_fix()


def test_the_option_is_set_from_yaml_init_args(capsys: pytest.CaptureFixture[str]) -> None:
    config = ["--trainer.strategy.class_path", "lightning_mgpu.MGPUDDPStrategy"]
    config += ["--trainer.strategy.init_args.uneven_batches", "true", "--print_config"]
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(CONFIGS / "ddp_cpu.yaml"), *config])
    strategy = yaml.safe_load(capsys.readouterr().out)["trainer"]["strategy"]
    assert strategy["class_path"] == "lightning_mgpu.MGPUDDPStrategy"
    assert strategy["init_args"]["uneven_batches"] is True
