# ruff: noqa
"""AMDIM (Augmented Multiscale Deep InfoMax) from PyTorch Lightning Bolts: a contrastive loss in ``training_step_end``.

Source:    https://github.com/Lightning-Universe/lightning-bolts (formerly PyTorchLightning/lightning-bolts)
Files:     src/pl_bolts/models/self_supervised/amdim/amdim_module.py (class AMDIM)
           src/pl_bolts/losses/self_supervised_learning.py (FeatureMapContrastiveTask, AmdimNCELoss, tanh_clip)
Commit:    c6f6d3b589340e10d073df7bb3f6c35f94969bb7 (2023-07-12; bolts then required pytorch-lightning >1.7.0, <2.0.0)
Licence:   Apache-2.0, "Copyright 2018-2021 William Falcon" (LICENSE)

What the model does: ``training_step`` only runs the encoder on both augmented views and returns six feature maps;
``training_step_end`` computes the AMDIM NCE loss on the maps gathered from every GPU, so each anchor is contrasted
with every other image of the whole batch (under Lightning 1.x ``dp`` that is why the loss lives there).
``validation_step`` computed the same loss inside the step, on what the step sees (see below). ``contrastive_task`` defaults to
one ``FeatureMapContrastiveTask`` made when the class is defined, shared by every AMDIM; its ``masks`` cache (a plain
dict of tensors) is filled by the first model trained, after which ``mgpu_dp`` warns about it.

Changes to shrink it (method bodies of training_step, training_step_end, validation_step, configure_optimizers, the
loss and the dataloaders are as written):
- ``@under_review()`` decorators and the argparse helpers (``add_model_specific_args``, ``cli_main``) dropped;
  ``generate_power_seq`` and the dataset constants dropped (only used by the argparse helpers).
- ``AMDIMEncoder`` / ``torchvision_ssl_encoder`` replaced by ``TinyAMDIMEncoder`` below: three convolutions that
  return the same three maps (b, c, 1, 1), (b, c, 5, 5), (b, c, 7, 7) as the original; ``init_encoder`` builds it.
- ``AMDIMPretraining`` (CIFAR-10/STL-10/ImageNet with AMDIM augmentations) replaced by a stand-in with the same
  ``get_dataset(datamodule, data_dir, split)`` signature that returns seeded random image pairs in float64.
- Lightning 2.0 migration (docs/migrating.md): ``validation_epoch_end(outputs)`` was removed, so the step outputs are
  collected in ``on_validation_batch_end`` and the body runs in ``on_validation_epoch_end``; the dict it returned
  (``{"val_loss": ..., "log": {"val_nce": ...}}``, the 0.x logging API) becomes ``self.log`` calls.
- The ``"log"`` key that ``training_step_end`` returns is the 0.x logging API: Lightning 1.7-1.9 ignored it, as 2.x
  does, so it stays as written and logs nothing.
- ``validation_step`` computed the NCE loss, whose negatives are the other images of the batch, inside the step, where
  each GPU saw its own chunk under Lightning 1.x ``dp``; as docs/migrating.md says for work over the whole batch, the
  loss (its lines as written) moves into ``validation_step_end``, on the maps gathered from every replica, as
  ``training_step`` and ``training_step_end`` already split it.
"""
import os
from typing import Union

import numpy as np
import torch
from pytorch_lightning import LightningDataModule, LightningModule
from torch import nn, optim
from torch.utils.data import DataLoader, Dataset


# ---------------------------------------------------------------- src/pl_bolts/losses/self_supervised_learning.py
class AmdimNCELoss(nn.Module):
    """Compute the NCE scores for predicting r_src->r_trg."""

    def __init__(self, tclip) -> None:
        super().__init__()
        self.tclip = tclip

    def forward(self, anchor_representations, positive_representations, mask_mat):
        """
        Args:
            anchor_representations: (batch_size, emb_dim)
            positive_representations: (emb_dim, n_batch * w* h) (ie: num_feat_vectors x embedding_dim)
            mask_mat: (n_batch_gpu, n_batch)

        Output:
            raw_scores: (n_batch_gpu, n_locs)
            nce_scores: (n_batch_gpu, n_locs)
            lgt_reg : scalar
        """
        r_src = anchor_representations
        r_trg = positive_representations

        # RKHS = embedding dim
        batch_size, emb_dim = r_src.size()
        num_feat_vectors = r_trg.size(1) // batch_size

        # (b, b) -> (b, b, num_feat_vectors)
        # all zeros with ones in diagonal tensor... (ie: b1 b1 are all 1s, b1 b2 are all zeros)
        mask_pos = mask_mat.unsqueeze(dim=2).expand(-1, -1, num_feat_vectors).float()

        # negative mask
        mask_neg = 1.0 - mask_pos

        # -------------------------------
        # ALL SCORES COMPUTATION
        # compute src->trg raw scores for batch
        # (b, dim) x (dim, num_feats*b) -> (b, b, num_feats)
        # vector for each img in batch times all the vectors of all images in batch
        raw_scores = torch.mm(r_src, r_trg).float()
        raw_scores = raw_scores.reshape(batch_size, batch_size, num_feat_vectors)

        # -----------------------
        # STABILITY TRICKS
        # trick 1: weighted regularization term
        raw_scores = raw_scores / emb_dim**0.5
        lgt_reg = 5e-2 * (raw_scores**2.0).mean()

        # trick 2: tanh clip
        raw_scores = tanh_clip(raw_scores, clip_val=self.tclip)
        """pos_scores includes scores for all the positive samples neg_scores includes scores for all the negative
        samples, with scores for positive samples set to the min score (-self.tclip here)"""
        # ----------------------
        # EXTRACT POSITIVE SCORES
        # use the index mask to pull all the diagonals which are b1 x b1
        # (batch_size, num_feat_vectors)
        pos_scores = (mask_pos * raw_scores).sum(dim=1)

        # ----------------------
        # EXTRACT NEGATIVE SCORES
        # pull everything except diagonal and apply clipping
        # (batch_size, batch_size, num_feat_vectors)
        # diagonals have - clip vals. everything else has actual negative stores
        neg_scores = (mask_neg * raw_scores) - (self.tclip * mask_pos)

        # (batch_size, batch_size * num_feat_vectors) -> (batch_size, batch_size, num_feat_vectors)
        neg_scores = neg_scores.reshape(batch_size, -1)
        mask_neg = mask_neg.reshape(batch_size, -1)

        # ---------------------
        # STABLE SOFTMAX
        # max for each row of negative samples
        # will use max in safe softmax
        # (n_batch_gpu, 1)
        neg_maxes = torch.max(neg_scores, dim=1, keepdim=True)[0]

        # DENOMINATOR
        # sum over only negative samples (none from the diagonal)
        neg_sumexp = (mask_neg * torch.exp(neg_scores - neg_maxes)).sum(dim=1, keepdim=True)
        all_logsumexp = torch.log(torch.exp(pos_scores - neg_maxes) + neg_sumexp)

        # NUMERATOR
        # compute numerators for the NCE log-softmaxes
        pos_shiftexp = pos_scores - neg_maxes

        # FULL NCE
        nce_scores = pos_shiftexp - all_logsumexp
        nce_scores = -nce_scores.mean()

        return nce_scores, lgt_reg


class FeatureMapContrastiveTask(nn.Module):
    """Performs an anchor, positive negative pair comparison for each each tuple of feature maps passed.

    .. code-block:: python

        # extract feature maps
        pos_0, pos_1, pos_2 = encoder(x_pos)
        anc_0, anc_1, anc_2 = encoder(x_anchor)

        # compare only the 0th feature maps
        task = FeatureMapContrastiveTask('00')
        loss, regularizer = task((pos_0), (anc_0))

        # compare (pos_0 to anc_1) and (pos_0, anc_2)
        task = FeatureMapContrastiveTask('01, 02')
        losses, regularizer = task((pos_0, pos_1, pos_2), (anc_0, anc_1, anc_2))
        loss = losses.sum()

        # compare (pos_1 vs a anc_random)
        task = FeatureMapContrastiveTask('0r')
        loss, regularizer = task((pos_0, pos_1, pos_2), (anc_0, anc_1, anc_2))

    .. code-block:: python

        # with bidirectional the comparisons are done both ways
        task = FeatureMapContrastiveTask('01, 02')

        # will compare the following:
        # 01: (pos_0, anc_1), (anc_0, pos_1)
        # 02: (pos_0, anc_2), (anc_0, pos_2)

    """

    def __init__(self, comparisons: str = "00, 11", tclip: float = 10.0, bidirectional: bool = True) -> None:
        """
        Args:
            comparisons: groupings of feature map indices to compare (zero indexed, 'r' means random) ex: '00, 1r'
            tclip: stability clipping value
            bidirectional: if true, does the comparison both ways
        """
        super().__init__()
        self.tclip = tclip
        self.bidirectional = bidirectional
        self.map_indexes = self.parse_map_indexes(comparisons)
        self.comparisons = comparisons
        self.masks = {}
        self.nce_loss = AmdimNCELoss(tclip)

    @staticmethod
    def parse_map_indexes(comparisons):
        """
        Example::

            >>> FeatureMapContrastiveTask.parse_map_indexes('11')
            [(1, 1)]
            >>> FeatureMapContrastiveTask.parse_map_indexes('11,59')
            [(1, 1), (5, 9)]
            >>> FeatureMapContrastiveTask.parse_map_indexes('11,59, 2r')
            [(1, 1), (5, 9), (2, -1)]
        """
        map_indexes = [x.strip() for x in comparisons.split(",")]
        for tup_i in range(len(map_indexes)):
            (a, b) = map_indexes[tup_i]
            if a == "r":
                a = "-1"
            if b == "r":
                b = "-1"
            map_indexes[tup_i] = (int(a), int(b))

        return map_indexes

    def feat_size_w_mask(self, w, feature_map):
        masks_r5 = torch.zeros((w, w, 1, w, w), device=feature_map.device).type(torch.bool)
        for i in range(w):
            for j in range(w):
                masks_r5[i, j, 0, i, j] = 1
        return masks_r5.reshape(-1, 1, w, w)

    def _sample_src_ftr(self, r_cnv, masks):
        # get feature dimensions
        n_batch = r_cnv.size(0)
        feat_dim = r_cnv.size(1)

        if masks is not None:
            # subsample from conv-ish r_cnv to get a single vector
            mask_idx = torch.randint(0, masks.size(0), (n_batch,), device=r_cnv.device)
            mask = masks[mask_idx]
            r_cnv = torch.masked_select(r_cnv, mask)

        # flatten features for use as globals in glb->lcl nce cost
        return r_cnv.reshape(n_batch, feat_dim)

    def __cache_dimension_masks(self, *args):
        # cache masks for each feature map we'll need
        if len(self.masks) == 0:
            for m1 in args:
                batch_size, emb_dim, h, w = m1.size()

                # make mask
                if h not in self.masks:
                    mask = self.feat_size_w_mask(h, m1)
                    self.masks[h] = mask

    def __compare_maps(self, m1, m2):
        b, c, h, w = m1.size()

        mask_1 = self.masks[h]
        src = self._sample_src_ftr(m1, mask_1)

        # target vectors
        # (b, c, h, w) -> (c, b * h * w)
        tgt = m2.permute(1, 0, 2, 3).reshape(c, -1)

        # make masking matrix to help compute nce costs
        # (b x b) zero matrix with 1s in the diag
        diag_mat = torch.eye(b, device=m1.device)

        # compare
        loss, regularizer = self.nce_loss(src, tgt, diag_mat)

        return loss, regularizer

    def forward(self, anchor_maps, positive_maps):
        """Takes in a set of tuples, each tuple has two feature maps with all matching dimensions."""
        assert len(anchor_maps) == len(self.map_indexes), f"expected each input to have {len(self.map_indexes)} tensors"

        self.__cache_dimension_masks(*(anchor_maps + positive_maps))

        regularizer = 0
        losses = []
        for ai, pi in self.map_indexes:
            # choose a random map
            if ai == -1:
                ai = np.random.randint(0, len(anchor_maps))
            if pi == -1:
                pi = np.random.randint(0, len(anchor_maps))

            # pull out the maps
            anchor = anchor_maps[ai]
            pos = positive_maps[pi]

            # m1 vs m2
            loss1, reg1 = self.__compare_maps(anchor, pos)
            map_reg = reg1
            map_loss = loss1

            # add second direction if requested
            if self.bidirectional:
                # swap maps
                anchor = positive_maps[ai]
                pos = anchor_maps[pi]

                loss2, reg2 = self.__compare_maps(anchor, pos)
                map_reg = 0.5 * (reg1 + reg2)
                map_loss = 0.5 * (loss1 + loss2)

            regularizer += map_reg
            losses.append(map_loss.mean())

        return torch.stack(losses), regularizer


def tanh_clip(x, clip_val=10.0):
    """Soft clip values to the range [-clip_val, +clip_val]"""
    return clip_val * torch.tanh(1.0 / clip_val * x) if clip_val is not None else x


# ------------------------------------------------------------------------------- stand-ins for the encoder and data
class TinyAMDIMEncoder(nn.Module):
    """Stand-in for AMDIMEncoder: the same three feature maps, r1 (b, c, 1, 1), r5 (b, c, 5, 5), r7 (b, c, 7, 7)."""

    def __init__(self, num_channels: int = 3, embedding_fx_dim: int = 8) -> None:
        super().__init__()
        self.conv7 = nn.Conv2d(num_channels, embedding_fx_dim, kernel_size=3, stride=2)  # 16x16 -> 7x7
        self.conv5 = nn.Conv2d(embedding_fx_dim, embedding_fx_dim, kernel_size=3)  # 7x7 -> 5x5
        self.conv1 = nn.Conv2d(embedding_fx_dim, embedding_fx_dim, kernel_size=5)  # 5x5 -> 1x1

    def forward(self, x):
        r7 = self.conv7(x)
        r5 = self.conv5(torch.relu(r7))
        r1 = self.conv1(torch.relu(r5))
        return r1, r5, r7


class _RandomPairs(Dataset):
    """Two 'augmented views' of each image, and a label, drawn from a seeded generator in float64."""

    def __init__(self, size: int, image_height: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.img_1 = torch.randn(size, 3, image_height, image_height, generator=generator, dtype=torch.float64)
        self.img_2 = self.img_1 + 0.3 * torch.randn(self.img_1.shape, generator=generator, dtype=torch.float64)
        self.labels = torch.randint(0, 10, (size,), generator=generator)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index):
        return (self.img_1[index], self.img_2[index]), self.labels[index]


class AMDIMPretraining:
    """Stand-in for pl_bolts' AMDIMPretraining: same ``get_dataset`` signature, seeded random pairs."""

    sizes = {"train": 21, "val": 14}

    @staticmethod
    def get_dataset(datamodule: str, data_dir, split: str = "train", **kwargs):
        return _RandomPairs(AMDIMPretraining.sizes[split], image_height=16, seed={"train": 0, "val": 1}[split])


# ------------------------------------------------------------ src/pl_bolts/models/self_supervised/amdim/amdim_module.py
class AMDIM(LightningModule):
    """PyTorch Lightning implementation of Augmented Multiscale Deep InfoMax (AMDIM_)

    Paper authors: Philip Bachman, R Devon Hjelm, William Buchwalter.

    Model implemented by: `William Falcon <https://github.com/williamFalcon>`_

    This code is adapted to Lightning using the original author repo
    (`the original repo <https://github.com/Philip-Bachman/amdim-public>`_).

    .. _AMDIM: https://arxiv.org/abs/1906.00910

    """

    def __init__(
        self,
        datamodule: Union[str, LightningDataModule] = "cifar10",
        encoder: Union[str, torch.nn.Module, LightningModule] = "amdim_encoder",
        contrastive_task: Union[FeatureMapContrastiveTask] = FeatureMapContrastiveTask("01, 02, 11"),
        image_channels: int = 3,
        image_height: int = 32,
        encoder_feature_dim: int = 320,
        embedding_fx_dim: int = 1280,
        conv_block_depth: int = 10,
        use_bn: bool = False,
        tclip: int = 20.0,
        learning_rate: int = 2e-4,
        data_dir: str = "",
        num_classes: int = 10,
        batch_size: int = 200,
        num_workers: int = 16,
        **kwargs,
    ) -> None:
        """
        Args:
            datamodule: A LightningDatamodule
            encoder: an encoder string or model
            image_channels: 3
            image_height: pixels
            encoder_feature_dim: Called `ndf` in the paper, this is the representation size for the encoder.
            embedding_fx_dim: Output dim of the embedding function (`nrkhs` in the paper)
                (Reproducing Kernel Hilbert Spaces).
            conv_block_depth: Depth of each encoder block,
            use_bn: If true will use batchnorm.
            tclip: soft clipping non-linearity to the scores after computing the regularization term
                and before computing the log-softmax. This is the 'second trick' used in the paper
            learning_rate: The learning rate
            data_dir: Where to store data
            num_classes: How many classes in the dataset
            batch_size: The batch size
        """
        super().__init__()
        self.save_hyperparameters()

        # init encoder
        self.encoder = encoder
        if isinstance(encoder, str):
            self.encoder = self.init_encoder()

        # the task
        self.contrastive_task = contrastive_task

        self.tng_split = None
        self.val_split = None
        self.validation_outputs = []  # Lightning 2.0: validation_epoch_end(outputs) was removed

    def init_encoder(self):
        # stand-in: the original builds AMDIMEncoder(dummy_batch, ...) or a torchvision ResNet here
        return TinyAMDIMEncoder(num_channels=self.hparams.image_channels, embedding_fx_dim=self.hparams.embedding_fx_dim)

    def forward(self, img_1, img_2):
        # feats for img 1
        # r1 = last layer out
        # r5 = last layer with (b, c, 5, 5) size
        # r7 = last layer with (b, c, 7, 7) size
        maps = self.encoder(img_1)
        if len(maps) > 3:
            maps = maps[-3:]
        r1_x1, r5_x1, r7_x1 = maps

        # feats for img 2
        maps = self.encoder(img_2)
        if len(maps) > 3:
            maps = maps[-3:]
        r1_x2, r5_x2, r7_x2 = maps

        # first number = resnet block. second = image 1 or 2
        return r1_x1, r5_x1, r7_x1, r1_x2, r5_x2, r7_x2

    def training_step(self, batch, batch_nb):
        [img_1, img_2], _ = batch

        # ------------------
        # FEATURE EXTRACTION
        # extract features from various blocks for each image
        # _x1 are from image 1
        # _x2 from image 2
        r1_x1, r5_x1, r7_x1, r1_x2, r5_x2, r7_x2 = self.forward(img_1, img_2)

        return {
            "r1_x1": r1_x1,
            "r5_x1": r5_x1,
            "r7_x1": r7_x1,
            "r1_x2": r1_x2,
            "r5_x2": r5_x2,
            "r7_x2": r7_x2,
        }

    def training_step_end(self, outputs):
        r1_x1 = outputs["r1_x1"]
        r5_x1 = outputs["r5_x1"]
        r7_x1 = outputs["r7_x1"]
        r1_x2 = outputs["r1_x2"]
        r5_x2 = outputs["r5_x2"]
        r7_x2 = outputs["r7_x2"]

        # Contrastive task
        loss, lgt_reg = self.contrastive_task((r1_x1, r5_x1, r7_x1), (r1_x2, r5_x2, r7_x2))
        unsupervised_loss = loss.sum() + lgt_reg

        # ------------------
        # FULL LOSS
        total_loss = unsupervised_loss

        tensorboard_logs = {"train_nce_loss": total_loss}
        return {"loss": total_loss, "log": tensorboard_logs}

    def validation_step(self, batch, batch_nb):
        [img_1, img_2], labels = batch

        # generate features
        r1_x1, r5_x1, r7_x1, r1_x2, r5_x2, r7_x2 = self.forward(img_1, img_2)

        return {"r1_x1": r1_x1, "r5_x1": r5_x1, "r7_x1": r7_x1, "r1_x2": r1_x2, "r5_x2": r5_x2, "r7_x2": r7_x2}

    def validation_step_end(self, outputs):  # the loss over the whole batch, moved here (docs/migrating.md)
        r1_x1, r5_x1, r7_x1 = outputs["r1_x1"], outputs["r5_x1"], outputs["r7_x1"]
        r1_x2, r5_x2, r7_x2 = outputs["r1_x2"], outputs["r5_x2"], outputs["r7_x2"]

        # Contrastive task
        loss, lgt_reg = self.contrastive_task((r1_x1, r5_x1, r7_x1), (r1_x2, r5_x2, r7_x2))
        unsupervised_loss = loss.sum() + lgt_reg

        return {"val_nce": unsupervised_loss}

    def on_validation_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0):
        self.validation_outputs.append(outputs)

    def on_validation_epoch_end(self):  # was validation_epoch_end(self, outputs)
        outputs, self.validation_outputs = self.validation_outputs, []
        val_nce = 0
        for output in outputs:
            val_nce += output["val_nce"]

        val_nce = val_nce / len(outputs)
        # was: return {"val_loss": val_nce, "log": {"val_nce": val_nce}}
        self.log("val_nce", val_nce)
        self.log("val_loss", val_nce)

    def configure_optimizers(self):
        # if self.hparams.datamodule in ['cifar10', 'stl10', 'cifar100']:
        #     lr_scheduler = MultiStepLR(opt, milestones=[250, 280], gamma=0.2)
        # else:
        #     lr_scheduler = MultiStepLR(opt, milestones=[30, 45], gamma=0.2)
        return optim.Adam(
            params=self.parameters(), lr=self.hparams.learning_rate, betas=(0.8, 0.999), weight_decay=1e-5, eps=1e-7
        )

    def train_dataloader(self):
        kwargs = {"num_classes": self.hparams.num_classes} if self.hparams.datamodule == "imagenet2012" else {}
        dataset = AMDIMPretraining.get_dataset(self.hparams.datamodule, self.hparams.data_dir, split="train", **kwargs)

        # LOADER
        return DataLoader(
            dataset=dataset,
            batch_size=self.hparams.batch_size,
            pin_memory=True,
            drop_last=True,
            num_workers=self.hparams.num_workers,
        )

    def val_dataloader(self):
        kwargs = {"num_classes": self.hparams.num_classes} if self.hparams.datamodule == "imagenet2012" else {}
        dataset = AMDIMPretraining.get_dataset(self.hparams.datamodule, self.hparams.data_dir, split="val", **kwargs)

        # LOADER
        return DataLoader(
            dataset=dataset,
            batch_size=self.hparams.batch_size,
            pin_memory=True,
            drop_last=True,
            num_workers=self.hparams.num_workers,
        )


def build() -> AMDIM:
    """The model as the tests train it: CIFAR-10 settings shrunk (16x16 images, 8 channels), in float64, no workers."""
    torch.manual_seed(0)
    model = AMDIM(image_height=16, embedding_fx_dim=8, batch_size=7, num_workers=0)
    return model.double()
