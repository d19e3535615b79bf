"""Classify scikit-learn's bundled handwritten digits (no download) under any strategy.

``load_digits`` ships 1797 8x8 grey-scale images of the digits 0-9 inside scikit-learn. The classifier is written the
multi-device way:

* ``training_step``/``validation_step``/``test_step`` return the logits and the targets of their rows and reduce
  nothing, because under ``mgpu_dp`` each replica sees only its chunk of the batch; ``predict_step`` returns each
  image's class probabilities and predicted class;
* the cross-entropy is computed in ``training_step_end`` on the logits of the whole batch, gathered on the root device,
  and the torchmetrics ``Accuracy`` objects are updated in ``validation_step_end``/``test_step_end`` with the gathered
  predictions;
* ``MGPUMixin`` comes first among the bases, so the ``*_step_end`` hooks also run on one device and under Lightning's
  own strategies.

The digits are split by a seed into training, validation and test images; ``test`` scores the test images and
``predict`` writes the class probabilities of each into ``<run folder>/predictions.csv`` (see
``DigitsPredictions``).

``BatchNormDigitsClassifier`` is the same network with ``nn.BatchNorm1d`` inside. ``mgpu_dp`` trains it exactly as one
device does (its replicas exchange the batch statistics); under ``mgpu_ddp`` each rank normalises its own rows, which
``lightning-mgpu doctor --target mgpu_ddp`` reports as a batch-dependent step.

Run it from anywhere (the repository root is put on ``sys.path``)::

    python examples/classifier.py                                       # fit with configs/classifier.yaml
    python examples/classifier.py fit --config configs/classifier.yaml  # the same, any LightningCLI option after it
    lightning-mgpu fit --config configs/classifier.yaml                 # the same through the package's command
    lightning-mgpu test --config configs/classifier.yaml --ckpt_path runs/classifier/version_0/checkpoints/<name>.ckpt
    lightning-mgpu predict --config configs/classifier.yaml --ckpt_path <the same checkpoint>
    lightning-mgpu doctor --model examples.classifier.BatchNormDigitsClassifier --data examples.classifier.DigitsData \
        --target mgpu_ddp
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import BasePredictionWriter
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import Accuracy

from lightning_mgpu import MGPUMixin  # importing lightning_mgpu registers mgpu_dp and mgpu_ddp

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script or loaded from its file: the examples package must import
    sys.path.insert(0, str(ROOT))

from examples.common import gather_to_rank_zero, run_example, write_csv  # noqa: E402

DEFAULT_ARGS = ("fit", "--config", str(ROOT / "configs" / "classifier.yaml"))
NUM_CLASSES = 10
Batch = tuple[torch.Tensor, torch.Tensor]


class DigitsData(L.LightningDataModule):
    """scikit-learn's 8x8 digits as float images ``(N, 1, 8, 8)`` in ``[0, 1]`` and integer labels, split by a seed.

    The 1797 images are split once into validation, test and training images, each image in exactly one split; every
    stage makes the same split. ``predict`` runs on the test images, in order.

    Args:
        batch_size: images per batch; under ``mgpu_dp`` each batch is split across the devices, under ``mgpu_ddp``
            every process loads a batch of this size.
        val_fraction: share of the images held out for validation.
        test_fraction: share of the images held out for ``test`` and ``predict``.
        seed: seed of the split.
        num_workers: dataloader worker processes; 0 loads in the main process, which is fastest for data this small.
    """

    def __init__(
        self,
        batch_size: int = 64,
        val_fraction: float = 0.1,
        test_fraction: float = 0.1,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if not (0 < val_fraction < 1 and 0 < test_fraction < 1 and val_fraction + test_fraction < 1):
            raise ValueError(
                "val_fraction and test_fraction must each be between 0 and 1 (exclusive) and leave images to train on,"
                f" got {val_fraction} and {test_fraction}"
            )
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.seed = seed
        self.num_workers = num_workers
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None
        self.test_set: TensorDataset | None = None

    def setup(self, stage: str) -> None:
        try:
            from sklearn.datasets import load_digits
        except ImportError:
            raise ImportError(
                'The digits example reads its data from scikit-learn: pip install "lightning-mgpu[examples]".'
            ) from None
        digits = load_digits()
        images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # pixel values are 0..16
        labels = torch.tensor(digits.target, dtype=torch.long)
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(self.seed))
        num_val = round(len(labels) * self.val_fraction)
        num_test = round(len(labels) * self.test_fraction)
        val, test, train = order.split([num_val, num_test, len(labels) - num_val - num_test])
        self.train_set = TensorDataset(images[train], labels[train])
        self.val_set = TensorDataset(images[val], labels[val])
        self.test_set = TensorDataset(images[test], labels[test])

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None, "call setup('fit') first"
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None, "call setup('fit') first"
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers)

    def test_dataloader(self) -> DataLoader:
        assert self.test_set is not None, "call setup('test') first"
        return DataLoader(self.test_set, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers)

    def predict_dataloader(self) -> DataLoader:
        """The test images with their labels, in order: ``predict`` gives the class probabilities of each."""
        assert self.test_set is not None, "call setup('predict') first"
        return DataLoader(self.test_set, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers)


class DigitsClassifier(MGPUMixin, L.LightningModule):
    """A small MLP over the 64 pixels: ``Linear -> ReLU -> Linear -> ReLU -> Linear`` to 10 logits.

    Args:
        hidden: width of the two hidden layers.
        lr: learning rate of Adam.
    """

    def __init__(self, hidden: int = 128, lr: float = 0.003) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.lr = lr
        self.net = self.build_network(hidden)
        self.val_acc = Accuracy(task="multiclass", num_classes=NUM_CLASSES)
        self.test_acc = Accuracy(task="multiclass", num_classes=NUM_CLASSES)

    def build_network(self, hidden: int) -> nn.Sequential:
        return nn.Sequential(
            nn.Flatten(),
            nn.Linear(64, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, NUM_CLASSES),
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Logits ``(batch, 10)`` of images ``(batch, 1, 8, 8)``."""
        return self.net(images)

    def training_step(self, batch: Batch, batch_idx: int) -> dict[str, torch.Tensor]:
        images, targets = batch
        return {"logits": self(images), "targets": targets}

    def training_step_end(self, outputs: dict[str, torch.Tensor]) -> torch.Tensor:
        loss = F.cross_entropy(outputs["logits"], outputs["targets"])
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Batch, batch_idx: int) -> dict[str, torch.Tensor]:
        images, targets = batch
        return {"logits": self(images), "targets": targets}

    def validation_step_end(self, outputs: dict[str, torch.Tensor]) -> torch.Tensor:
        logits, targets = outputs["logits"], outputs["targets"]
        loss = F.cross_entropy(logits, targets)
        self.val_acc.update(logits.argmax(dim=1), targets)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        self.log("val_acc", self.val_acc, prog_bar=True)
        return loss

    def test_step(self, batch: Batch, batch_idx: int) -> dict[str, torch.Tensor]:
        images, targets = batch
        return {"logits": self(images), "targets": targets}

    def test_step_end(self, outputs: dict[str, torch.Tensor]) -> torch.Tensor:
        logits, targets = outputs["logits"], outputs["targets"]
        loss = F.cross_entropy(logits, targets)
        self.test_acc.update(logits.argmax(dim=1), targets)
        self.log("test_loss", loss, sync_dist=True)
        self.log("test_acc", self.test_acc)
        return loss

    def predict_step(self, batch: Batch, batch_idx: int, dataloader_idx: int = 0) -> dict[str, torch.Tensor]:
        """Per image: its label, the predicted class and the probabilities of the 10 classes."""
        images, targets = batch
        probabilities = F.softmax(self(images), dim=1)
        return {"label": targets, "predicted": probabilities.argmax(dim=1), "probabilities": probabilities}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)

    def configure_callbacks(self) -> list[L.Callback]:
        return [DigitsPredictions()]


class BatchNormDigitsClassifier(DigitsClassifier):
    """The same MLP with ``nn.BatchNorm1d`` after each hidden layer: exact under ``mgpu_dp``, per rank under DDP.

    ``mgpu_dp`` normalises every chunk with the whole batch's statistics. Under ``mgpu_ddp`` each rank normalises its
    rows with their own mean and variance, so the outputs and gradients differ from one device's on the whole batch;
    ``lightning-mgpu doctor --target mgpu_ddp`` reports it, and ``Trainer(sync_batchnorm=True)`` (on GPUs) makes the
    statistics global again.
    """

    def build_network(self, hidden: int) -> nn.Sequential:
        return nn.Sequential(
            nn.Flatten(),
            nn.Linear(64, hidden),
            nn.BatchNorm1d(hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.BatchNorm1d(hidden),
            nn.ReLU(),
            nn.Linear(hidden, NUM_CLASSES),
        )


class DigitsPredictions(BasePredictionWriter):
    """At the end of ``predict``, write each image's class probabilities to ``<trainer.log_dir>/<filename>``.

    A plain CSV file, readable without torch: one row per image of the predict dataloader, in dataset order, with the
    columns ``index`` (the image's position in the dataset), ``label`` (its true digit), ``predicted`` (the most
    probable digit) and ``probability_0`` ... ``probability_9`` (the softmax of the logits, summing to 1).

    Under ``mgpu_dp`` each batch's predictions arrive gathered from every replica. Under DDP each process predicts its
    own share of the images (Lightning's predict sampler repeats none); the rows are gathered to global rank 0, which
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
            labels = prediction["label"].cpu().tolist()
            predicted = prediction["predicted"].cpu().tolist()
            probabilities = prediction["probabilities"].detach().float().cpu().tolist()
            for row, index in enumerate(indices):
                rows[int(index)] = [labels[row], predicted[row], *probabilities[row]]
        rows = gather_to_rank_zero(trainer, rows)
        log_dir = trainer.log_dir  # a collective under DDP: read it on every rank
        if not trainer.is_global_zero or log_dir is None:
            return
        header = ["index", "label", "predicted", *(f"probability_{digit}" for digit in range(NUM_CLASSES))]
        self.path = write_csv(os.path.join(log_dir, self.filename), header, rows)


def main(args: Sequence[str] | None = None) -> int:
    """``python examples/classifier.py [fit|validate|test|predict] [LightningCLI options]``; ``args`` replace argv.

    No arguments run ``fit --config configs/classifier.yaml``; a config's own ``class_path``
    (``BatchNormDigitsClassifier``, say) wins over the default model.
    """
    return run_example(
        __file__, "examples.classifier.DigitsClassifier", "examples.classifier.DigitsData", args, DEFAULT_ARGS
    )


if __name__ == "__main__":
    sys.exit(main())
