"""A zoo of real library models (transformers, timm, torchvision), tiny and randomly initialised, and how they train.

Every model is built in code from a config or a constructor with ``pretrained=False``/``weights=None``, so nothing is
downloaded. Each trains in float64 with dropout off, from the same seed every time, on deterministic data.
``tests/test_library_zoo.py`` trains each under ``mgpu_dp`` and some under ``mgpu_ddp`` (through
``tests/scripts/library_zoo_ddp.py``) and compares the parameters and buffers with one device's.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import lightning as L
import timm
import torch
import torchvision
import transformers
from models import trainer
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset, default_collate
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.models.detection.backbone_utils import BackboneWithFPN
from torchvision.ops import FrozenBatchNorm2d
from torchvision.ops.feature_pyramid_network import LastLevelP6P7

import lightning_mgpu
from lightning_mgpu import MGPUMixin, PerSample

DP_BATCHES = (5, 7, 4)
"""Rows of the 3 steps under mgpu_dp: 3 + 2, 4 + 3, 2 + 2 on two replicas; 2 + 2 + 1, 3 + 2 + 2, 2 + 1 + 1 on three."""

TWO_ROWS_FIRST = (2, 7, 5)
"""For ``[images, classes]`` batches without BatchNorm: the first batch is a list of 2 tensors of 2 rows each.

With no earlier batch, nothing but the split rule tells that list's two items are fields, not one item per row.
Models with BatchNorm in training mode keep ``DP_BATCHES``: normalising 2 rows at 1 x 1 pixel is so ill-conditioned
that float64 round-off grows past 1e-6 on one device alone (torch's batch norm and the same formula written out
already differ by that much).
"""

DDP_WORLD_SIZE = 2
DDP_BATCH = 3
"""Rows per rank and step under mgpu_ddp."""
DDP_ROWS = 15
"""Global steps of 6, 6 and 3 rows; the last is split 2 + 1 by ``uneven_batches=True``."""

LR = 0.01
IGNORE = -100
"""The label transformers' losses ignore."""
VOCABULARY = 32
TOKENS = 8
CLASSES = 3
IMAGE = 32
"""Side of the images for the timm and torchvision classifiers."""
PATCH_IMAGE = 8
"""Side of the images for transformers' ViT and CLIP (2 x 2 patches of 4 pixels)."""
DETECTION_IMAGE = 32
AUDIO = 400


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(0)


# Data --------------------------------------------------------------------------------------------------------------


class Rows(Dataset[dict[str, torch.Tensor]]):
    """Named tensors with one row per sample; the default collate makes each batch a dict of stacked rows."""

    def __init__(self, **tensors: torch.Tensor) -> None:
        self.tensors = tensors

    def __len__(self) -> int:
        return len(next(iter(self.tensors.values())))

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {name: tensor[index] for name, tensor in self.tensors.items()}


def _padded_tokens(rows: int, generator: torch.Generator, pad: int, steps: int = TOKENS) -> tuple[torch.Tensor, ...]:
    """Token ids (3 and up) of 2 to ``steps`` real tokens, right-padded with ``pad``, and the mask of the real ones.

    The first row is full, so every batch that holds it is as long as ``steps``.
    """
    ids = torch.randint(3, VOCABULARY, (rows, steps), generator=generator)
    lengths = torch.randint(2, steps + 1, (rows,), generator=generator)
    lengths[0] = steps
    mask = torch.arange(steps) < lengths[:, None]
    return ids.masked_fill(~mask, pad), mask.long()


def images(rows: int, side: int = IMAGE) -> TensorDataset:
    generator = _generator()
    x = torch.randn(rows, 3, side, side, generator=generator, dtype=torch.float64)
    return TensorDataset(x, torch.randint(0, CLASSES, (rows,), generator=generator))


def labelled_images(rows: int) -> Rows:
    x, y = images(rows, PATCH_IMAGE).tensors
    return Rows(pixel_values=x, labels=y)


def sentences(rows: int, pad: int = 0) -> Rows:
    """Padded token sequences with a class each."""
    generator = _generator()
    ids, mask = _padded_tokens(rows, generator, pad)
    return Rows(input_ids=ids, attention_mask=mask, labels=torch.randint(0, CLASSES, (rows,), generator=generator))


def tagged_tokens(rows: int, pad: int = 1) -> Rows:
    """Padded token sequences with a class per real token; padding is labelled ``IGNORE``."""
    generator = _generator()
    ids, mask = _padded_tokens(rows, generator, pad)
    tags = torch.randint(0, CLASSES, (rows, TOKENS), generator=generator).masked_fill(mask == 0, IGNORE)
    return Rows(input_ids=ids, attention_mask=mask, labels=tags)


def padded_text(rows: int) -> Rows:
    """Right-padded text whose labels are its tokens, ``IGNORE`` on the padding: a causal LM's batch."""
    generator = _generator()
    ids, mask = _padded_tokens(rows, generator, pad=0)
    return Rows(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, IGNORE))


def translations(rows: int, pad: int = 0, padded_labels: bool = True) -> Rows:
    """Padded sources and targets of 2 to 5 tokens (``IGNORE`` after them), or targets of 5 tokens each."""
    generator = _generator()
    ids, mask = _padded_tokens(rows, generator, pad)
    if padded_labels:
        targets, target_mask = _padded_tokens(rows, generator, pad, steps=5)
        labels = targets.masked_fill(target_mask == 0, IGNORE)
    else:
        labels = torch.randint(3, VOCABULARY, (rows, 5), generator=generator)
    return Rows(input_ids=ids, attention_mask=mask, labels=labels)


def whole_translations(rows: int) -> Rows:
    """Padded sources (``pad`` 1, BART's) and targets of 5 tokens each: a mean over tokens is one over rows."""
    return translations(rows, pad=1, padded_labels=False)


CLIP_EOS = VOCABULARY - 1


def captioned_images(rows: int) -> Rows:
    """Images and captions that end in ``CLIP_EOS`` followed by padding."""
    generator = _generator()
    ids, mask = _padded_tokens(rows, generator, pad=1)
    ids = ids.clamp(max=CLIP_EOS - 1)
    ids[torch.arange(rows), mask.sum(1) - 1] = CLIP_EOS
    pixels = torch.randn(rows, 3, PATCH_IMAGE, PATCH_IMAGE, generator=generator, dtype=torch.float64)
    return Rows(input_ids=ids, attention_mask=mask, pixel_values=pixels)


def sounds(rows: int) -> Rows:
    generator = _generator()
    audio = torch.randn(rows, AUDIO, generator=generator, dtype=torch.float64)
    return Rows(input_values=audio, labels=torch.randint(0, CLASSES, (rows,), generator=generator))


class Scenes(Dataset[tuple[torch.Tensor, dict[str, torch.Tensor]]]):
    """Images, each with 1 to 3 labelled boxes: a detection dataset."""

    def __init__(self, rows: int) -> None:
        generator = _generator()
        self.images = torch.rand(rows, 3, DETECTION_IMAGE, DETECTION_IMAGE, generator=generator, dtype=torch.float64)
        self.targets = []
        for _ in range(rows):
            count = int(torch.randint(1, 4, (), generator=generator))
            corner = torch.rand(count, 2, generator=generator, dtype=torch.float64) * 16
            size = 6 + torch.rand(count, 2, generator=generator, dtype=torch.float64) * 10
            labels = torch.randint(0, CLASSES, (count,), generator=generator)
            self.targets.append({"boxes": torch.cat([corner, corner + size], 1), "labels": labels})

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.images[index], self.targets[index]


def collate_scenes(samples: list[tuple[torch.Tensor, dict[str, torch.Tensor]]]) -> dict[str, Any]:
    """Stacked images and the per-image targets, which hold different numbers of boxes, as a ``PerSample``."""
    return {
        "images": torch.stack([image for image, _ in samples]),
        "targets": PerSample([target for _, target in samples]),
    }


# Models ------------------------------------------------------------------------------------------------------------


class LibraryModule(L.LightningModule):
    """A library model (``net``) built from seed 0 in float64, trained with SGD and momentum."""

    def __init__(self, build: Callable[[], nn.Module]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = build().double()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)


class ImageClassifier(LibraryModule):
    """An ``[images, classes]`` batch; the net returns logits; the loss is their cross-entropy, a mean over rows."""

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)


class RowMeanLoss(LibraryModule):
    """A transformers model given the batch dict with its labels; its loss is a mean over rows."""

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.net(**batch).loss


class TokenMeanLoss(LibraryModule):
    """A cross-entropy that is a mean over labelled tokens, returned with that count as its weight.

    Replicas hold different numbers of labelled tokens, so their losses are weighted by the count, not by rows. A
    causal LM predicts each token from the ones before it, so its first label is never scored. The loss is computed
    here, in the model's float64, because transformers computes its causal-LM and token-classification losses on
    logits cast to float32, which would leave the comparison float32-precise.
    """

    def __init__(self, build: Callable[[], nn.Module], causal: bool) -> None:
        super().__init__(build)
        self.causal = causal

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        inputs = {name: value for name, value in batch.items() if name != "labels" or not self.causal}
        logits, labels = self.net(**inputs).logits, batch["labels"]
        if self.causal:
            logits, labels = logits[:, :-1], labels[:, 1:]
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE)
        return {"loss": loss, "loss_weight": (labels != IGNORE).sum()}


class Detector(LibraryModule):
    """A torchvision detector: images and per-image targets in, a dict of losses (means over images) out."""

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        losses = self.net(list(batch["images"]), list(batch["targets"]))
        return sum(losses.values())


class Contrastive(MGPUMixin, LibraryModule):
    """CLIP's symmetric in-batch-negatives loss, computed on every row's embeddings in ``training_step_end``."""

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        output = self.net(**batch)
        return {"image": output.image_embeds, "text": output.text_embeds}

    def training_step_end(self, output: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = self.net.logit_scale.exp() * output["text"] @ output["image"].T
        pairs = torch.arange(len(logits), device=logits.device)
        return (F.cross_entropy(logits, pairs) + F.cross_entropy(logits.T, pairs)) / 2


def _timm(name: str, **options: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        return timm.create_model(name, pretrained=False, num_classes=CLASSES, drop_rate=0.0, **options)

    return build


def _convnext() -> nn.Module:
    return _timm("convnext_atto", depths=(1, 1, 1, 1), drop_path_rate=0.0)()


def _timm_vit() -> nn.Module:
    return _timm("vit_tiny_patch16_224", img_size=IMAGE, patch_size=8, depth=2)()


def _resnet18() -> nn.Module:
    return torchvision.models.resnet18(weights=None, num_classes=CLASSES)


def _retinanet() -> nn.Module:
    """RetinaNet on a weightless resnet18 (frozen BatchNorm and stem, as torchvision builds it) and a 32-channel FPN."""
    body = torchvision.models.resnet18(weights=None, norm_layer=FrozenBatchNorm2d)
    for frozen in (body.conv1, body.layer1):  # what torchvision's default trainable_backbone_layers=3 freezes
        frozen.requires_grad_(False)
    backbone = BackboneWithFPN(
        body,
        return_layers={"layer2": "0", "layer3": "1", "layer4": "2"},
        in_channels_list=[128, 256, 512],
        out_channels=32,
        extra_blocks=LastLevelP6P7(32, 32),
    )
    anchors = AnchorGenerator(
        sizes=tuple((size, round(size * 1.26), round(size * 1.59)) for size in (4, 8, 16, 32, 64)),
        aspect_ratios=((0.5, 1.0, 2.0),) * 5,
    )  # torchvision's default anchors (32 to 812 pixels), an eighth the size for 32-pixel images
    return torchvision.models.detection.RetinaNet(
        backbone, num_classes=CLASSES, min_size=DETECTION_IMAGE, max_size=DETECTION_IMAGE, anchor_generator=anchors
    )


_TEXT = {"vocab_size": VOCABULARY, "max_position_embeddings": 16}
_BERT_LIKE = {
    **_TEXT,
    "hidden_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 32,
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
}


def _bert() -> nn.Module:
    config = transformers.BertConfig(**_BERT_LIKE, num_labels=CLASSES, classifier_dropout=0.0)
    return transformers.BertForSequenceClassification(config)


def _roberta() -> nn.Module:
    config = transformers.RobertaConfig(**_BERT_LIKE, pad_token_id=1, num_labels=CLASSES, classifier_dropout=0.0)
    return transformers.RobertaForTokenClassification(config)


def _gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        vocab_size=VOCABULARY,
        n_positions=16,
        n_embd=16,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=VOCABULARY - 1,
        eos_token_id=VOCABULARY - 1,
    )
    return transformers.GPT2LMHeadModel(config)


def _llama() -> nn.Module:
    config = transformers.LlamaConfig(
        **_TEXT,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        attention_dropout=0.0,
        pad_token_id=0,
    )
    return transformers.LlamaForCausalLM(config)


def _t5() -> nn.Module:
    config = transformers.T5Config(
        vocab_size=VOCABULARY,
        d_model=16,
        d_kv=8,
        d_ff=32,
        num_layers=2,
        num_decoder_layers=1,
        num_heads=2,
        dropout_rate=0.0,
        pad_token_id=0,
        decoder_start_token_id=0,
    )
    return transformers.T5ForConditionalGeneration(config)


def _bart() -> nn.Module:
    config = transformers.BartConfig(
        **_TEXT,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
    )
    return transformers.BartForConditionalGeneration(config)


_VIT_LIKE = {
    "image_size": PATCH_IMAGE,
    "patch_size": 4,
    "num_channels": 3,
    "hidden_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 32,
}


def _vit() -> nn.Module:
    config = transformers.ViTConfig(
        **_VIT_LIKE, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=CLASSES
    )
    return transformers.ViTForImageClassification(config)


def _clip() -> nn.Module:
    text = {
        **_TEXT,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "pad_token_id": 1,
        "bos_token_id": 0,
        "eos_token_id": CLIP_EOS,
        "attention_dropout": 0.0,
    }
    vision = {**_VIT_LIKE, "num_hidden_layers": 1, "attention_dropout": 0.0}
    return transformers.CLIPModel(transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=8))


def _wav2vec2() -> nn.Module:
    config = transformers.Wav2Vec2Config(
        vocab_size=VOCABULARY,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        conv_dim=(8, 8),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=2,
        hidden_dropout=0.0,
        activation_dropout=0.0,
        attention_dropout=0.0,
        feat_proj_dropout=0.0,
        final_dropout=0.0,
        layerdrop=0.0,
        mask_time_prob=0.0,
        num_labels=CLASSES,
        classifier_proj_size=8,
    )
    return transformers.Wav2Vec2ForSequenceClassification(config)


# Entries -----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """One library model: how to build it and its data.

    Attributes:
        name: the pytest id.
        family: what kind of model it stands for.
        build: returns a fresh LightningModule, with the same initial weights every time.
        data: returns a dataset with the given number of rows, the same every time.
        collate: the DataLoader's ``collate_fn``; the default one when ``None``.
        batches: the rows of each step under ``mgpu_dp`` and on the one device it is compared with.
    """

    name: str
    family: str
    build: Callable[[], L.LightningModule]
    data: Callable[[int], Dataset[Any]]
    collate: Callable[[list[Any]], Any] | None = None
    batches: tuple[int, ...] = DP_BATCHES


def _entry(
    name: str,
    family: str,
    module: Callable[..., L.LightningModule],
    net: Callable[[], nn.Module],
    data: Callable[[int], Dataset[Any]],
    collate: Callable[[list[Any]], Any] | None = None,
    batches: tuple[int, ...] = DP_BATCHES,
    **options: Any,
) -> Entry:
    return Entry(name, family, lambda: module(net, **options), data, collate, batches)


BATCHNORM_ACT = "BatchNorm-activation (timm BatchNormAct2d)"
BATCHNORM = "BatchNorm (torchvision)"
DETECTION = "detection with per-image targets"
ENCODER_DECODER = "encoder-decoder"
CAUSAL_LM = "causal LM with padding, token-weighted loss"
CONTRASTIVE = "contrastive loss in training_step_end"
ENCODER = "encoder"

_ENTRIES = [
    _entry("timm-mobilenetv3-small-050", BATCHNORM_ACT, ImageClassifier, _timm("mobilenetv3_small_050"), images),
    _entry("timm-regnetx-002", BATCHNORM_ACT, ImageClassifier, _timm("regnetx_002"), images),
    _entry("timm-tinynet-e", BATCHNORM_ACT, ImageClassifier, _timm("tinynet_e"), images),
    _entry("torchvision-resnet18", BATCHNORM, ImageClassifier, _resnet18, images),
    _entry("torchvision-retinanet-resnet18-fpn", DETECTION, Detector, _retinanet, Scenes, collate_scenes),
    _entry("hf-t5", ENCODER_DECODER, TokenMeanLoss, _t5, translations, causal=False),
    _entry("hf-bart", ENCODER_DECODER, RowMeanLoss, _bart, whole_translations),
    _entry("hf-gpt2", CAUSAL_LM, TokenMeanLoss, _gpt2, padded_text, causal=True),
    _entry("hf-llama", CAUSAL_LM, TokenMeanLoss, _llama, padded_text, causal=True),
    _entry("hf-clip", CONTRASTIVE, Contrastive, _clip, captioned_images),
    _entry("hf-bert", ENCODER, RowMeanLoss, _bert, sentences),
    _entry("hf-roberta-token-classification", ENCODER, TokenMeanLoss, _roberta, tagged_tokens, causal=False),
    _entry("hf-vit", ENCODER, RowMeanLoss, _vit, labelled_images),
    _entry("hf-wav2vec2", ENCODER, RowMeanLoss, _wav2vec2, sounds),
    _entry("timm-convnext-atto", ENCODER, ImageClassifier, _convnext, images, batches=TWO_ROWS_FIRST),
    _entry("timm-vit-tiny", ENCODER, ImageClassifier, _timm_vit, images, batches=TWO_ROWS_FIRST),
]

ZOO: dict[str, Entry] = {entry.name: entry for entry in _ENTRIES}
"""Every entry, trained under ``mgpu_dp`` with 2 and 3 replicas."""

DDP_ZOO = ["hf-bert", "hf-vit", "hf-bart", "timm-convnext-atto", "torchvision-retinanet-resnet18-fpn"]
"""Trained one after another in one two-process ``mgpu_ddp`` job.

Each loss is a mean over rows, as ``uneven_batches=True`` asks (a loss weighted by tokens cannot be, so the padded
LMs are not among them), and none has BatchNorm in training mode (exact under DDP only with
``Trainer(sync_batchnorm=True)``, which tests/test_sync_batchnorm.py covers).
"""


# Harness -----------------------------------------------------------------------------------------------------------


def dp_loader(entry: Entry) -> DataLoader[Any]:
    """The entry's data in batches of ``entry.batches`` rows, in order."""
    starts = itertools.accumulate(entry.batches, initial=0)
    batches = [list(range(start, start + rows)) for start, rows in zip(starts, entry.batches, strict=False)]
    return DataLoader(
        entry.data(sum(entry.batches)), batch_sampler=batches, collate_fn=entry.collate or default_collate
    )


def ddp_loader(entry: Entry, batch_size: int) -> DataLoader[Any]:
    """``DDP_ROWS`` rows of the entry's data in order, ``batch_size`` rows per step (per rank under DDP)."""
    return DataLoader(
        entry.data(DDP_ROWS), batch_size=batch_size, shuffle=False, collate_fn=entry.collate or default_collate
    )


@dataclass
class Outcome:
    """What one training run ended with.

    Attributes:
        initial: every parameter and buffer before training, by state_dict key.
        state: the same after training.
        steps: the optimizer steps taken.
    """

    initial: dict[str, torch.Tensor]
    state: dict[str, torch.Tensor]
    steps: int


def snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, non-persistent buffers too."""
    state = {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}
    for name, buffer in module.named_buffers():
        state.setdefault(name, buffer.detach().clone())
    return state


def train(entry: Entry, loader: DataLoader[Any], **trainer_kwargs: Any) -> Outcome:
    """Train a fresh ``entry`` model for one epoch of ``loader`` (Lightning's single device unless told otherwise)."""
    model = entry.build()
    initial = snapshot(model)
    fitting = trainer(max_epochs=1, **trainer_kwargs)
    fitting.fit(model, loader)
    return Outcome(initial, snapshot(model), fitting.global_step)


def train_ddp(entry: Entry, timeout: float) -> Outcome:
    """``train`` in a rank of a two-process mgpu_ddp job (``scripts/zoo_ddp.py``) with ``uneven_batches=True``."""
    strategy = lightning_mgpu.MGPUDDPStrategy(uneven_batches=True, timeout=timedelta(seconds=timeout))
    return train(entry, ddp_loader(entry, DDP_BATCH), accelerator="cpu", devices=DDP_WORLD_SIZE, strategy=strategy)


def max_difference(got: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> float:
    """The largest absolute difference between same-named floating-point tensors (``inf`` if the names differ)."""
    if sorted(got) != sorted(expected):
        return float("inf")
    differences = [
        (got[name].double() - expected[name].double()).abs().max().item()
        for name in expected
        if expected[name].is_floating_point() and expected[name].numel()
    ]
    return max(differences, default=0.0)


def assert_same_state(got: Outcome, expected: Outcome, atol: float = 1e-6) -> None:
    """Same parameters and buffers, to ``atol``, and as many steps."""
    assert got.steps == expected.steps, f"{got.steps} optimizer steps, one device took {expected.steps}"
    assert sorted(got.state) == sorted(expected.state), "different parameter and buffer names"
    for name in expected.state:
        torch.testing.assert_close(
            got.state[name],
            expected.state[name],
            atol=atol,
            rtol=0,
            msg=lambda message, name=name: f"parameter or buffer {name}: {message}",
        )


def assert_trained(outcome: Outcome, name: str, steps: int) -> None:
    """The reference run took every step, moved the weights and stayed finite, so the comparison means something."""
    assert outcome.steps == steps, f"{name}: {outcome.steps} steps instead of {steps}"
    moved = [key for key, value in outcome.state.items() if not torch.equal(value, outcome.initial[key])]
    assert moved, f"{name}: training changed nothing"
    broken = [key for key, value in outcome.state.items() if value.is_floating_point() and not value.isfinite().all()]
    assert not broken, f"{name}: non-finite values after training in {broken[:5]}"


def families(entries: Sequence[Entry]) -> set[str]:
    return {entry.family for entry in entries}
