# ruff: noqa
"""CLMR's supervised baseline: torchmetrics called inside ``training_step``/``validation_step`` under ``dp``.

Source:    https://github.com/Spijkervet/CLMR (Contrastive Learning of Musical Representations)
Files:     clmr/modules/supervised_learning.py (class SupervisedLearning)
           clmr/models/sample_cnn.py (class SampleCNN, shrunk below)
Commit:    423414d086350d04fd46e48bc74af30a208eff90 (2021-11-11; supervised_learning.py last changed in be890f9,
           2021-11-10). From 3523e08 (2021-03-18) to be890f9 config/config.yaml set ``accelerator: "dp"``, which
           main.py passes to ``Trainer.from_argparse_args(args, ..., sync_batchnorm=True, accelerator=args.accelerator)``
           for this module (``supervised: 1``) and for ContrastiveLearning.
Licence:   Apache-2.0 (LICENSE, the Apache License 2.0 text, no copyright line; the paper and code are by Janne
           Spijkervet)

What the model does: a SampleCNN (1-D convolutions with BatchNorm over raw audio) trained on music tags/genres;
``training_step`` and ``validation_step`` compute the loss and call ``torchmetrics.AveragePrecision`` on the step's
batch, logging the batch value; there is no ``*_step_end`` hook, so under ``dp`` each GPU called the metric on its own
chunk. The ReduceLROnPlateau scheduler follows "Valid/loss".

Changes to shrink it (training_step, validation_step, configure_criterion as written, configure_optimizers but for
``verbose``):
- ``SampleCNN`` keeps its structure (a strided Conv1d, Conv1d+BatchNorm1d+ReLU+MaxPool1d blocks, a last
  Conv1d+BatchNorm1d+ReLU, the ``fc`` layer) but with 8-16 channels and 2 blocks instead of 128-512 channels and 9
  blocks, for 27 samples of audio instead of 59049; it is built with ``supervised=0`` because its
  ``Dropout(0.5)`` draws random masks that one device and several replicas cannot draw alike.
- ``torchmetrics.AveragePrecision(pos_label=1)`` becomes ``AveragePrecision(task="multiclass", num_classes=...)``:
  torchmetrics >= 0.11 needs the task (not a Lightning change). The "gtzan" dataset setting (CrossEntropyLoss,
  integer genres) is used: the multilabel one (BCEWithLogitsLoss) passes float targets, which the new metric refuses.
- ``ReduceLROnPlateau(..., verbose=True)``: torch 2.14 removed ``verbose``, so the argument is dropped.
- Data: seeded random "audio" of shape (batch, 1, 1, 27) in float64 and genres 0, 1, 2 in turn, from ``audio()``;
  ``build()`` sets the hyperparameters the module reads, with learning_rate 0.03 instead of the config's 0.0003 so
  that a few steps move the parameters visibly.
- No Lightning 2.0 change was needed.
"""
import torch
import torchmetrics
import torch.nn as nn
from pytorch_lightning import LightningModule


# --------------------------------------------------------------------------------------- clmr/models/sample_cnn.py
class SampleCNN(nn.Module):
    """SampleCNN with the original's layout, shrunk: 8/16 channels instead of 128/256/512, two blocks instead of nine."""

    def __init__(self, strides, supervised, out_dim):
        super(SampleCNN, self).__init__()

        self.strides = strides
        self.supervised = supervised
        self.sequential = [
            nn.Sequential(
                nn.Conv1d(1, 8, kernel_size=3, stride=3, padding=0),
                nn.BatchNorm1d(8),
                nn.ReLU(),
            )
        ]

        self.hidden = [
            [8, 8],
            [8, 16],
        ]

        assert len(self.hidden) == len(
            self.strides
        ), "Number of hidden layers and strides are not equal"
        for stride, (h_in, h_out) in zip(self.strides, self.hidden):
            self.sequential.append(
                nn.Sequential(
                    nn.Conv1d(h_in, h_out, kernel_size=stride, stride=1, padding=1),
                    nn.BatchNorm1d(h_out),
                    nn.ReLU(),
                    nn.MaxPool1d(stride, stride=stride),
                )
            )

        # 1 x 16
        self.sequential.append(
            nn.Sequential(
                nn.Conv1d(16, 16, kernel_size=3, stride=1, padding=1),
                nn.BatchNorm1d(16),
                nn.ReLU(),
            )
        )

        self.sequential = nn.Sequential(*self.sequential)

        if self.supervised:
            self.dropout = nn.Dropout(0.5)
        self.fc = nn.Linear(16, out_dim)

    def forward(self, x):
        out = self.sequential(x)
        if self.supervised:
            out = self.dropout(out)

        out = out.reshape(x.shape[0], out.size(1) * out.size(2))
        logit = self.fc(out)
        return logit


# ----------------------------------------------------------------------------- clmr/modules/supervised_learning.py
class SupervisedLearning(LightningModule):
    def __init__(self, args, encoder: nn.Module, output_dim: int):
        super().__init__()
        self.save_hyperparameters(args)
        self.encoder = encoder

        self.encoder.fc.out_features = output_dim
        self.output_dim = output_dim
        self.model = self.encoder
        self.criterion = self.configure_criterion()

        self.average_precision = torchmetrics.AveragePrecision(task="multiclass", num_classes=output_dim)

    def forward(self, x, y):
        x = x[:, 0, :]  # we only have 1 sample, no augmentations
        preds = self.model(x)
        loss = self.criterion(preds, y)
        return loss, preds

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss, preds = self.forward(x, y)
        self.log("Train/pr_auc", self.average_precision(preds, y))
        self.log("Train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss, preds = self.forward(x, y)
        self.log("Valid/pr_auc", self.average_precision(preds, y))
        self.log("Valid/loss", loss)
        return loss

    def configure_criterion(self):
        if self.hparams.dataset in ["magnatagatune"]:
            criterion = nn.BCEWithLogitsLoss()
        else:
            criterion = nn.CrossEntropyLoss()
        return criterion

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(
            self.model.parameters(),
            lr=self.hparams.learning_rate,
            momentum=0.9,
            weight_decay=1e-6,
            nesterov=True,
        )

        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(
            optimizer, mode="min", factor=0.2, patience=5
        )

        if scheduler:
            return {
                "optimizer": optimizer,
                "lr_scheduler": scheduler,
                "monitor": "Valid/loss",
            }
        else:
            return {"optimizer": optimizer}


# ------------------------------------------------------------------------------------------- the tests' stand-ins
GENRES = 3


def audio(size: int, seed: int) -> torch.utils.data.TensorDataset:
    """Seeded random 'audio' (size, 1, 1, 27) in float64, genres 0, 1, 2 in turn, each with its own offset."""
    generator = torch.Generator().manual_seed(seed)
    y = torch.arange(size) % GENRES
    x = torch.randn(size, 1, 1, 27, generator=generator, dtype=torch.float64) + 0.5 * y.view(-1, 1, 1, 1)
    return torch.utils.data.TensorDataset(x, y)


def build() -> SupervisedLearning:
    from argparse import Namespace

    torch.manual_seed(0)
    # config/config.yaml's values where they matter here; supervised=1 selected this module in main.py
    args = Namespace(dataset="gtzan", learning_rate=0.03, supervised=1, batch_size=7)
    encoder = SampleCNN(strides=[3, 3], supervised=0, out_dim=GENRES)
    return SupervisedLearning(args, encoder, output_dim=GENRES).double()
