"""What a torchmetrics ``MetricCollection`` updated and logged in ``training_step`` adds to a step, side by side.

The collection (``MulticlassAccuracy``, ``MulticlassF1Score``, ``MulticlassAUROC``) takes each step's logits in one of
the two ways torchmetrics documents for Lightning: rows ``update``, ``self.metrics.update(logits, y)`` and the
collection logged with ``self.log_dict`` per epoch; rows ``call``, ``self.metrics(logits, y)``, which also computes
the batch's value, and the collection logged per step and per epoch. The step is a
``LightningModule`` with a ``Linear(16, 3)`` on 64 rows (cross entropy, SGD), timed over runs of consecutive batches
of one ``fit`` on the CPU (one intra-op thread): on one device (``strategy="auto"``), and under ``mgpu_dp`` on 1, 2
and 4 replicas. Each case runs two worker processes, the step with the collection and without it, the timed loops
alternating; a row reports the medians of both, the median of the per-repeat differences (what the collection adds),
and that difference over one device's.

    python -m benchmarks.metrics
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.against import LIGHTNING_CLOCK, Worker, take_turns

CASES = (("auto", 1), ("mgpu_dp", 1), ("mgpu_dp", 2), ("mgpu_dp", 4))
"""(strategy, devices): one device, then ``mgpu_dp`` on 1, 2 and 4 replicas."""
USES = ("update", "call")

_WORKER = (
    r"""
import gc, os, sys, time
import torch
from torch import nn
import lightning.pytorch as L
import torchmetrics
from torchmetrics import classification
import lightning_mgpu  # registers mgpu_dp

torch.set_num_threads(1)
strategy, devices, use, warmup = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
with_metrics = use != "none"


class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(16, 3)
        if with_metrics:
            self.metrics = torchmetrics.MetricCollection(
                {
                    "accuracy": classification.MulticlassAccuracy(3),
                    "f1": classification.MulticlassF1Score(3),
                    "auroc": classification.MulticlassAUROC(3),
                }
            )

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.layer(x)
        if use == "update":
            self.metrics.update(logits.detach(), y)
            self.log_dict(self.metrics, on_step=False, on_epoch=True)
        elif use == "call":
            self.metrics(logits.detach(), y)
            self.log_dict(self.metrics, on_step=True, on_epoch=True)
        return nn.functional.cross_entropy(logits, y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)

"""
    + LIGHTNING_CLOCK
    + r"""


generator = torch.Generator().manual_seed(0)
x = torch.randn(64 * 2_000, 16, generator=generator)
y = torch.randint(0, 3, (64 * 2_000,), generator=generator)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64)
trainer = L.Trainer(
    accelerator="cpu",
    devices=devices,
    strategy=strategy,
    max_epochs=1_000,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    num_sanity_val_steps=0,
    callbacks=[Clock()],
)
trainer.fit(Classifier(), loader)
"""
)


def measure(
    loops: int = 20,
    repeats: int = 21,
    warmup: int = 10,
    cases: Sequence[tuple[str, int]] = CASES,
    uses: Sequence[str] = USES,
) -> list[dict[str, Any]]:
    """Per use and case: microseconds per step with the collection and without it, and what it adds, alternating."""
    tree = Path(__file__).resolve().parents[1]
    rows = []
    for use in uses:
        for strategy, devices in cases:
            workers = {
                name: Worker(tree, _WORKER, (strategy, devices, metrics, warmup))
                for name, metrics in (("with", use), ("without", "none"))
            }
            times = take_turns(workers, loops, repeats)
            added = [a - b for a, b in zip(times["with"], times["without"], strict=True)]
            rows.append(
                {
                    "use": use,
                    "strategy": strategy,
                    "devices": devices,
                    "with_us": statistics.median(times["with"]),
                    "without_us": statistics.median(times["without"]),
                    "added_us": statistics.median(added),
                    "added_range": (min(added), max(added)),
                }
            )
    for row in rows:
        one_device = next(
            (other["added_us"] for other in rows if other["use"] == row["use"] and other["strategy"] == "auto"), None
        )
        row["over_one_device"] = None if not one_device else row["added_us"] / one_device
    return rows


def main(argv: list[str] | None = None) -> None:
    """Print each case's row."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.metrics", description=__doc__.splitlines()[0])
    parser.add_argument("--loops", type=int, default=20, help="steps per timed loop (default 20)")
    parser.add_argument("--repeats", type=int, default=21, help="timed loops per variant and case (default 21)")
    arguments = parser.parse_args(argv)
    for row in measure(arguments.loops, arguments.repeats):
        where = f"{row['use']:6s} " + ("one device" if row["strategy"] == "auto" else f"mgpu_dp x{row['devices']}")
        low, high = row["added_range"]
        ratio = row["over_one_device"]
        print(
            f"{where:19s}: with {row['with_us']:8.1f} us, without {row['without_us']:8.1f} us, adds"
            f" {row['added_us']:7.1f} us [{low:.1f}, {high:.1f}]"
            + ("" if ratio is None else f", {ratio:.2f}x what it adds on one device")
        )


if __name__ == "__main__":
    main()
