"""Comparing two runs value by value: every leaf of the step's output, then every parameter's gradient."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator, Mapping
from typing import Any, Literal

import torch

from lightning_mgpu.doctor.report import Comparison
from lightning_mgpu.doctor.runs import Run


def compare_runs(reference: Run, split: Run, atol: float, rtol: float) -> list[Comparison]:
    """Every output leaf, then every parameter's gradient, of ``split`` against ``reference``.

    A value missing from one run counts as a difference, with a note saying which run lacks it.
    """
    comparisons: list[Comparison] = []
    ours = dict(_leaves(reference.output, "output"))
    theirs = dict(_leaves(split.output, "output"))
    for path in [*ours, *(path for path in theirs if path not in ours)]:
        if path not in theirs:
            comparisons.append(Comparison(path, "output", None, False, "missing from the split run's output"))
        elif path not in ours:
            comparisons.append(Comparison(path, "output", None, False, "only in the split run's output"))
        elif ours[path] is not None or theirs[path] is not None:
            comparisons.append(_compare_values(path, "output", ours[path], theirs[path], atol, rtol))
    for name, grad in reference.grads.items():
        other = split.grads.get(name)
        if grad is None and other is None:
            continue
        what = f"{name}.grad"
        if grad is None:
            comparisons.append(Comparison(what, "gradient", None, False, "no gradient on one device"))
        elif other is None:
            comparisons.append(Comparison(what, "gradient", None, False, "no gradient in the split run"))
        else:
            comparisons.append(_compare_values(what, "gradient", grad, other, atol, rtol))
    return comparisons


def _compare_values(
    what: str, kind: Literal["output", "gradient"], ours: Any, theirs: Any, atol: float, rtol: float
) -> Comparison:
    if not isinstance(ours, torch.Tensor) or not isinstance(theirs, torch.Tensor):
        if isinstance(ours, torch.Tensor) or isinstance(theirs, torch.Tensor):
            note = f"{_describe(ours)} on one device, {_describe(theirs)} in the split run"
            return Comparison(what, kind, None, False, note)
        if isinstance(ours, numbers.Number) and isinstance(theirs, numbers.Number):
            ours, theirs = torch.tensor(ours), torch.tensor(theirs)
        else:
            same = bool(ours == theirs)
            return Comparison(what, kind, 0.0 if same else None, same, "" if same else f"{ours!r} vs {theirs!r}")
    if ours.shape != theirs.shape:
        note = f"shape {tuple(ours.shape)} on one device, {tuple(theirs.shape)} in the split run"
        return Comparison(what, kind, None, False, note)
    a = ours.detach().to("cpu", torch.float64)
    b = theirs.detach().to("cpu", torch.float64)
    same = bool(torch.allclose(b, a, rtol=rtol, atol=atol, equal_nan=True))
    if a.numel() == 0:
        return Comparison(what, kind, 0.0, same)
    difference = torch.where(a == b, torch.zeros_like(a), (a - b).abs())
    difference = torch.where(torch.isnan(a) & torch.isnan(b), torch.zeros_like(a), difference)
    largest = float(difference.max())
    if not math.isfinite(largest):
        return Comparison(what, kind, None, same, "NaN or inf in one run only")
    return Comparison(what, kind, largest, same)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"{type(value).__name__} {value!r}"


def _leaves(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield from _leaves(item, f"{path}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _leaves(item, f"{path}[{index}]")
    else:
        yield path, value


def first_difference(reference: Run, other: Run, atol: float, rtol: float) -> str | None:
    """The first value where ``other`` differs from ``reference``, or ``None``; a failed ``other`` shows nothing."""
    if other.error is not None:
        return None
    for comparison in compare_runs(reference, other, atol, rtol):
        if not comparison.same:
            return comparison.what
    return None
