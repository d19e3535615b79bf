"""``Trainer(sync_batchnorm=True)`` under ``mgpu_ddp`` on CPU processes: BatchNorm over every rank's rows, exactly.

The layer tests run the ranks as threads of this process, each with a gloo process group of its own over one store,
so they need no launch; the training tests start real processes (``scripts/sync_batchnorm_ddp.py``).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.plugins import TorchSyncBatchNorm
from models import BatchNormNet, image_data, trainer
from processes import clean_env, free_port, run
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import ConfigurationError
from lightning_mgpu.strategies.uneven_checks import check_synced_batchnorm
from lightning_mgpu.sync_batchnorm import (
    MGPUSyncBatchNorm,
    SyncBatchNormLayers,
    buffers_a_padding_row_changes,
    rows_not_counted,
)

SCRIPT = Path(__file__).parent / "scripts" / "sync_batchnorm_ddp.py"
CPU = torch.device("cpu")


def _on_ranks(ranks: int, work: Callable[[int], Any]) -> list[Any]:
    """``work(rank)`` in one thread per rank, together; what each returned, or the first error any raised."""
    results: list[Any] = [None] * ranks
    errors: list[BaseException] = []

    def target(rank: int) -> None:
        try:
            results[rank] = work(rank)
        except BaseException as error:  # noqa: BLE001 - handed to the test
            errors.append(error)

    threads = [threading.Thread(target=target, args=(rank,)) for rank in range(ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads), "a rank is still waiting in a collective"
    if errors:
        raise errors[0]
    return results


def _groups(ranks: int) -> list[Any]:
    store = dist.HashStore()
    return _on_ranks(ranks, lambda rank: dist.ProcessGroupGloo(store, rank, ranks, timedelta(seconds=30)))


def _synced(layer: nn.Module, group: Any) -> MGPUSyncBatchNorm:
    converted = SyncBatchNormLayers(TorchSyncBatchNorm(), CPU).apply(layer)
    assert isinstance(converted, MGPUSyncBatchNorm)
    converted.process_group = group
    return converted


LAYERS: dict[str, tuple[Callable[[], nn.Module], Sequence[int], Sequence[int]]] = {
    # name: (layer, shape of one row, rows per rank; 0 is a padding row, which must not count)
    "1d": (lambda: nn.BatchNorm1d(3), (3,), (4, 3)),
    "1d-sequence-padding": (lambda: nn.BatchNorm1d(3), (3, 5), (3, 0)),
    "2d-cumulative": (lambda: nn.BatchNorm2d(3, momentum=None), (3, 4, 5), (2, 1, 3)),
    "3d-no-affine-padding": (lambda: nn.BatchNorm3d(2, affine=False), (2, 3, 2, 2), (2, 2, 0)),
    "no-running-statistics": (lambda: nn.BatchNorm2d(3, track_running_stats=False), (3, 2, 2), (1, 2)),
    "one-row-each-and-padding": (lambda: nn.BatchNorm1d(3), (3,), (1, 1, 0)),
}


def _train_together(
    make: Callable[[], nn.Module], row: Sequence[int], counts: Sequence[int], steps: int = 3
) -> tuple[nn.Module, list[MGPUSyncBatchNorm]]:
    """Train ``make()`` on one device and synced over ``len(counts)`` ranks, asserting each step equal to 1e-6.

    Each step, rank r gets ``counts[r]`` rows of the whole batch (0: a padding row, which must not count) and its
    share of the whole batch's output gradient (a padding row's is 0, as its loss is scaled by 0).
    """
    ranks = len(counts)
    groups = _groups(ranks)
    torch.manual_seed(0)
    reference = make().double()
    layers = [_synced(make().double(), group) for group in groups]
    for layer in layers:
        layer.load_state_dict(reference.state_dict())
    for step in range(steps):
        inputs = [torch.randn(count or 1, *row, dtype=torch.float64) for count in counts]
        whole = torch.cat([x for x, count in zip(inputs, counts, strict=True) if count]).requires_grad_()
        output = reference(whole)
        upstream = torch.randn_like(output)
        (output * upstream).sum().backward()
        shares = list(torch.split(upstream, [count for count in counts if count]))
        grads = [shares.pop(0) if count else torch.zeros_like(x) for x, count in zip(inputs, counts, strict=True)]

        def forward(rank: int, inputs: list[torch.Tensor] = inputs) -> tuple[torch.Tensor, torch.Tensor]:
            x = inputs[rank].clone().requires_grad_()
            with rows_not_counted(counts[rank] == 0):
                return x, layers[rank](x)

        ran = _on_ranks(ranks, forward)
        _on_ranks(ranks, lambda rank, ran=ran, grads=grads: (ran[rank][1] * grads[rank]).sum().backward())
        real = [rank for rank in range(ranks) if counts[rank]]
        where = f"step {step}"
        _close(torch.cat([ran[rank][1] for rank in real]), output, f"{where}: outputs")
        _close(torch.cat([ran[rank][0].grad for rank in real]), whole.grad, f"{where}: input gradients")
        for rank in set(range(ranks)) - set(real):
            _close(ran[rank][0].grad, torch.zeros_like(ran[rank][0]), f"{where}: the padding row's input gradient")
        if reference.weight is not None:
            _close(sum(layer.weight.grad for layer in layers), reference.weight.grad, f"{where}: weight gradient")
            _close(sum(layer.bias.grad for layer in layers), reference.bias.grad, f"{where}: bias gradient")
        for rank, layer in enumerate(layers):
            state, expected = layer.state_dict(), reference.state_dict()
            assert list(state) == list(expected), "the same state dict keys as the layer it replaced"
            for key, value in expected.items():
                _close(state[key], value, f"{where}, rank {rank}: {key}")
    return reference, layers


def _close(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0, msg=lambda message: f"{what}: {message}")


@pytest.mark.parametrize("name", list(LAYERS))
def test_the_ranks_train_as_one_device_on_their_rows(name: str) -> None:
    make, row, counts = LAYERS[name]
    reference, layers = _train_together(make, row, counts)
    reference.eval()
    x = torch.randn(4, *row, dtype=torch.float64)
    for layer in layers:  # in evaluation, the running statistics (or the batch's own), with no collective
        _close(layer.eval()(x), reference(x), "evaluation output")


def test_a_layer_on_an_input_without_gradient_trains_its_weights_without_the_backwards_all_reduce() -> None:
    groups = _groups(2)
    torch.manual_seed(0)
    reference = nn.BatchNorm1d(3).double()
    layers = [_synced(nn.BatchNorm1d(3).double(), group) for group in groups]
    inputs = [torch.randn(4, 3, dtype=torch.float64), torch.randn(2, 3, dtype=torch.float64)]
    upstream = torch.randn(6, 3, dtype=torch.float64)
    (reference(torch.cat(inputs)) * upstream).sum().backward()
    shares = torch.split(upstream, [4, 2])
    outputs = _on_ranks(2, lambda rank: layers[rank](inputs[rank]))
    for rank in range(2):  # one rank after the other: a backward that waited for the other rank would time out
        (outputs[rank] * shares[rank]).sum().backward()
    _close(layers[0].weight.grad + layers[1].weight.grad, reference.weight.grad, "weight gradient")
    _close(layers[0].bias.grad + layers[1].bias.grad, reference.bias.grad, "bias gradient")


def test_one_value_per_channel_over_every_rank_is_refused_on_every_rank() -> None:
    groups = _groups(2)
    layers = [_synced(nn.BatchNorm1d(3), group) for group in groups]
    inputs = [torch.randn(1, 3), torch.randn(1, 3)]

    def forward(rank: int) -> str:
        with (
            rows_not_counted(rank == 1),
            pytest.raises(ValueError, match="Expected more than 1 value per channel") as caught,
        ):
            layers[rank](inputs[rank])
        return str(caught.value)

    assert all("got 1 over every rank" in message for message in _on_ranks(2, forward))


class _Scaled(nn.BatchNorm2d):
    """A BatchNorm subclass of the model's own, which the conversion back must give back."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


def test_cpu_processes_convert_into_the_synced_layer_and_back_to_the_models_own() -> None:
    model = nn.Sequential(nn.Conv2d(2, 3, 1), _Scaled(3), nn.Sequential(nn.BatchNorm1d(4, momentum=None)))
    originals = [model[1], model[2][0]]
    keys = list(model.state_dict())
    converter = SyncBatchNormLayers(TorchSyncBatchNorm(), CPU)
    converted = converter.apply(model)
    layers = [converted[1], converted[2][0]]
    assert all(type(layer) is MGPUSyncBatchNorm for layer in layers)
    assert list(converted.state_dict()) == keys, "a checkpoint written while training loads into the model"
    assert layers[0].weight is originals[0].weight, "the optimizer steps the model's own parameters"
    assert layers[1].momentum is None
    trained = {name: torch.full_like(tensor, 7.0) for name, tensor in converted.state_dict().items()}
    converted.load_state_dict(trained)
    layers[0].running_mean = torch.arange(3.0)  # a buffer replaced while training, as .to(dtype) replaces them
    reverted = converter.revert(converted)
    assert [reverted[1], reverted[2][0]] == originals, "the model's own layers, its subclass kept"
    assert torch.equal(reverted[1].running_mean, torch.arange(3.0))
    assert torch.equal(reverted[2][0].num_batches_tracked, torch.tensor(7))
    assert torch.equal(reverted[1].weight, torch.full((3,), 7.0))


def test_gpus_keep_lightnings_conversion_into_torchs_sync_batchnorm() -> None:
    converter = SyncBatchNormLayers(TorchSyncBatchNorm(), torch.device("cuda", 0))
    converted = converter.apply(nn.Sequential(nn.BatchNorm1d(3)))
    assert type(converted[0]) is nn.SyncBatchNorm
    assert type(converter.revert(converted)[0]).__name__ == "_BatchNormXd", "Lightning's own conversion back"


def test_a_padding_row_leaves_every_buffer_as_it_was_but_the_synced_statistics() -> None:
    model = SyncBatchNormLayers(TorchSyncBatchNorm(), CPU).apply(nn.Sequential(nn.BatchNorm1d(3), nn.BatchNorm1d(3)))
    model.register_buffer("counter", torch.zeros(()))
    model[1] = nn.BatchNorm1d(3)
    kept = {id(buffer) for buffer in buffers_a_padding_row_changes(model)}
    assert kept == {id(model.counter), *(id(buffer) for buffer in model[1].buffers())}


@pytest.mark.parametrize("synced_by", ["Trainer(sync_batchnorm=True)", "SyncBatchNorm layer"])
def test_uneven_batches_refuse_torchs_sync_batchnorm_which_counts_the_padding_row(synced_by: str) -> None:
    flag = synced_by == "Trainer(sync_batchnorm=True)"
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3) if flag else nn.SyncBatchNorm(3))
    if flag:
        check_synced_batchnorm(model, flag, CPU)  # on CPU processes the strategy's layer: exact, accepted
    device = torch.device("cuda", 0) if flag else CPU
    with pytest.raises(ConfigurationError, match=r"cannot train torch's SyncBatchNorm.*\(1\).*padding row") as caught:
        check_synced_batchnorm(model, flag, device)
    assert caught.value.setting == ("Trainer.sync_batchnorm" if flag else "MGPUDDPStrategy.uneven_batches")


BATCH, EPOCHS = 2, 2
LAUNCHES = {
    # ranks: (rows the ranks divide, rows whose last step leaves the last rank a padding row)
    2: (12, 13),  # uneven: 3 steps of 4 rows, then 1 row split 1, 0
    3: (12, 14),  # uneven: 2 steps of 6 rows, then 2 rows split 1, 1, 0
}


def _one_device(rows: int, ranks: int, shuffled: bool) -> dict[str, torch.Tensor]:
    """``BatchNormNet`` on one device, each step on the union of the ranks' rows, in the order they ran them.

    Lightning's ``DistributedSampler`` (``shuffled``) deals each epoch's permutation of ``seed + epoch`` out to the
    ranks in turn, so the ranks' batches of a step are that permutation's next ``BATCH * ranks`` rows; the uneven
    plan keeps the dataset's order (the DataLoader's ``shuffle=False``).
    """
    data = image_data(rows)
    orders = [
        torch.randperm(rows, generator=torch.Generator().manual_seed(epoch)) if shuffled else torch.arange(rows)
        for epoch in range(EPOCHS)
    ]
    step = BATCH * ranks
    batches = [(order[start : start + step]).tolist() for order in orders for start in range(0, rows, step)]
    in_order = TensorDataset(*(tensor[torch.tensor(sum(batches, []))] for tensor in data.tensors))
    sizes = [len(batch) for batch in batches]
    starts = [sum(sizes[:index]) for index in range(len(sizes))]
    model = BatchNormNet()
    sampler = [list(range(start, start + size)) for start, size in zip(starts, sizes, strict=True)]
    trainer(max_epochs=1).fit(model, DataLoader(in_order, batch_sampler=sampler))
    return model.state_dict()


@pytest.mark.slow
@pytest.mark.parametrize("ranks", list(LAUNCHES))
def test_mgpu_ddp_with_sync_batchnorm_trains_as_one_device_on_cpu_processes(tmp_path: Path, ranks: int) -> None:
    even, uneven = LAUNCHES[ranks]
    command = [sys.executable, str(SCRIPT), "--out", str(tmp_path), "--devices", str(ranks), "--batch", str(BATCH)]
    command += ["--epochs", str(EPOCHS), f"even:{even}", f"uneven:{uneven}"]
    result = run(command, clean_env(MASTER_PORT=str(free_port())), timeout=150)
    assert result.returncode == 0, result.stderr[-3000:]
    for kind, rows in (("even", even), ("uneven", uneven)):
        expected = _one_device(rows, ranks, shuffled=kind == "even")
        for rank in range(ranks):
            ran = torch.load(tmp_path / f"{kind}.rank{rank}.pt")
            assert ran["layer_types"] == ["MGPUSyncBatchNorm"] * 2, "BatchNorm trained synced over the ranks"
            assert ran["steps"] == EPOCHS * -(-rows // (BATCH * ranks))
            assert list(ran["state"]) == list(expected)
            for name, value in expected.items():  # parameters after every step, and the running statistics
                _close(ran["state"][name], value, f"{kind}, rank {rank}: {name}")
