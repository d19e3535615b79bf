# ruff: noqa
"""Lightning's own semantic segmentation example (UNet on KITTI), which Lightning 1.0 ran with ``dp`` by default.

Source:    https://github.com/Lightning-AI/pytorch-lightning
Files:     pl_examples/domain_templates/semantic_segmentation.py (class SegModel; KITTI replaced)
           pl_examples/domain_templates/unet.py (UNet, DoubleConv, Down, Up)
Commit:    tag 1.0.0, 09c2020a9325850bc159d2053b30c0bb627e5bbb (2020-10-13). Its ``main`` parsed
           ``--distributed-backend`` with ``default='dp'`` and passed it to ``pl.Trainer(gpus=hparams.gpus,
           distributed_backend=hparams.distributed_backend, ...)``.
Licence:   Apache-2.0, "Copyright The PyTorch Lightning team." (file headers; LICENSE is the Apache License 2.0)

What the model does: a UNet (Conv2d + BatchNorm2d + ReLU blocks) predicts 19 classes per pixel; the loss is
``F.cross_entropy(..., ignore_index=250)`` inside ``training_step``/``validation_step``, each returning 0-dim values
in dicts (``{'loss': ..., 'log': ..., 'progress_bar': ...}``, ``{'val_loss': ...}``) and no ``*_step_end`` hook, so
under ``dp`` Lightning combined the replicas' 0-dim outputs itself. ``validation_epoch_end`` averaged the per-batch
``val_loss``.

Changes to shrink it (training_step, validation_step, the loss and configure_optimizers as written, except below):
- ``KITTI`` (images and masks read from disk) replaced by a stand-in with the same constructor that draws seeded
  uint8 images (16x16) and masks with 19 classes and the same number of ``ignore_index`` (250) pixels in every image
  (so that the mean over the kept pixels is a mean over rows: see the note in tests/test_projects.py).
- ``training_step``/``validation_step``: ``img = img.float()`` becomes ``img = img.double()``, so that the
  comparison runs in float64 (float32 roundoff in the gradient of the conv biases that BatchNorm cancels is
  amplified by Adam to ~1e-4).
- ``configure_optimizers`` reads ``self.learning_rate``, which SegModel never sets (it sets ``self.lr``): every 1.x
  version of the example had this bug, which its doctest (construction only) never reached. ``__init__`` sets
  ``self.learning_rate = lr``.
- UNet with ``num_layers=2, features_start=4`` (the CLI defaults were 5 and 64).
- Lightning 2.0 migration (docs/migrating.md): ``validation_epoch_end(outputs)`` was removed, so outputs are
  collected in ``on_validation_batch_end`` and the body runs in ``on_validation_epoch_end``. The 0.x logging API it
  and ``training_step`` use (returning ``'log'``/``'progress_bar'`` dicts, which Lightning 1.0 still logged) is gone:
  ``on_train_batch_end`` logs ``outputs['log']`` and ``on_validation_epoch_end`` logs its ``log_dict`` with
  ``self.log_dict``, which is what 1.0 did with them.
- ``main`` and its argparse code are dropped; its ``gpus=``/``distributed_backend='dp'`` become the tests'
  ``devices=``/``strategy="mgpu_dp"`` (``"dp"`` is another name of it).
"""
import os
import random
from argparse import ArgumentParser, Namespace

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms as transforms
from torch.utils.data import DataLoader, Dataset

import pytorch_lightning as pl


# ------------------------------------------------------------------------------ pl_examples/domain_templates/unet.py
class UNet(nn.Module):
    """
    Architecture based on U-Net: Convolutional Networks for Biomedical Image Segmentation
    Link - https://arxiv.org/abs/1505.04597

    Parameters:
        num_classes: Number of output classes required (default 19 for KITTI dataset)
        num_layers: Number of layers in each side of U-net
        features_start: Number of features in first layer
        bilinear: Whether to use bilinear interpolation or transposed
            convolutions for upsampling.
    """

    def __init__(
            self, num_classes: int = 19,
            num_layers: int = 5,
            features_start: int = 64,
            bilinear: bool = False
    ):
        super().__init__()
        self.num_layers = num_layers

        layers = [DoubleConv(3, features_start)]

        feats = features_start
        for _ in range(num_layers - 1):
            layers.append(Down(feats, feats * 2))
            feats *= 2

        for _ in range(num_layers - 1):
            layers.append(Up(feats, feats // 2, bilinear))
            feats //= 2

        layers.append(nn.Conv2d(feats, num_classes, kernel_size=1))

        self.layers = nn.ModuleList(layers)

    def forward(self, x):
        xi = [self.layers[0](x)]
        # Down path
        for layer in self.layers[1:self.num_layers]:
            xi.append(layer(xi[-1]))
        # Up path
        for i, layer in enumerate(self.layers[self.num_layers:-1]):
            xi[-1] = layer(xi[-1], xi[-2 - i])
        return self.layers[-1](xi[-1])


class DoubleConv(nn.Module):
    """
    Double Convolution and BN and ReLU
    (3x3 conv -> BN -> ReLU) ** 2
    """

    def __init__(self, in_ch: int, out_ch: int):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(in_ch, out_ch, kernel_size=3, padding=1),
            nn.BatchNorm2d(out_ch),
            nn.ReLU(inplace=True),
            nn.Conv2d(out_ch, out_ch, kernel_size=3, padding=1),
            nn.BatchNorm2d(out_ch),
            nn.ReLU(inplace=True)
        )

    def forward(self, x):
        return self.net(x)


class Down(nn.Module):
    """
    Combination of MaxPool2d and DoubleConv in series
    """

    def __init__(self, in_ch: int, out_ch: int):
        super().__init__()
        self.net = nn.Sequential(
            nn.MaxPool2d(kernel_size=2, stride=2),
            DoubleConv(in_ch, out_ch)
        )

    def forward(self, x):
        return self.net(x)


class Up(nn.Module):
    """
    Upsampling (by either bilinear interpolation or transpose convolutions)
    followed by concatenation of feature map from contracting path,
    followed by double 3x3 convolution.
    """

    def __init__(self, in_ch: int, out_ch: int, bilinear: bool = False):
        super().__init__()
        self.upsample = None
        if bilinear:
            self.upsample = nn.Sequential(
                nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True),
                nn.Conv2d(in_ch, in_ch // 2, kernel_size=1),
            )
        else:
            self.upsample = nn.ConvTranspose2d(in_ch, in_ch // 2, kernel_size=2, stride=2)

        self.conv = DoubleConv(in_ch, out_ch)

    def forward(self, x1, x2):
        x1 = self.upsample(x1)

        # Pad x1 to the size of x2
        diff_h = x2.shape[2] - x1.shape[2]
        diff_w = x2.shape[3] - x1.shape[3]

        x1 = F.pad(x1, [diff_w // 2, diff_w - diff_w // 2, diff_h // 2, diff_h - diff_h // 2])

        # Concatenate along the channels axis
        x = torch.cat([x2, x1], dim=1)
        return self.conv(x)


# ------------------------------------------------------------- pl_examples/domain_templates/semantic_segmentation.py
class KITTI(Dataset):
    """Stand-in for the KITTI semantic segmentation dataset: seeded images and encoded masks of the same kind.

    Each image is uint8 HxWx3 (as ``np.array(Image.open(...))`` gives), each mask holds the 19 valid classes and
    ``ignore_index`` (250) for void pixels, the same number of them in every image.
    """

    sizes = {"train": 21, "valid": 10}

    def __init__(self, data_path: str, split: str, img_size: tuple = (16, 16), transform=None, void_pixels: int = 20):
        self.transform = transform
        self.ignore_index = 250
        generator = torch.Generator().manual_seed({"train": 0, "valid": 1}[split])
        n_items = self.sizes[split]
        self.images = torch.randint(0, 256, (n_items, *img_size, 3), generator=generator, dtype=torch.uint8).numpy()
        masks = torch.randint(0, 19, (n_items, *img_size), generator=generator)
        for mask in masks:
            void = torch.randperm(img_size[0] * img_size[1], generator=generator)[:void_pixels]
            mask.view(-1)[void] = self.ignore_index
        self.masks = masks.numpy()

    def __len__(self):
        return len(self.images)

    def __getitem__(self, idx):
        img = self.images[idx]
        mask = self.masks[idx]
        if self.transform:
            img = self.transform(img)

        return img, mask


class SegModel(pl.LightningModule):
    """
    Semantic Segmentation Module

    This is a basic semantic segmentation module implemented with Lightning.
    It uses CrossEntropyLoss as the default loss function. May be replaced with
    other loss functions as required.
    It is specific to KITTI dataset i.e. dataloaders are for KITTI
    and Normalize transform uses the mean and standard deviation of this dataset.
    It uses the FCN ResNet50 model as an example.

    Adam optimizer is used along with Cosine Annealing learning rate scheduler.
    """

    def __init__(self,
                 data_path: str,
                 batch_size: int,
                 lr: float,
                 num_layers: int,
                 features_start: int,
                 bilinear: bool, **kwargs):
        super().__init__()
        self.data_path = data_path
        self.batch_size = batch_size
        self.lr = lr
        self.learning_rate = lr  # added: configure_optimizers reads it, the original never set it
        self.num_layers = num_layers
        self.features_start = features_start
        self.bilinear = bilinear

        self.net = UNet(num_classes=19, num_layers=self.num_layers,
                        features_start=self.features_start, bilinear=self.bilinear)
        self.transform = transforms.Compose([
            transforms.ToTensor(),
            transforms.Normalize(mean=[0.35675976, 0.37380189, 0.3764753],
                                 std=[0.32064945, 0.32098866, 0.32325324])
        ])
        self.trainset = KITTI(self.data_path, split='train', transform=self.transform)
        self.validset = KITTI(self.data_path, split='valid', transform=self.transform)
        self.validation_outputs = []  # Lightning 2.0: validation_epoch_end(outputs) was removed

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_nb):
        img, mask = batch
        img = img.double()  # was img.float()
        mask = mask.long()
        out = self(img)
        loss_val = F.cross_entropy(out, mask, ignore_index=250)
        log_dict = {'train_loss': loss_val}
        return {'loss': loss_val, 'log': log_dict, 'progress_bar': log_dict}

    def on_train_batch_end(self, outputs, batch, batch_idx):  # Lightning 1.0 logged the 'log' dict of the output
        self.log_dict(outputs['log'])

    def validation_step(self, batch, batch_idx):
        img, mask = batch
        img = img.double()  # was img.float()
        mask = mask.long()
        out = self(img)
        loss_val = F.cross_entropy(out, mask, ignore_index=250)
        return {'val_loss': loss_val}

    def on_validation_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0):
        self.validation_outputs.append(outputs)

    def on_validation_epoch_end(self):  # was validation_epoch_end(self, outputs)
        outputs, self.validation_outputs = self.validation_outputs, []
        loss_val = torch.stack([x['val_loss'] for x in outputs]).mean()
        log_dict = {'val_loss': loss_val}
        # was: return {'log': log_dict, 'val_loss': log_dict['val_loss'], 'progress_bar': log_dict}
        self.log_dict(log_dict)

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.net.parameters(), lr=self.learning_rate)
        sch = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
        return [opt], [sch]

    def train_dataloader(self):
        return DataLoader(self.trainset, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.validset, batch_size=self.batch_size, shuffle=False)


def build() -> SegModel:
    torch.manual_seed(0)
    model = SegModel(data_path="unused", batch_size=7, lr=0.001, num_layers=2, features_start=4, bilinear=False)
    return model.double()
