"""torchmetrics' metrics, one or more of each family its test matrix covers, updated in a LightningModule's step.

Shared by ``tests/test_metric_matrix.py`` (one device and ``mgpu_dp`` in the test's process) and
``tests/scripts/metrics_ddp.py`` (``mgpu_ddp``'s ranks). Each metric takes what its family's documentation passes:
probabilities or logits and targets, per-row regression values, retrieval scores with their query ids, sentences.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
import torchmetrics
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import classification, regression, retrieval, text

ROWS, BATCH = 40, 8
WORDS = ("cat", "dog", "bird")


def data() -> DataLoader:
    """40 rows in batches of 8: chunks of 4 + 4 on 2 replicas, 3 + 3 + 2 on 3, 20 rows per rank on 2 ranks."""
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(ROWS, 6, generator=generator, dtype=torch.float64)
    label = torch.randint(0, 3, (ROWS,), generator=generator)
    labels = torch.randint(0, 2, (ROWS, 3), generator=generator)
    target = torch.randn(ROWS, generator=generator, dtype=torch.float64)
    query = torch.arange(ROWS) // 4
    relevant = torch.randint(0, 2, (ROWS,), generator=generator)
    return DataLoader(TensorDataset(x, label, labels, target, query, relevant), batch_size=BATCH)


def _binary(out: torch.Tensor, batch: Any) -> tuple[Any, ...]:
    return out[:, 3].sigmoid(), (batch[1] == 1).long()


def _multiclass(out: torch.Tensor, batch: Any) -> tuple[Any, ...]:
    return out[:, :3], batch[1]


def _multilabel(out: torch.Tensor, batch: Any) -> tuple[Any, ...]:
    return out[:, 4:7].sigmoid(), batch[2]


def _regression(out: torch.Tensor, batch: Any) -> tuple[Any, ...]:
    return out[:, 3], batch[3]


def _vectors(out: torch.Tensor, batch: Any) -> tuple[Any, ...]:
    return out[:, 4:7], batch[2].to(out.dtype) + 0.5


def _retrieval(out: torch.Tensor, batch: Any) -> tuple[Any, ...]:
    return out[:, 3].sigmoid(), batch[5], batch[4]


def _values(out: torch.Tensor, batch: Any) -> tuple[Any, ...]:
    return (out[:, 3],)


def _losses(out: torch.Tensor, batch: Any) -> tuple[Any, ...]:
    return (F.cross_entropy(out[:, :3], batch[1], reduction="none"),)


def _sentences(out: torch.Tensor, batch: Any) -> tuple[Any, ...]:
    predicted = [f"the {WORDS[int(index)]} sat on the mat" for index in out[:, :3].argmax(-1)]
    references = [f"the {WORDS[int(label)]} sat on a mat" for label in batch[1]]
    return predicted, references


def _translations(out: torch.Tensor, batch: Any) -> tuple[Any, ...]:
    predicted, references = _sentences(out, batch)
    return predicted, [[reference] for reference in references]


def _boxes(out: torch.Tensor, batch: Any) -> tuple[Any, ...]:
    """One predicted and one true box per image (row), as detection metrics take them: lists of dicts per image."""
    corner = batch[0][:, :2].abs() * 10
    size = 5 + out[:, :2].abs()
    predicted = [
        {"boxes": torch.cat([c, c + s]).unsqueeze(0), "scores": score.reshape(1), "labels": label.reshape(1)}
        for c, s, score, label in zip(corner, size, out[:, 3].sigmoid(), out[:, :3].argmax(-1), strict=True)
    ]
    truth = [
        {"boxes": torch.cat([c, c + 5]).unsqueeze(0), "labels": label.reshape(1)}
        for c, label in zip(corner, batch[1], strict=True)
    ]
    return predicted, truth


def _detection() -> dict[str, tuple[Callable[[], torchmetrics.Metric], Callable[..., tuple[Any, ...]]]]:
    """``MeanAveragePrecision`` where its optional dependencies (pycocotools, torchvision) are installed."""
    try:
        from torchmetrics.detection import MeanAveragePrecision  # exported where torchvision is installed
    except ImportError:
        return {}
    if importlib.util.find_spec("pycocotools") is None:
        return {}
    return {"mean_average_precision": (MeanAveragePrecision, _boxes)}


METRICS: dict[str, tuple[Callable[[], torchmetrics.Metric], Callable[..., tuple[Any, ...]]]] = {
    "binary_accuracy": (classification.BinaryAccuracy, _binary),
    "binary_auroc": (classification.BinaryAUROC, _binary),
    "binary_average_precision": (classification.BinaryAveragePrecision, _binary),
    "binary_f1": (classification.BinaryF1Score, _binary),
    "binary_matthews": (classification.BinaryMatthewsCorrCoef, _binary),
    "binary_calibration": (classification.BinaryCalibrationError, _binary),
    "binary_specificity": (classification.BinarySpecificity, _binary),
    "multiclass_accuracy": (lambda: classification.MulticlassAccuracy(3), _multiclass),
    "multiclass_auroc": (lambda: classification.MulticlassAUROC(3), _multiclass),
    "multiclass_f1": (lambda: classification.MulticlassF1Score(3, average="macro"), _multiclass),
    "multiclass_precision": (lambda: classification.MulticlassPrecision(3), _multiclass),
    "multiclass_recall": (lambda: classification.MulticlassRecall(3, average="weighted"), _multiclass),
    "multiclass_cohen_kappa": (lambda: classification.MulticlassCohenKappa(3), _multiclass),
    "multiclass_confusion_matrix": (lambda: classification.MulticlassConfusionMatrix(3), _multiclass),
    "multiclass_jaccard": (lambda: classification.MulticlassJaccardIndex(3), _multiclass),
    "multiclass_average_precision": (lambda: classification.MulticlassAveragePrecision(3), _multiclass),
    "multiclass_calibration": (lambda: classification.MulticlassCalibrationError(3), _multiclass),
    "multilabel_accuracy": (lambda: classification.MultilabelAccuracy(3), _multilabel),
    "multilabel_auroc": (lambda: classification.MultilabelAUROC(3), _multilabel),
    "multilabel_hamming": (lambda: classification.MultilabelHammingDistance(3), _multilabel),
    "multilabel_ranking_loss": (lambda: classification.MultilabelRankingLoss(3), _multilabel),
    "mean_squared_error": (regression.MeanSquaredError, _regression),
    "mean_absolute_error": (regression.MeanAbsoluteError, _regression),
    "pearson": (regression.PearsonCorrCoef, _regression),
    "spearman": (regression.SpearmanCorrCoef, _regression),
    "kendall": (regression.KendallRankCorrCoef, _regression),
    "concordance": (regression.ConcordanceCorrCoef, _regression),
    "r2": (regression.R2Score, _regression),
    "explained_variance": (regression.ExplainedVariance, _regression),
    "cosine_similarity": (lambda: regression.CosineSimilarity(reduction="mean"), _vectors),
    "retrieval_mrr": (retrieval.RetrievalMRR, _retrieval),
    "retrieval_map": (retrieval.RetrievalMAP, _retrieval),
    "retrieval_ndcg": (retrieval.RetrievalNormalizedDCG, _retrieval),
    "retrieval_precision": (lambda: retrieval.RetrievalPrecision(top_k=2), _retrieval),
    "retrieval_hit_rate": (retrieval.RetrievalHitRate, _retrieval),
    "max": (torchmetrics.MaxMetric, _values),
    "min": (torchmetrics.MinMetric, _values),
    "mean": (torchmetrics.MeanMetric, _losses),
    "bleu": (text.BLEUScore, _translations),
    "sacre_bleu": (text.SacreBLEUScore, _translations),
    "chrf": (text.CHRFScore, _translations),
    "char_error_rate": (text.CharErrorRate, _sentences),
    "word_error_rate": (text.WordErrorRate, _sentences),
    "match_error_rate": (text.MatchErrorRate, _sentences),
    "word_info_lost": (text.WordInfoLost, _sentences),
    "extended_edit_distance": (text.ExtendedEditDistance, _translations),
    **_detection(),
}
"""Each metric's name, how it is built, and what it is given from the model's outputs and the batch."""


class MetricMatrix(L.LightningModule):
    """Every metric of ``METRICS`` updated in ``validation_step``; ``results`` holds each one's value at the end."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(6, 7).double()
        self.metrics = nn.ModuleDict({name: make() for name, (make, _) in METRICS.items()})
        self.results: dict[str, Any] = {}

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        out = self.layer(batch[0])
        for name, metric in self.metrics.items():
            metric.update(*METRICS[name][1](out, batch))

    def on_validation_epoch_end(self) -> None:
        self.results = {name: _detached(metric.compute()) for name, metric in self.metrics.items()}


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().double()
    if isinstance(value, dict):
        return {key: _detached(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_detached(item) for item in value]
    return value
