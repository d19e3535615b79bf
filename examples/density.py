"""Fit a factorized density model to a 1-D Gaussian mixture with ``strategy="mgpu_dp"``.

The model is the factorized prior of Ballé et al., "Variational image compression with a scale hyperprior" (2018):
per channel, a small stack of monotonic 1-D affine layers and nonlinearities gives the logits of a CDF, and the
likelihood of ``x`` is the probability mass that CDF puts on ``[x - 0.5, x + 0.5]``.

It is written the way the multi-device lessons say, and runs unchanged under every strategy (one device, Lightning's
``ddp``, ``mgpu_dp``, ``mgpu_ddp``) because ``MGPUMixin`` comes first among its bases:

* parameters are registered with ``register_parameter`` (no ``nn.ParameterList``), so every replica sees them;
* ``training_step``/``validation_step`` return one likelihood per sample and do no batch-wise reduction, because
  each replica sees only its chunk of the batch;
* the loss (mean negative log-likelihood in bits) is computed in ``training_step_end``/``validation_step_end``/
  ``test_step_end`` from the likelihoods of the whole batch, gathered on the root device;
* ``predict_step`` returns each sample with its likelihood, and reduces nothing either.

The model's own callbacks (``configure_callbacks``) write into the run folder: at the end of ``fit``, the learned
density over the training data's histogram (``density.png``); at the end of ``predict``, the likelihood of every
held-out test sample (``predictions.csv``, see ``DensityPredictions``). Run it from anywhere (the repository root is put
on ``sys.path``)::

    python examples/density.py                                          # fit with configs/quickstart.yaml
    python examples/density.py fit --config configs/quickstart.yaml     # the same, any LightningCLI option after it
    lightning-mgpu fit --config configs/quickstart.yaml                 # the same through the package's command
    lightning-mgpu test --config configs/quickstart.yaml --ckpt_path runs/quickstart/version_0/checkpoints/<name>.ckpt
    lightning-mgpu predict --config configs/quickstart.yaml --ckpt_path <the same checkpoint>
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from torch.utils.data import DataLoader

from lightning_mgpu import MGPUMixin  # importing lightning_mgpu registers mgpu_dp and mgpu_ddp

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script or loaded from its file: the examples package must import
    sys.path.insert(0, str(ROOT))

from examples.common import gather_to_rank_zero, run_example, write_csv  # noqa: E402

DEFAULT_ARGS = ("fit", "--config", str(ROOT / "configs" / "quickstart.yaml"))
LIKELIHOOD_BOUND = 1e-9


class GaussianMixtureData(L.LightningDataModule):
    """Samples of a 1-D Gaussian mixture, generated from a fixed seed (no downloads).

    Args:
        num_samples: training samples.
        num_val_samples: validation samples, drawn independently of the training samples.
        num_test_samples: test samples, drawn after the validation samples from the same generator; ``test`` scores
            them and ``predict`` gives the likelihood of each.
        batch_size: samples per batch; under ``mgpu_dp`` each batch is split across the devices.
        components: ``(weight, mean, std)`` per mixture component; weights are normalised to sum to 1.
        seed: seed of the generator that draws the samples.
        shuffle: shuffle the training samples every epoch.
    """

    def __init__(
        self,
        num_samples: int = 20_000,
        num_val_samples: int = 4_000,
        num_test_samples: int = 4_000,
        batch_size: int = 500,
        components: Sequence[Sequence[float]] = ((0.3, -12.0, 3.0), (0.5, 0.0, 2.0), (0.2, 10.0, 4.0)),
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        super().__init__()
        if any(len(component) != 3 for component in components):
            raise ValueError(f"components must be (weight, mean, std) triples, got {components!r}")
        self.num_samples = num_samples
        self.num_val_samples = num_val_samples
        self.num_test_samples = num_test_samples
        self.batch_size = batch_size
        self.components = torch.tensor([list(component) for component in components], dtype=torch.float64)
        self.seed = seed
        self.shuffle = shuffle
        self.train_data: torch.Tensor | None = None
        self.val_data: torch.Tensor | None = None
        self.test_data: torch.Tensor | None = None

    def sample(self, num_samples: int, generator: torch.Generator) -> torch.Tensor:
        """Draw ``num_samples`` samples as a float32 tensor of shape ``(num_samples, 1)``."""
        weights, means, stds = self.components.unbind(dim=1)
        which = torch.multinomial(weights / weights.sum(), num_samples, replacement=True, generator=generator)
        noise = torch.randn(num_samples, generator=generator, dtype=torch.float64)
        return (means[which] + stds[which] * noise).to(torch.float32).unsqueeze(1)

    def setup(self, stage: str) -> None:
        # Every stage draws all three sets in the same order, so each set is the same whatever the stage.
        generator = torch.Generator().manual_seed(self.seed)
        self.train_data = self.sample(self.num_samples, generator)
        self.val_data = self.sample(self.num_val_samples, generator)
        self.test_data = self.sample(self.num_test_samples, generator)

    def train_dataloader(self) -> DataLoader:
        assert self.train_data is not None
        return DataLoader(self.train_data, batch_size=self.batch_size, shuffle=self.shuffle, num_workers=0)

    def val_dataloader(self) -> DataLoader:
        assert self.val_data is not None
        return DataLoader(self.val_data, batch_size=self.batch_size, shuffle=False, num_workers=0)

    def test_dataloader(self) -> DataLoader:
        assert self.test_data is not None
        return DataLoader(self.test_data, batch_size=self.batch_size, shuffle=False, num_workers=0)

    def predict_dataloader(self) -> DataLoader:
        """The test samples, in order: ``predict`` gives the likelihood of each."""
        assert self.test_data is not None
        return DataLoader(self.test_data, batch_size=self.batch_size, shuffle=False, num_workers=0)


class DensityModel(MGPUMixin, L.LightningModule):
    """A factorized density model: per channel, a monotonic 1-D network that gives the logits of a CDF.

    Layer ``k`` maps ``filters[k]`` to ``filters[k + 1]`` features with ``softplus(H_k) @ x + b_k`` (softplus keeps
    the weights non-negative, so the CDF is non-decreasing); between layers ``x + tanh(a_k) * tanh(x)`` adds a
    monotonic nonlinearity. Parameters are named ``H_k``, ``a_k``, ``b_k``; the last layer has no ``a_k``.

    Args:
        channels: independent channels, one density each (the data here has 1).
        hidden_filters: widths of the hidden layers; ``filters = (1, *hidden_filters, 1)``.
        init_scale: the initial width of the density; split evenly over the layers as in Ballé et al.'s code.
        lr: learning rate of Adam.
    """

    def __init__(
        self,
        channels: int = 1,
        hidden_filters: Sequence[int] = (3, 3, 3),
        init_scale: float = 10.0,
        lr: float = 0.05,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.channels = channels
        self.filters = (1, *hidden_filters, 1)
        self.num_layers = len(self.filters) - 1
        self.lr = lr
        scale = init_scale ** (1 / self.num_layers)
        for k in range(self.num_layers):
            H_init = math.log(math.expm1(1 / scale / self.filters[k + 1]))
            H_k = nn.Parameter(torch.full((channels, self.filters[k + 1], self.filters[k]), H_init))
            self.register_parameter(f"H_{k}", H_k)
            if k < self.num_layers - 1:
                a_k = nn.Parameter(torch.zeros(channels, self.filters[k + 1], 1))
                self.register_parameter(f"a_{k}", a_k)
            b_k = nn.Parameter(torch.empty(channels, self.filters[k + 1], 1).uniform_(-0.5, 0.5))
            self.register_parameter(f"b_{k}", b_k)

    def logits_cdf(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of the CDF at ``x`` of shape ``(batch, channels)``; same shape out."""
        logits = x.t().unsqueeze(1)  # (channels, 1, batch): one 1-D network per channel
        for k in range(self.num_layers):
            logits = torch.matmul(F.softplus(getattr(self, f"H_{k}")), logits) + getattr(self, f"b_{k}")
            if k < self.num_layers - 1:
                logits = logits + torch.tanh(getattr(self, f"a_{k}")) * torch.tanh(logits)
        return logits.squeeze(1).t()

    def likelihood(self, x: torch.Tensor) -> torch.Tensor:
        """Probability mass on ``[x - 0.5, x + 0.5]`` per sample and channel, at least ``LIKELIHOOD_BOUND``."""
        lower = self.logits_cdf(x - 0.5)
        upper = self.logits_cdf(x + 0.5)
        # Subtract in the tail where both sigmoids are far from saturating: 1 - s(u) - (1 - s(l)) = s(-l) - s(-u).
        sign = torch.where(lower + upper > 0, -1.0, 1.0)
        mass = torch.abs(torch.sigmoid(sign * upper) - torch.sigmoid(sign * lower))
        return mass.clamp_min(LIKELIHOOD_BOUND)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Likelihood of each sample ``(batch, channels)``, channels being independent: shape ``(batch,)``."""
        return self.likelihood(x).prod(dim=1)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self(batch)

    def training_step_end(self, likelihoods: torch.Tensor) -> torch.Tensor:
        loss = nll_bits(likelihoods)
        self.log("train_nll", loss, prog_bar=True, on_step=True, on_epoch=True)  # train_nll_step, train_nll_epoch
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self(batch)

    def validation_step_end(self, likelihoods: torch.Tensor) -> torch.Tensor:
        loss = nll_bits(likelihoods)
        self.log("val_nll", loss, prog_bar=True, sync_dist=True)  # epoch mean over every rank under DDP
        return loss

    def test_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self(batch)

    def test_step_end(self, likelihoods: torch.Tensor) -> torch.Tensor:
        loss = nll_bits(likelihoods)
        self.log("test_nll", loss, sync_dist=True)
        return loss

    def predict_step(self, batch: torch.Tensor, batch_idx: int, dataloader_idx: int = 0) -> dict[str, torch.Tensor]:
        """Each sample ``(batch, channels)`` with its likelihood ``(batch,)``; ``DensityPredictions`` writes them."""
        return {"x": batch, "likelihood": self(batch)}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)

    def configure_callbacks(self) -> list[L.Callback]:
        return [DensityPlot(), DensityPredictions()]


def nll_bits(likelihoods: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood in bits over the whole batch."""
    return -torch.log2(likelihoods).mean()


class DensityPlot(L.Callback):
    """At the end of ``fit``, draw the learned density over the training data's histogram into the run folder.

    The plot goes to ``<trainer.log_dir>/<filename>``, one panel per channel, written by global rank 0 only with
    matplotlib's Agg canvas (no display, no pyplot state). Without matplotlib the plot is skipped with a warning.

    Args:
        filename: name of the PNG in the run folder.
        bins: histogram bins of the training data.
    """

    def __init__(self, filename: str = "density.png", bins: int = 80) -> None:
        self.filename = filename
        self.bins = bins

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        log_dir = trainer.log_dir  # a collective under DDP: read it on every rank
        if not trainer.is_global_zero or log_dir is None:
            return
        data = getattr(trainer.datamodule, "train_data", None)
        if not isinstance(data, torch.Tensor) or not isinstance(pl_module, DensityModel):
            rank_zero_warn(
                f"{type(self).__name__}: skipped, it plots a DensityModel over its datamodule's train_data tensor."
            )
            return
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
        except ImportError:
            rank_zero_warn(
                f"{type(self).__name__}: matplotlib is not installed, so {self.filename} is not drawn;"
                ' pip install "lightning-mgpu[examples]" to get it.'
            )
            return
        path = os.path.join(log_dir, self.filename)
        os.makedirs(log_dir, exist_ok=True)
        figure = draw_density(Figure(figsize=(7, 3.5 * data.shape[1])), pl_module, data, self.bins, trainer)
        FigureCanvasAgg(figure).print_png(path)


def draw_density(figure: Any, model: DensityModel, data: torch.Tensor, bins: int, trainer: L.Trainer) -> Any:
    """One panel per channel: the data's normalised histogram and the model's mass on each unit bin ``[x ± 0.5]``."""
    data = data.detach().cpu().float()
    low, high = data.min().item() - 3.0, data.max().item() + 3.0
    grid = torch.linspace(low, high, 1000)
    with torch.no_grad():
        mass = model.likelihood(grid.unsqueeze(1).expand(-1, data.shape[1]).to(model.device)).float().cpu()
    val_nll = trainer.callback_metrics.get("val_nll")
    for channel, axes in enumerate(figure.subplots(data.shape[1], 1, squeeze=False)[:, 0]):
        axes.hist(data[:, channel].numpy(), bins=bins, range=(low, high), density=True, alpha=0.5, label="data")
        axes.plot(grid.numpy(), mass[:, channel].numpy(), color="C3", label="model: mass of [x - 0.5, x + 0.5]")
        title = f"channel {channel}, after {trainer.global_step} steps"
        if val_nll is not None:
            title += f", val_nll {float(val_nll):.3f} bits"
        axes.set(title=title, xlabel="x", ylabel="density")
        axes.legend(loc="upper right")
    figure.tight_layout()
    return figure


class DensityPredictions(BasePredictionWriter):
    """At the end of ``predict``, write every sample's likelihood to ``<trainer.log_dir>/<filename>``.

    A plain CSV file, readable without torch: one row per sample of the predict dataloader, in dataset order, with the
    columns ``index`` (the sample's position in the dataset), ``x`` (the sample; ``x_0``, ``x_1``, ... with several
    channels), ``likelihood`` (the model's probability mass on ``[x - 0.5, x + 0.5]``) and ``nll_bits``
    (``-log2(likelihood)``: on the test samples their mean is ``test_nll``).

    Under ``mgpu_dp`` each batch's predictions arrive gathered from every replica. Under DDP each process predicts its
    own share of the samples (Lightning's predict sampler repeats none); the rows are gathered to global rank 0, which
    writes the one file, so the file is the same whatever the strategy. One predict dataloader is expected.

    Args:
        filename: name of the CSV file in the run folder.
    """

    def __init__(self, filename: str = "predictions.csv") -> None:
        super().__init__(write_interval="epoch")
        self.filename = filename
        self.path: str | None = None  # where the last ``predict`` wrote, on global rank 0

    def write_on_epoch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        predictions: Sequence[Any],
        batch_indices: Sequence[Any],
    ) -> None:
        if len(batch_indices) != 1:
            raise ValueError(
                f"{type(self).__name__} writes the predictions of one predict dataloader, got {len(batch_indices)};"
                " return one DataLoader from predict_dataloader()."
            )
        rows: dict[int, list[float]] = {}
        for prediction, indices in zip(predictions, batch_indices[0], strict=True):
            x = prediction["x"].detach().float().cpu().reshape(len(indices), -1)
            likelihood = prediction["likelihood"].detach().float().cpu()
            bits = -torch.log2(likelihood)
            for row, index in enumerate(indices):
                rows[int(index)] = [*x[row].tolist(), likelihood[row].item(), bits[row].item()]
        rows = gather_to_rank_zero(trainer, rows)
        log_dir = trainer.log_dir  # a collective under DDP: read it on every rank
        if not trainer.is_global_zero or log_dir is None or not rows:
            return
        channels = len(next(iter(rows.values()))) - 2
        x_columns = ["x"] if channels == 1 else [f"x_{channel}" for channel in range(channels)]
        self.path = write_csv(
            os.path.join(log_dir, self.filename), ["index", *x_columns, "likelihood", "nll_bits"], rows
        )


def main(args: Sequence[str] | None = None) -> int:
    """``python examples/density.py [fit|validate|test|predict] [LightningCLI options]``; ``args`` replace argv.

    No arguments run ``fit --config configs/quickstart.yaml``.
    """
    return run_example(
        __file__, "examples.density.DensityModel", "examples.density.GaussianMixtureData", args, DEFAULT_ARGS
    )


if __name__ == "__main__":
    sys.exit(main())
