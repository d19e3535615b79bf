"""Reading what a training run wrote into its run folder, for the tests of the command line and the examples."""

from __future__ import annotations

import csv
from pathlib import Path


def read_metrics(run_folder: Path) -> list[dict[str, str]]:
    """The rows of the run's ``metrics.csv`` (CSVLogger's), as strings by column name."""
    with open(run_folder / "metrics.csv") as metrics_file:
        return list(csv.DictReader(metrics_file))


def column(rows: list[dict[str, str]], name: str) -> list[float]:
    """The values of metric ``name`` in the rows that logged it, in order."""
    return [float(row[name]) for row in rows if row.get(name)]
