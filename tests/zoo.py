"""A zoo of tiny LightningModules, one per stock torch module or training pattern, and the harness that trains them.

Each entry trains the same way under any strategy: seeded initial weights, deterministic data, a few steps, no
dropout. ``tests/test_zoo.py`` trains each under ``mgpu_dp`` and ``mgpu_ddp`` (through ``tests/scripts/zoo_ddp.py``)
and compares every parameter, buffer and logged value with one device.
"""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import lightning as L
import torch
from models import trainer
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_mgpu
from lightning_mgpu import MGPUMixin

DP_BATCH = 5
"""Rows per step under mgpu_dp: uneven chunks, 3 + 2 on two replicas and 2 + 2 + 1 on three."""

DDP_BATCH = 3
"""Rows per step and rank under mgpu_ddp; one device replays the same global batches of 2 * 3 rows."""

DDP_WORLD_SIZE = 2

STEPS = 3

# Inputs ------------------------------------------------------------------------------------------------------------

FEATURES = 4
OUTPUTS = 2
SEQUENCE_FEATURES = 3
TIME_STEPS = 5
VOCABULARY = 10
TOKENS = 6


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def vectors(rows: int) -> TensorDataset:
    generator = _generator()
    x = torch.randn(rows, FEATURES, generator=generator)
    y = torch.tanh(x @ torch.randn(FEATURES, OUTPUTS, generator=generator))
    return TensorDataset(x, y + 0.1 * torch.randn(rows, OUTPUTS, generator=generator))


def sequences(rows: int) -> TensorDataset:
    """Zero-padded sequences, their lengths (1 to ``TIME_STEPS``, one per row) and a target per sequence."""
    generator = _generator()
    x = torch.randn(rows, TIME_STEPS, SEQUENCE_FEATURES, generator=generator)
    lengths = torch.randint(1, TIME_STEPS + 1, (rows,), generator=generator)
    lengths[0] = TIME_STEPS
    x = x * (torch.arange(TIME_STEPS) < lengths[:, None]).unsqueeze(-1)
    return TensorDataset(x, lengths, torch.randn(rows, OUTPUTS, generator=generator))


def tokens(rows: int) -> TensorDataset:
    generator = _generator()
    ids = torch.randint(0, VOCABULARY, (rows, TOKENS), generator=generator)
    return TensorDataset(ids, torch.randn(rows, OUTPUTS, generator=generator))


def classes(rows: int) -> TensorDataset:
    """Token sequences and a class (a token) to predict from each."""
    generator = _generator()
    ids = torch.randint(0, VOCABULARY, (rows, TOKENS), generator=generator)
    return TensorDataset(ids, torch.randint(0, VOCABULARY, (rows,), generator=generator))


def images(rows: int) -> TensorDataset:
    generator = _generator()
    return TensorDataset(
        torch.randn(rows, 2, 6, 6, generator=generator), torch.randn(rows, OUTPUTS, generator=generator)
    )


def signals(rows: int) -> TensorDataset:
    generator = _generator()
    return TensorDataset(torch.randn(rows, 2, 12, generator=generator), torch.randn(rows, OUTPUTS, generator=generator))


def padding_mask(lengths: torch.Tensor, steps: int) -> torch.Tensor:
    """True where a position lies beyond its row's length."""
    return torch.arange(steps, device=lengths.device) >= lengths[:, None]


def causal_mask(steps: int, device: torch.device) -> torch.Tensor:
    """True where a position may not attend: every later position."""
    return torch.triu(torch.ones(steps, steps, dtype=torch.bool, device=device), diagonal=1)


# Models ------------------------------------------------------------------------------------------------------------


class ZooModule(L.LightningModule):
    """Seeds its initial weights, logs its loss, trains with SGD and momentum; subclasses define ``objective``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)

    def objective(self, batch: Any) -> torch.Tensor:
        raise NotImplementedError

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = self.objective(batch)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class MLP(ZooModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, OUTPUTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def objective(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)


class Recurrent(ZooModule):
    """An ``nn.RNN``/``nn.GRU``/``nn.LSTM`` read out from its last hidden state, optionally on packed sequences."""

    def __init__(self, cell: type[nn.RNNBase], packed: bool = False, **options: Any) -> None:
        super().__init__()
        self.rnn = cell(SEQUENCE_FEATURES, 4, batch_first=True, **options)
        self.packed = packed
        self.directions = 2 if options.get("bidirectional") else 1
        self.head = nn.Linear(4 * self.directions, OUTPUTS)

    def objective(self, batch: Any) -> torch.Tensor:
        x, lengths, y = batch
        if self.packed:
            x = nn.utils.rnn.pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
        _, hidden = self.rnn(x)
        if isinstance(hidden, tuple):  # the LSTM's (h, c)
            hidden = hidden[0]
        last = hidden[-self.directions :].transpose(0, 1).reshape(hidden.shape[1], -1)
        return F.mse_loss(self.head(last), y)


class CausalSelfAttention(ZooModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(SEQUENCE_FEATURES, 8)
        self.attention = nn.MultiheadAttention(8, num_heads=2, dropout=0.0, batch_first=True)
        self.head = nn.Linear(8, OUTPUTS)

    def objective(self, batch: Any) -> torch.Tensor:
        x, _, y = batch
        h = self.embed(x)
        attended, _ = self.attention(h, h, h, attn_mask=causal_mask(x.shape[1], x.device), need_weights=False)
        return F.mse_loss(self.head(attended[:, -1]), y)


class PaddedEncoder(ZooModule):
    """A ``TransformerEncoder`` that ignores padding through ``src_key_padding_mask``, then a masked mean."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(SEQUENCE_FEATURES, 8)
        layer = nn.TransformerEncoderLayer(8, nhead=2, dim_feedforward=8, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(8, OUTPUTS)

    def objective(self, batch: Any) -> torch.Tensor:
        x, lengths, y = batch
        padding = padding_mask(lengths, x.shape[1])
        encoded = self.encoder(self.embed(x), src_key_padding_mask=padding)
        pooled = encoded.masked_fill(padding.unsqueeze(-1), 0.0).sum(1) / lengths.unsqueeze(-1)
        return F.mse_loss(self.head(pooled), y)


class Seq2Seq(ZooModule):
    """A tiny ``nn.Transformer``: padded source, causal target made of the source's first steps."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(SEQUENCE_FEATURES, 8)
        self.transformer = nn.Transformer(
            d_model=8, nhead=2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=8, dropout=0.0,
            batch_first=True,
        )  # fmt: skip
        self.head = nn.Linear(8, OUTPUTS)

    def objective(self, batch: Any) -> torch.Tensor:
        x, lengths, y = batch
        source = self.embed(x)
        target = source[:, :3]
        padding = padding_mask(lengths, x.shape[1])
        decoded = self.transformer(
            source, target, tgt_mask=causal_mask(3, x.device), src_key_padding_mask=padding,
            memory_key_padding_mask=padding,
        )  # fmt: skip
        return F.mse_loss(self.head(decoded[:, -1]), y)


class TokenRegressor(ZooModule):
    """Mean of token embeddings (``padding_idx=0``), dense or sparse gradients."""

    def __init__(self, sparse: bool = False) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCABULARY, 4, padding_idx=0, sparse=sparse)
        self.head = nn.Linear(4, OUTPUTS)

    def objective(self, batch: Any) -> torch.Tensor:
        ids, y = batch
        return F.mse_loss(self.head(self.embedding(ids).mean(1)), y)

    def configure_optimizers(self) -> Any:
        if self.embedding.sparse:
            return torch.optim.SGD(self.parameters(), lr=0.5)  # plain SGD steps on sparse gradients
        return super().configure_optimizers()


class BagRegressor(ZooModule):
    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(VOCABULARY, 4, mode="mean")
        self.head = nn.Linear(4, OUTPUTS)

    def objective(self, batch: Any) -> torch.Tensor:
        ids, y = batch
        return F.mse_loss(self.head(self.bag(ids)), y)


class TiedLanguageModel(ZooModule):
    """The output projection shares the embedding's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCABULARY, 4)
        self.mix = nn.Linear(4, 4)
        self.output = nn.Linear(4, VOCABULARY, bias=False)
        self.output.weight = self.embedding.weight

    def objective(self, batch: Any) -> torch.Tensor:
        ids, target = batch
        return F.cross_entropy(self.output(torch.tanh(self.mix(self.embedding(ids).mean(1)))), target)


def _quietly(function: Callable[[nn.Module], nn.Module]) -> Callable[[nn.Module], nn.Module]:
    """The old-style ``torch.nn.utils.weight_norm``/``spectral_norm`` warn that they are deprecated."""

    @functools.wraps(function)
    def apply(module: nn.Module) -> nn.Module:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return function(module)

    return apply


class Parametrized(ZooModule):
    """A square hidden layer whose weight is reparametrized (``weight_norm``, ``orthogonal``, ``spectral_norm``)."""

    def __init__(self, parametrize: Callable[[nn.Module], nn.Module]) -> None:
        super().__init__()
        self.embed = nn.Linear(FEATURES, 4)
        self.hidden = parametrize(nn.Linear(4, 4))
        self.head = nn.Linear(4, OUTPUTS)

    def objective(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.head(torch.tanh(self.hidden(torch.tanh(self.embed(x))))), y)


class Checkpointed(ZooModule):
    """The middle block recomputed in backward by ``torch.utils.checkpoint``."""

    def __init__(self, use_reentrant: bool) -> None:
        super().__init__()
        self.embed = nn.Linear(FEATURES, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(8, OUTPUTS)
        self.use_reentrant = use_reentrant

    def objective(self, batch: Any) -> torch.Tensor:
        x, y = batch
        hidden = checkpoint(self.block, torch.tanh(self.embed(x)), use_reentrant=self.use_reentrant)
        return F.mse_loss(self.head(hidden), y)


class Encoder(nn.Module):
    """Defined here, not a stock ``nn.Sequential``: dynamo skips frames that are all inside torch."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(FEATURES, 8)
        self.second = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.second(torch.tanh(self.first(x))))


class Compiled(ZooModule):
    """An encoder compiled either as ``torch.compile(module)`` or in place with ``module.compile()``."""

    def __init__(self, in_place: bool, backend: str = "eager") -> None:
        super().__init__()
        encoder = Encoder()
        if in_place:
            encoder.compile(backend=backend)
            self.encoder = encoder
        else:
            self.encoder = torch.compile(encoder, backend=backend)
        self.head = nn.Linear(8, OUTPUTS)

    def objective(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.head(self.encoder(x)), y)


class Normalized(ZooModule):
    """A hidden layer followed by a normalization layer (``LayerNorm``, ``GroupNorm``, ``BatchNorm1d``)."""

    def __init__(self, norm: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.embed = nn.Linear(FEATURES, 6)
        self.norm = norm()
        self.head = nn.Linear(6, OUTPUTS)

    def objective(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.head(torch.tanh(self.norm(self.embed(x)))), y)


def _loaded_batch_norm() -> nn.BatchNorm1d:
    """A ``BatchNorm1d`` with running statistics that differ from a fresh one's, as after pretraining."""
    norm = nn.BatchNorm1d(6)
    with torch.no_grad():
        norm.running_mean.uniform_(-0.5, 0.5)
        norm.running_var.uniform_(0.5, 1.5)
    return norm


class BatchNormFrozenOnEpochStart(Normalized):
    """Fine-tuning: the BatchNorm layer is put in eval mode at the start of every training epoch."""

    def __init__(self) -> None:
        super().__init__(_loaded_batch_norm)

    def on_train_epoch_start(self) -> None:
        self.norm.eval()


class BatchNormFrozenByTrain(Normalized):
    """Fine-tuning: ``train()`` keeps the BatchNorm layer in eval mode.

    Lightning 2.x does not call ``train()`` in ``fit``; user code does, here at the end of ``__init__``.
    """

    def __init__(self) -> None:
        super().__init__(_loaded_batch_norm)
        self.train()

    def train(self, mode: bool = True) -> BatchNormFrozenByTrain:
        super().train(mode)
        self.norm.eval()
        return self


class ParameterListModel(ZooModule):
    def __init__(self) -> None:
        super().__init__()
        self.weights = nn.ParameterList([nn.Parameter(0.5 * torch.randn(FEATURES, 6)), nn.Parameter(torch.zeros(6))])
        self.head = nn.Linear(6, OUTPUTS)

    def objective(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.head(torch.tanh(x @ self.weights[0] + self.weights[1])), y)


class ParameterDictModel(ZooModule):
    def __init__(self) -> None:
        super().__init__()
        self.weights = nn.ParameterDict(
            {"hidden": nn.Parameter(0.5 * torch.randn(FEATURES, 6)), "output": nn.Parameter(0.5 * torch.randn(6, 2))}
        )

    def objective(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(torch.tanh(x @ self.weights["hidden"]) @ self.weights["output"], y)


class ReusedLayer(ZooModule):
    """One layer applied three times in a forward pass."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(FEATURES, 6)
        self.shared = nn.Linear(6, 6)
        self.head = nn.Linear(6, OUTPUTS)

    def objective(self, batch: Any) -> torch.Tensor:
        x, y = batch
        hidden = torch.tanh(self.embed(x))
        for _ in range(3):
            hidden = torch.tanh(self.shared(hidden))
        return F.mse_loss(self.head(hidden), y)


class FrozenLayers(ZooModule):
    """A frozen layer between two trained ones, so gradients flow through it; a frozen backbone before all."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Linear(FEATURES, 6).requires_grad_(False)
        self.embed = nn.Linear(6, 6)
        self.frozen = nn.Linear(6, 6).requires_grad_(False)
        self.head = nn.Linear(6, OUTPUTS)

    def objective(self, batch: Any) -> torch.Tensor:
        x, y = batch
        hidden = torch.tanh(self.frozen(torch.tanh(self.embed(torch.tanh(self.backbone(x))))))
        return F.mse_loss(self.head(hidden), y)


class NoneMembers(ZooModule):
    """Optional parts left out: a ``None`` submodule, buffer and parameter, and a plain ``None`` attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(FEATURES, OUTPUTS)
        self.register_module("projection", None)
        self.register_buffer("maybe", None)
        self.register_parameter("scale", None)
        self.head = None

    def objective(self, batch: Any) -> torch.Tensor:
        x, y = batch
        prediction = self.net(x)
        if self.projection is not None or self.head is not None:
            raise AssertionError("the optional submodules must stay None")
        if self.maybe is not None or self.scale is not None:
            raise AssertionError("the optional buffer and parameter must stay None")
        return F.mse_loss(prediction, y)


def _shift_input(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return (inputs[0] + 1.0,)


def _halve_output(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
    return 0.5 * output


def _tanh_output(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
    return torch.tanh(output)


class Hooked(ZooModule):
    """Forward pre-hooks and forward hooks on submodules change what flows through them."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(FEATURES, 6)
        self.head = nn.Linear(6, OUTPUTS)
        self.embed.register_forward_pre_hook(_shift_input)
        self.embed.register_forward_hook(_tanh_output)
        self.head.register_forward_hook(_halve_output)

    def objective(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.head(self.embed(x)), y)


class WeightPenalty(ZooModule):
    """An L2 penalty over the encoder's parameters, computed inside ``training_step``."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(FEATURES, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh())
        self.head = nn.Linear(6, OUTPUTS)

    def objective(self, batch: Any) -> torch.Tensor:
        x, y = batch
        penalty = sum(parameter.pow(2).sum() for parameter in self.encoder.parameters())
        return F.mse_loss(self.head(self.encoder(x)), y) + 0.01 * penalty


class ParameterDeviceAndDtype(MLP):
    """Takes the device and dtype for its inputs from ``next(self.parameters())``."""

    def objective(self, batch: Any) -> torch.Tensor:
        x, y = batch
        parameter = next(self.parameters())
        return F.mse_loss(self(x.to(device=parameter.device, dtype=parameter.dtype)), y)


class InPlaceCounter(MLP):
    """Counts its training steps in a buffer updated in place."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def objective(self, batch: Any) -> torch.Tensor:
        self.count.add_(1)
        return super().objective(batch)


class ReassignedCounter(MLP):
    """Counts its training steps in a buffer reassigned with a new tensor every step."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def objective(self, batch: Any) -> torch.Tensor:
        self.count = self.count + 1
        return super().objective(batch)


class MomentumTarget(MLP):
    """BYOL's and MoCo's momentum encoder: a frozen copy of the network, moved towards it at the start of each step."""

    def __init__(self) -> None:
        super().__init__()
        self.target = copy.deepcopy(self.net).requires_grad_(False)

    def objective(self, batch: Any) -> torch.Tensor:
        target = list(self.target.parameters())
        with torch.no_grad():
            torch._foreach_mul_(target, 0.9)
            torch._foreach_add_(target, list(self.net.parameters()), alpha=0.1)
        x, _ = batch
        return super().objective(batch) + F.mse_loss(self(x), self.target(x))


class Conv1dPool(ZooModule):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv1d(2, 4, 3, padding=1), nn.Tanh(), nn.MaxPool1d(2), nn.Conv1d(4, 4, 3), nn.Tanh(),
            nn.AdaptiveAvgPool1d(1), nn.Flatten(),
        )  # fmt: skip
        self.head = nn.Linear(4, OUTPUTS)

    def objective(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.head(self.features(x)), y)


class Conv2dPool(ZooModule):
    """Trained with Adam."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(2, 4, 3, padding=1), nn.Tanh(), nn.MaxPool2d(2), nn.Conv2d(4, 4, 2), nn.Tanh(),
            nn.AvgPool2d(2), nn.Flatten(),
        )  # fmt: skip
        self.head = nn.Linear(4, OUTPUTS)

    def objective(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.head(self.features(x)), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.01)


class GroupNormConv(ZooModule):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, 4, 3)
        self.norm = nn.GroupNorm(2, 4)
        self.head = nn.Linear(4, OUTPUTS)

    def objective(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.head(torch.tanh(self.norm(self.conv(x))).mean(-1)), y)


class StepEndMLP(MGPUMixin, MLP):
    """Returns per-sample errors from the step; the loss is their mean, taken in ``training_step_end``."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        return {"errors": (self(x) - y).pow(2).mean(1)}

    def training_step_end(self, step_output: dict[str, torch.Tensor]) -> torch.Tensor:
        loss = step_output["errors"].mean()
        self.log("train_loss", loss, sync_dist=True)
        self.log("rows", float(step_output["errors"].shape[0]), reduce_fx="sum", on_epoch=True, sync_dist=True)
        return loss


class DictOutput(MLP):
    """Returns a dict of several tensors from ``training_step``; Lightning takes ``loss`` from it."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        prediction = self(x)
        loss = F.mse_loss(prediction, y)
        self.log("train_loss", loss, sync_dist=True)
        return {
            "loss": loss,
            "prediction": prediction.detach(),
            "errors": (prediction - y).detach().pow(2).mean(1),
            "mse": loss.detach(),
        }


class Scheduled(MLP):
    """Halves the learning rate every step with ``StepLR`` and logs the rate in use."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.log("lr", self.lr_schedulers().get_last_lr()[0])
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Logging(MLP):
    """Logs step and epoch values, with ``log_dict``, ``prog_bar`` and a summed count: all exact under splitting."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        prediction = self(x)
        loss = F.mse_loss(prediction, y)
        self.log("train_loss", loss, prog_bar=True, on_step=True, on_epoch=True)
        self.log("rows", float(x.shape[0]), reduce_fx="sum", on_step=True, on_epoch=True)
        self.log("squared_error_sum", (prediction - y).pow(2).sum(), reduce_fx="sum")
        self.log_dict({"prediction_mean": prediction.mean(), "target_mean": y.mean()}, on_step=False, on_epoch=True)
        self.log("step_in_epoch", float(batch_idx), on_step=True)
        return loss


class TrainingBatchNorm(Normalized):
    """BatchNorm in training mode: ``mgpu_dp`` shares the batch statistics between its replicas."""

    def __init__(self) -> None:
        super().__init__(functools.partial(nn.BatchNorm1d, 6))


# Entries -----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """One zoo model: how to build it and its data, how many steps to train, what to pass to the Trainer.

    Attributes:
        name: the pytest id.
        build: returns a fresh model, with the same initial weights every time.
        data: returns a dataset with the given number of rows, the same every time.
        steps: optimizer steps to train (one epoch of exactly this many batches).
        trainer_kwargs: for every Trainer that trains the model.
        known: buffers whose value after training is known beforehand, by state_dict key.
    """

    name: str
    build: Callable[[], L.LightningModule]
    data: Callable[[int], TensorDataset] = vectors
    steps: int = STEPS
    trainer_kwargs: Mapping[str, Any] = field(default_factory=dict)
    known: Mapping[str, float] = field(default_factory=dict)


_ENTRIES = [
    Entry("mlp", MLP),
    Entry("momentum-target", MomentumTarget),
    Entry("lstm-bidirectional", functools.partial(Recurrent, nn.LSTM, num_layers=2, bidirectional=True), sequences),
    Entry("lstm-packed", functools.partial(Recurrent, nn.LSTM, packed=True), sequences),
    Entry("gru-multilayer", functools.partial(Recurrent, nn.GRU, num_layers=2), sequences),
    Entry("gru-packed-bidirectional", functools.partial(Recurrent, nn.GRU, packed=True, bidirectional=True), sequences),
    Entry("rnn-bidirectional", functools.partial(Recurrent, nn.RNN, bidirectional=True), sequences),
    Entry(
        "rnn-packed-multilayer-relu",
        functools.partial(Recurrent, nn.RNN, packed=True, num_layers=2, nonlinearity="relu"),
        sequences,
    ),
    Entry("multihead-attention-causal-mask", CausalSelfAttention, sequences),
    Entry("transformer-encoder-padding-mask", PaddedEncoder, sequences),
    Entry("transformer", Seq2Seq, sequences),
    Entry("embedding", TokenRegressor, tokens),
    Entry("embedding-sparse", functools.partial(TokenRegressor, sparse=True), tokens),
    Entry("embedding-bag", BagRegressor, tokens),
    Entry("tied-weights", TiedLanguageModel, classes),
    Entry("weight-norm-parametrization", functools.partial(Parametrized, nn.utils.parametrizations.weight_norm)),
    Entry("orthogonal-parametrization", functools.partial(Parametrized, nn.utils.parametrizations.orthogonal)),
    Entry("spectral-norm-parametrization", functools.partial(Parametrized, nn.utils.parametrizations.spectral_norm)),
    Entry("weight-norm-old-style", functools.partial(Parametrized, _quietly(nn.utils.weight_norm))),
    Entry("spectral-norm-old-style", functools.partial(Parametrized, _quietly(nn.utils.spectral_norm))),
    Entry("checkpoint-reentrant", functools.partial(Checkpointed, use_reentrant=True)),
    Entry("checkpoint-non-reentrant", functools.partial(Checkpointed, use_reentrant=False)),
    Entry("compiled-wrapped", functools.partial(Compiled, in_place=False)),
    Entry("compiled-in-place", functools.partial(Compiled, in_place=True)),
    Entry("compiled-aot-eager", functools.partial(Compiled, in_place=False, backend="aot_eager")),
    Entry("batchnorm-frozen-on-epoch-start", BatchNormFrozenOnEpochStart, known={"norm.num_batches_tracked": 0}),
    Entry("batchnorm-frozen-by-train-override", BatchNormFrozenByTrain, known={"norm.num_batches_tracked": 0}),
    Entry("layernorm", functools.partial(Normalized, functools.partial(nn.LayerNorm, 6))),
    Entry("groupnorm-conv1d", GroupNormConv, signals),
    Entry("conv1d-pool", Conv1dPool, signals),
    Entry("conv2d-pool-adam", Conv2dPool, images),
    Entry("parameter-list", ParameterListModel),
    Entry("parameter-dict", ParameterDictModel),
    Entry("layer-reused", ReusedLayer),
    Entry("frozen-layers", FrozenLayers),
    Entry("none-submodule-buffer-parameter", NoneMembers),
    Entry("forward-hooks-and-pre-hooks", Hooked),
    Entry("weight-penalty-over-submodule", WeightPenalty),
    Entry("parameters-device-dtype-in-step", ParameterDeviceAndDtype),
    Entry("buffer-counter-in-place", InPlaceCounter, steps=4, known={"count": 4}),
    Entry("buffer-counter-reassigned", ReassignedCounter, steps=4, known={"count": 4}),
    Entry("training-step-end", StepEndMLP),
    Entry("dict-output", DictOutput),
    Entry("step-lr-scheduler", Scheduled),
    Entry("gradient-clipping-norm", MLP, trainer_kwargs={"gradient_clip_val": 0.05}),
    Entry(
        "gradient-clipping-value", MLP, trainer_kwargs={"gradient_clip_val": 0.02, "gradient_clip_algorithm": "value"}
    ),
    Entry("logging", Logging),
    Entry(
        "batchnorm-train",
        TrainingBatchNorm,
        known={"norm.num_batches_tracked": STEPS},
    ),
]

ZOO: dict[str, Entry] = {entry.name: entry for entry in _ENTRIES}
"""Every entry, trained under ``mgpu_dp``."""

DDP_ZOO = [
    "lstm-bidirectional",
    "transformer-encoder-padding-mask",
    "embedding-sparse",
    "weight-penalty-over-submodule",
    "tied-weights",
    "compiled-wrapped",
    "buffer-counter-in-place",
    "gru-packed-bidirectional",
    "weight-norm-old-style",
]
"""Trained in one two-process job, in this order.

Training-mode BatchNorm is not among them: exact under mgpu_ddp needs ``Trainer(sync_batchnorm=True)``, which
tests/test_sync_batchnorm.py covers on CPU processes.
"""


# Harness -----------------------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """What one training run ended with.

    Attributes:
        state: every parameter and buffer (non-persistent buffers too), by state_dict key.
        metrics: ``trainer.callback_metrics``.
        initial: ``state`` before training.
        structure_before: ``structure(model)`` before ``fit``.
        structure_after: ``structure(model)`` after ``fit``.
    """

    state: dict[str, torch.Tensor]
    metrics: dict[str, torch.Tensor]
    initial: dict[str, torch.Tensor]
    structure_before: dict[str, list[str]]
    structure_after: dict[str, list[str]]


def snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    state = {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}
    for name, buffer in module.named_buffers():
        state.setdefault(name, buffer.detach().clone())
    return state


def structure(module: nn.Module) -> dict[str, list[str]]:
    """Every submodule by name, with its class and the names in its ``__dict__``."""
    return {
        name: [type(submodule).__qualname__, *sorted(vars(submodule))] for name, submodule in module.named_modules()
    }


def train(entry: Entry, batch_size: int, distributed: bool = False, **trainer_kwargs: Any) -> Outcome:
    """Train a fresh ``entry`` model for ``entry.steps`` steps of ``batch_size`` rows (per process if distributed).

    Distributed, process ``r`` of ``w`` takes rows ``r, r + w, ...``: per step the processes together see the
    rows one device sees with ``w * batch_size`` rows per step.
    """
    model = entry.build()
    _ = model.hparams  # Lightning adds ``_hparams`` on the first read; only what fit adds should show
    initial = snapshot(model)
    before = structure(model)
    fitting = trainer(
        max_epochs=1, max_steps=entry.steps, log_every_n_steps=1, **entry.trainer_kwargs, **trainer_kwargs
    )
    dataset = entry.data(entry.steps * batch_size * fitting.world_size)
    sampler = None
    if distributed:
        sampler = DistributedSampler(dataset, num_replicas=fitting.world_size, rank=fitting.global_rank, shuffle=False)
    fitting.fit(model, DataLoader(dataset, batch_size=batch_size, shuffle=False, sampler=sampler))
    metrics = {name: value.detach().clone() for name, value in fitting.callback_metrics.items()}
    return Outcome(snapshot(model), metrics, initial, before, structure(model))


def train_ddp(entry: Entry, timeout: float) -> Outcome:
    """``train`` in a rank of a two-process mgpu_ddp job (``scripts/zoo_ddp.py``), ``DDP_BATCH`` rows per rank."""
    strategy = lightning_mgpu.MGPUDDPStrategy(timeout=timedelta(seconds=timeout))
    return train(
        entry,
        DDP_BATCH,
        distributed=True,
        accelerator="cpu",
        devices=DDP_WORLD_SIZE,
        strategy=strategy,
        use_distributed_sampler=False,
    )


def assert_close_tensors(
    got: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], what: str, atol: float = 1e-6
) -> None:
    assert sorted(got) == sorted(expected), f"{what}: different names"
    for name in expected:
        torch.testing.assert_close(
            got[name], expected[name], atol=atol, rtol=0, msg=lambda message, name=name: f"{what} {name}: {message}"
        )


def assert_same_training(got: Outcome, expected: Outcome, atol: float = 1e-6) -> None:
    """Same parameters, buffers and logged values, to ``atol``."""
    assert_close_tensors(got.state, expected.state, "parameter or buffer", atol)
    assert_close_tensors(got.metrics, expected.metrics, "logged value", atol)


def assert_structure_kept(outcome: Outcome) -> None:
    """``fit`` kept every submodule, its class and the names in its ``__dict__``: nothing added, nothing left behind."""
    before, after = outcome.structure_before, outcome.structure_after
    changes = []
    if set(after) != set(before):
        changes.append(
            f"submodules added {sorted(set(after) - set(before))}, removed {sorted(set(before) - set(after))}"
        )
    for name in sorted(set(before) & set(after)):
        if after[name] != before[name]:
            added, removed = sorted(set(after[name]) - set(before[name])), sorted(set(before[name]) - set(after[name]))
            changes.append(f"{name or '<root>'}: class or attributes changed, added {added}, removed {removed}")
    assert not changes, "fit changed the model: " + "; ".join(changes)


def assert_trained(outcome: Outcome, entry: Entry) -> None:
    """Training moved the weights and left every known buffer at its known value, so the comparison means something."""
    moved = [name for name, value in outcome.state.items() if not torch.equal(value, outcome.initial[name])]
    assert moved, f"{entry.name}: training changed nothing"
    assert "train_loss" in outcome.metrics, f"{entry.name}: train_loss was not logged"
    for name, value in entry.known.items():
        assert outcome.state[name].item() == value, f"{entry.name}: {name} is {outcome.state[name].item()}, not {value}"
