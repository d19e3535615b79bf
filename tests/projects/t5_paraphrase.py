# ruff: noqa
"""T5 paraphrasing from ceshine/finetuning-t5: ``training_step_end``/``validation_step_end`` for ``dp``, an NLP model.

Source:    https://github.com/ceshine/finetuning-t5
Files:     t2t/__init__.py (T5BaseModel, the losses, collate_batch, SortishSampler, BaseConfig)
           paraphrase/train_t2t.py (T5Model, ParaphraseDataset, Config, Corpus)
Commit:    bb68f3f7d69b36c4235b7ed630ecb736ad641a98 (2022-02-06; t2t/__init__.py last changed in 7671c3b,
           2021-01-27, when Lightning was at 1.1). Both train scripts (paraphrase/train_t2t.py, mnli/train.py) build
           ``pl.Trainer(accelerator='dp' if num_gpus > 1 else None, ...)``.
Licence:   Apache-2.0 (LICENSE; its copyright line is the template's unfilled "Copyright [yyyy] [name of copyright
           owner]"; the author is Ceshine Lee)

What the model does: fine-tunes T5 as a sequence-to-sequence paraphraser. ``training_step`` returns the replica's
masked token cross-entropy and a Python bool saying whether to log; ``training_step_end`` averages the replicas'
losses, keeps an exponential moving average of it and writes it straight to the logger
(``self.logger.log_metrics``) every ``log_every_n_steps``; ``validation_step_end`` logs the mean of the replicas'
losses and updates a token accuracy (``pl.metrics.Accuracy``, kept in a plain list ``self.metrics``) on the gathered
predictions moved to the CPU. RAdam with a warm-up then cosine ``MultiStageScheduler`` stepped every batch.
``_should_log`` expects the bool to arrive as a list (``if isinstance(flag, list): return flag[0]``): Lightning 1.1's
``LightningDataParallel.gather`` returned the replicas' Python values as a list; from 1.2 on, Lightning's dp (and
``mgpu_dp``) turn them into a tensor with one value per replica, and ``if tensor([True, True])`` raises.

Changes to shrink it (the steps, both ``*_step_end`` hooks, the loss and ``configure_optimizers`` are as written):
- ``T5ForConditionalGeneration.from_pretrained("t5-base")`` becomes ``T5ForConditionalGeneration(T5Config(...))``,
  a one-layer, 16-wide T5 with random weights and no dropout (dropout masks cannot be drawn alike by one device and by
  several replicas); the tokenizer cannot be downloaded: ``self.tokenizer`` is ``None`` and the context tokens of
  ``tokenizer.encode("paraphrase: ")`` are three fixed ids.
- ``ParaphraseDataset`` keeps ``__len__``/``__getitem__`` (each pair used both ways); its constructor draws seeded
  token ids instead of reading the joblib files, every sentence 5 tokens long (see tests/test_projects.py for why).
- ``pl.metrics.Accuracy(compute_on_step=False)``: ``pl.metrics`` moved to torchmetrics (deprecated in Lightning 1.3,
  removed in 1.5) and torchmetrics later dropped ``compute_on_step``; it becomes ``torchmetrics.Accuracy(task="multiclass",
  num_classes=<vocabulary size>)``. Lightning 2.x logs a ``Metric`` object only if it is an attribute of the module
  (``self.log`` raises "Could not find the `LightningModule` attribute for the `torchmetrics.Metric` logged"), and
  the original keeps it only in the list ``self.metrics``: the metric is also assigned to ``self.acc_metric``, so the
  list now indexes a registered module, as code that works with Lightning 2.x has to.
- ``pytorch_lightning_spells`` is not installed: ``tests/projects/_spells.py`` holds the copied ``EMATracker``,
  ``RAdam``, ``LinearLR`` and ``MultiStageScheduler`` as ``pls``.
- DataLoaders: ``num_workers=4`` becomes ``0`` (no worker processes in the tests).
- ``build()`` stands for ``main``'s settings: batches of 6 pairs, learning rate 1e-3 (``main``: 1e-4), and 10 planned
  epochs for the schedule, so that its linear warm-up lasts 2 steps (``LinearLR`` divides by its length minus one:
  with ``main``'s 5 epochs over this small data set the warm-up would last 1 step and divide by zero).
- ``get_progress_bar_dict`` is kept although Lightning 2.x never calls it (it was removed in 1.7).
- ``_should_log`` reads the first replica's value of a tensor as it read a list's, as docs/migrating.md says for
  Python booleans a step returns.
- ``SortSampler``, ``optimize_sequence``'s comment, ``single_token_cross_entropy_loss`` (MNLI) are kept; the MNLI
  ``T5Model`` (mnli/train.py) is not ported: it carries a copy of an old transformers ``Adafactor`` that calls
  ``Tensor.add_(Number, Tensor)``, a signature torch removed.
"""
import enum
import math
from functools import partial
from dataclasses import dataclass, asdict
from typing import Callable, List, Union

import torch
import torch.nn.functional as F
import torchmetrics
from torch.utils.data.sampler import Sampler
import numpy as np
import pytorch_lightning as pl
from torch.utils.data import DataLoader, Dataset
from torch.optim.lr_scheduler import CosineAnnealingLR
from transformers import T5Config, T5ForConditionalGeneration

from . import _spells as pls


# ---------------------------------------------------------------------------------------------------- t2t/__init__.py
def masked_cross_entropy_loss(outputs, targets):
    # print(targets["ids"].shape, outputs.shape)
    targets, mask = targets["ids"], targets["mask"]
    loss = torch.sum(
        mask.view(-1) * F.cross_entropy(
            outputs.view(-1, outputs.size(2)),
            targets.view(-1),
            reduction="none"
        )
    ) / mask.sum()
    return loss


def single_token_cross_entropy_loss(outputs, targets):
    target_ids = targets["ids"]
    # print(outputs[:, :, 333])
    loss = F.cross_entropy(
        outputs.view(-1, outputs.size(2)),
        target_ids.view(-1)
    )
    return loss


def optimize_sequence(ids, pad, max_len):
    # Pad to the minimum multiple of 8 to utilize tensor cores
    batch_max_len = np.max([x.size(0) for x in ids])
    if batch_max_len > 8:
        max_length = math.ceil(
            min(max_len, batch_max_len) / 8.
        ) * 8
    else:
        max_length = batch_max_len
    padded_ids = ids[0].new_zeros((len(ids), max_length)) + pad
    mask = ids[0].new_zeros((len(ids), max_length))
    for i, example in enumerate(ids):
        example = example[:max_len]
        padded_ids[i, :len(example)] = example
        mask[i, :len(example)] = 1
    return padded_ids, mask


def collate_batch(batch, max_len, pad=0, decode_start_token=0, is_classifier=False):
    """Batch preparation.

    Truncate the sequence to reduce wastes.
    """
    source_ids, target_ids = zip(*batch)
    source_ids, src_mask = optimize_sequence(source_ids, pad, max_len)
    if not is_classifier:
        target_ids, target_mask = optimize_sequence(target_ids, pad, max_len)
        shifted_target_ids = target_ids.new_zeros(target_ids.shape)
        shifted_target_ids[..., 1:] = target_ids[..., :-1].clone()
        shifted_target_ids[..., 0] = decode_start_token
        return (
            {
                "input_ids": source_ids, "attention_mask": src_mask,
                "decoder_input_ids": shifted_target_ids
            },
            {"ids": target_ids, "mask": target_mask}
        )
    # is classifier
    target_ids = torch.stack(target_ids)
    shifted_target_ids = target_ids.new_zeros(target_ids.shape[0], 1) + decode_start_token
    return (
        {
            "input_ids": source_ids, "attention_mask": src_mask,
            "decoder_input_ids": shifted_target_ids
        },
        {"ids": target_ids}
    )


class SortSampler(Sampler):
    def __init__(self, data_source, key):
        self.data_source, self.key = data_source, key

    def __len__(self):
        return len(self.data_source)

    def __iter__(self):
        return iter(sorted(range(len(self.data_source)), key=self.key, reverse=True))


class SortishSampler(Sampler):
    """Returns an iterator that traverses the the data in randomly ordered batches that are approximately the same size.
    The max key size batch is always returned in the first call because of pytorch cuda memory allocation sequencing.
    Without that max key returned first multiple buffers may be allocated when the first created isn't large enough
    to hold the next in the sequence.

    Taken from fastai library.
    """

    def __init__(self, data_source, key, bs, chunk_size=50):
        self.data_source, self.key, self.bs = data_source, key, bs
        self.chunk_size = 50

    def __len__(self): return len(self.data_source)

    def __iter__(self):
        while True:
            idxs = np.random.permutation(len(self.data_source))
            sz = self.bs * self.chunk_size
            ck_idx = [idxs[i:i+sz] for i in range(0, len(idxs), sz)]
            sort_idx = np.concatenate(
                [sorted(s, key=self.key, reverse=True) for s in ck_idx])
            sz = self.bs
            ck_idx = [sort_idx[i:i+sz]for i in range(0, len(sort_idx), sz)]
            # find the chunk with the largest key,
            max_ck = np.argmax([self.key(ck[0]) for ck in ck_idx])
            # then make sure it goes first.
            if len(ck_idx[max_ck]) != self.bs:
                continue
            ck_idx[0], ck_idx[max_ck] = ck_idx[max_ck], ck_idx[0]
            sort_idx = np.concatenate(np.random.permutation([
                np.random.permutation(chunk.reshape(self.bs, -1)).reshape(-1)
                for chunk in ck_idx[1:-1]
            ]))
            sort_idx = np.concatenate((ck_idx[0], sort_idx, ck_idx[-1]))
            break
        return iter(sort_idx)


@dataclass
class BaseConfig:
    base_t5_model: str
    batch_size: int
    fp16: bool
    learning_rate: float
    weight_decay: float
    epochs: int
    max_len: int
    loss_fn: Callable
    num_gpus: int = 1
    grad_accu: int = 1
    tpu_cores: int = 0


class T5BaseModel(pl.LightningModule):
    def __init__(
            self, config: BaseConfig, model: T5ForConditionalGeneration,
            tokenizer, is_classifier: bool = False, **kwargs):
        super().__init__()
        self.config = config
        # placeholder for pylint
        self.train_dataset: Dataset = Dataset()
        self.valid_dataset: Dataset = Dataset()
        # the actual stuffs
        self.model = model
        self.tokenizer = tokenizer
        self.collate_fn = partial(
            collate_batch, pad=self.model.config.decoder_start_token_id,
            decode_start_token=self.model.config.pad_token_id,
            max_len=self.config.max_len, is_classifier=is_classifier
        )
        # was: self.metrics = [("acc", pl.metrics.Accuracy(compute_on_step=False))]
        self.acc_metric = torchmetrics.Accuracy(task="multiclass", num_classes=self.model.config.vocab_size)
        self.metrics = [
            ("acc", self.acc_metric)
        ]
        self.train_loss_tracker = pls.utils.EMATracker(alpha=0.02)

    def forward(self, input_tensors):
        return self.model(**input_tensors)[0]

    def train_dataloader(self):
        if self.config.tpu_cores:
            sampler = None
        else:
            sampler = SortishSampler(
                self.train_dataset,
                key=lambda x: len(self.train_dataset[x][0]),
                bs=self.config.batch_size
            )
        return DataLoader(
            self.train_dataset, num_workers=0, shuffle=False, drop_last=True,  # was num_workers=4 (or 1 on TPUs)
            batch_size=self.config.batch_size, collate_fn=self.collate_fn, sampler=sampler)

    def get_progress_bar_dict(self):
        # don't show the experiment version number
        items = super().get_progress_bar_dict()
        items.pop("v_num", None)
        return items

    def val_dataloader(self):
        return DataLoader(
            self.valid_dataset, num_workers=0, shuffle=False, drop_last=False,  # was num_workers=4 (or 1 on TPUs)
            batch_size=self.config.batch_size*2, collate_fn=self.collate_fn)

    def validation_step(self, batch, batch_idx):
        logits = self.forward(batch[0])
        loss = self.config.loss_fn(
            logits,
            batch[1]
        )
        preds = torch.argmax(logits, dim=-1)[:, :batch[1]["ids"].size(1)]
        return {
            'loss': loss,
            'preds': preds,
            'target': batch[1]
        }

    def validation_step_end(self, outputs):
        self.log('val_loss', outputs['loss'].mean())
        for name, metric in self.metrics:
            metric(
                outputs['preds'].view(-1).cpu(),
                outputs['target']['ids'].view(-1).cpu()
            )
            self.log("val_" + name, metric)

    def _should_log(self, flag):
        if (self.trainer.global_step + 1) % self.trainer.log_every_n_steps == 0:
            if isinstance(flag, (list, torch.Tensor)):  # a tensor, one value per replica (docs/migrating.md)
                return flag[0]
            return flag
        return False

    def training_step_end(self, outputs):
        loss = outputs["loss"].mean()
        self.train_loss_tracker.update(loss.detach())
        if self._should_log(outputs["log"]):
            self.logger.log_metrics({
                "train_loss": self.train_loss_tracker.value
            }, step=self.global_step)
        return loss

    def training_step(self, batch, batch_idx):
        loss = self.config.loss_fn(
            self.forward(batch[0]),
            batch[1]
        )
        return {"loss": loss, "log": batch_idx % self.trainer.accumulate_grad_batches == 0}

    def configure_optimizers(self):
        optimizer = pls.optimizers.RAdam(
            self.model.parameters(), lr=self.config.learning_rate,
            weight_decay=self.config.weight_decay
        )
        steps_per_epochs = math.floor(
            len(self.train_dataset) / self.config.batch_size / self.config.grad_accu  # / self.num_gpus # dpp mode
        )
        print("Steps per epochs:", steps_per_epochs)
        n_steps = steps_per_epochs * self.config.epochs
        lr_durations = [
            int(n_steps*0.05),
            int(np.ceil(n_steps*0.95)) + 1
        ]
        break_points = [0] + list(np.cumsum(lr_durations))[:-1]
        scheduler = {
            'scheduler': pls.lr_schedulers.MultiStageScheduler(
                [
                    pls.lr_schedulers.LinearLR(optimizer, 0.01, lr_durations[0]),
                    CosineAnnealingLR(optimizer, lr_durations[1])
                ],
                start_at_epochs=break_points
            ),
            'interval': 'step',
            'frequency': 1,
            'strict': True,
        }
        return {
            'optimizer': optimizer,
            'lr_scheduler': scheduler
        }


# ------------------------------------------------------------------------------------------ paraphrase/train_t2t.py
class Corpus(enum.Enum):
    QUORA = "quora"
    PAWS = "paws"
    MSRP = "msrp"
    OPINOSIS = "opinosis"
    QP = "quora+paws"
    PMO = "paws+msrp+opinosis"


@dataclass
class Config(BaseConfig):
    dataset: Corpus = Corpus.PMO


TINY_T5 = dict(
    vocab_size=32, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2,
    relative_attention_num_buckets=8, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
)


class T5Model(T5BaseModel):
    def __init__(self, config: Config, **kwargs):
        model = T5ForConditionalGeneration(T5Config(**TINY_T5))  # was .from_pretrained(config.base_t5_model)
        tokenizer = None  # was T5Tokenizer.from_pretrained(config.base_t5_model)
        super().__init__(config, model, tokenizer)
        self.config = config
        # log the config values
        self.save_hyperparameters(asdict(config))
        self.context_tokens = [3, 4, 5]  # was self.tokenizer.encode("paraphrase: ")
        self.train_dataset = ParaphraseDataset(self.config.dataset, '_train.jbl', self.context_tokens)
        print("Train dataset: ", len(self.train_dataset))
        self.valid_dataset = ParaphraseDataset(self.config.dataset, '_valid.jbl', self.context_tokens)
        print("Valid dataset: ", len(self.valid_dataset))


class ParaphraseDataset(Dataset):
    pairs = {"_train.jbl": 12, "_valid.jbl": 6}

    def __init__(self, corpus: Corpus, file_suffix: str, context_tokens: List[int]):
        # was: input_ids and target_ids read from cache/<corpus>{file_suffix} with joblib
        generator = torch.Generator().manual_seed(len(file_suffix))
        pairs = self.pairs[file_suffix]
        input_ids = torch.randint(6, TINY_T5["vocab_size"], (pairs, 5), generator=generator)
        target_ids = (input_ids + torch.randint(0, 2, (pairs, 5), generator=generator)).clamp(max=TINY_T5["vocab_size"] - 1)
        self.input_ids, self.target_ids = input_ids.tolist(), target_ids.tolist()
        self.context_tokens = context_tokens

    def __len__(self):
        return len(self.input_ids) * 2

    def __getitem__(self, index):
        if index >= len(self.input_ids):
            # flip the input and target
            index = index - len(self.input_ids)
            return (
                torch.tensor(self.context_tokens + self.target_ids[index], dtype=torch.int64),
                torch.tensor(self.input_ids[index], dtype=torch.int64)
            )
        else:
            return (
                torch.tensor(self.context_tokens + self.input_ids[index], dtype=torch.int64),
                torch.tensor(self.target_ids[index], dtype=torch.int64)
            )


def build() -> T5Model:
    """paraphrase/train_t2t.py's ``main`` settings, shrunk: batches of 6 pairs, 10 planned epochs for the schedule."""
    torch.manual_seed(0)
    config = Config(
        base_t5_model="t5-base",
        learning_rate=1e-3,
        epochs=10,
        dataset=Corpus.PAWS,
        max_len=64,
        grad_accu=1,
        batch_size=6,
        fp16=False,
        weight_decay=0,
        num_gpus=1,
        loss_fn=masked_cross_entropy_loss
    )
    return T5Model(config).double()
