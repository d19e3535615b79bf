"""Comparing two runs value by value, stage by stage, so that a difference shows where it starts.

The stages, in the order the step runs them: what ``training_step_end`` received (only for modules that define it),
what Lightning receives (the hook's result, or the step's output without one), every parameter's gradient, every
buffer after the step. For ``mgpu_ddp``, a last stage compares each ``*_step_end`` hook on every rank's rows with
the same hook on each rank's own (``ranks``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from lightning_mgpu.doctor.ranks import RankRuns
from lightning_mgpu.doctor.report import Comparison, Kind
from lightning_mgpu.doctor.runs import STEP_OUTPUT, Run


def compare_runs(reference: Run, split: Run, atol: float, rtol: float) -> list[Comparison]:
    """Every value of ``split`` against ``reference``: step outputs, outputs, gradients, then buffers.

    A value missing from one run counts as a difference, with a note saying which run lacks it.
    """
    comparisons: list[Comparison] = []
    if reference.step_end:
        comparisons.extend(
            _compare_leaves(reference.step_output, split.step_output, STEP_OUTPUT, "step-output", atol, rtol)
        )
    comparisons.extend(_compare_leaves(reference.output, split.output, "output", "output", atol, rtol))
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
    for name in [*reference.buffers, *(name for name in split.buffers if name not in reference.buffers)]:
        if name not in split.buffers:
            comparisons.append(Comparison(name, "buffer", None, False, "missing after the split run"))
        elif name not in reference.buffers:
            comparisons.append(Comparison(name, "buffer", None, False, "only after the split run"))
        else:
            comparisons.append(
                _compare_values(name, "buffer", reference.buffers[name], split.buffers[name], atol, rtol)
            )
    return comparisons


def compare_ranks(runs: RankRuns, atol: float, rtol: float) -> list[Comparison]:
    """The hook on every rank's rows against each rank's own, combined: the loss, its gradients, what it logged.

    Each ``what`` starts with the hook's name: ``training_step_end: output['loss']``,
    ``training_step_end: step output['image'].grad``, ``validation_step_end: self.log('val_recall')``.
    """
    gathered, ranks = runs.gathered, runs.ranks
    pairs: list[tuple[str, Any, Any]] = []
    if runs.loss_path is not None and gathered.loss is not None and ranks.loss is not None:
        pairs.append((runs.loss_path, gathered.loss, ranks.loss))
    pairs.extend((f"{name}.grad", grad, ranks.grads[name]) for name, grad in gathered.grads.items())
    pairs.extend(
        (f"self.log({name!r})", value, ranks.logged[name])
        for name, value in gathered.logged.items()
        if name in ranks.logged
    )
    return [
        _compare_values(f"{runs.hook}: {what}", "per-rank", ours, theirs, atol, rtol) for what, ours, theirs in pairs
    ]


def _compare_leaves(ours: Any, theirs: Any, root: str, kind: Kind, atol: float, rtol: float) -> list[Comparison]:
    comparisons: list[Comparison] = []
    mine = dict(_leaves(ours, root))
    other = dict(_leaves(theirs, root))
    for path in [*mine, *(path for path in other if path not in mine)]:
        if path not in other:
            comparisons.append(Comparison(path, kind, None, False, "missing from the split run"))
        elif path not in mine:
            comparisons.append(Comparison(path, kind, None, False, "only in the split run"))
        elif mine[path] is not None or other[path] is not None:
            comparisons.append(_compare_values(path, kind, mine[path], other[path], atol, rtol))
    return comparisons


def _compare_values(what: str, kind: Kind, ours: Any, theirs: Any, atol: float, rtol: float) -> Comparison:
    if isinstance(ours, numbers.Number) and isinstance(theirs, torch.Tensor) and theirs.dim() == 1:
        ours = torch.tensor(ours)  # replicas' numbers are gathered into a tensor, one value per replica
    if not isinstance(ours, torch.Tensor) or not isinstance(theirs, torch.Tensor):
        if isinstance(ours, torch.Tensor) or isinstance(theirs, torch.Tensor):
            note = f"{_describe(ours)} on one device, {_describe(theirs)} in the split run"
            return Comparison(what, kind, None, False, note)
        if isinstance(ours, numbers.Number) and isinstance(theirs, numbers.Number):
            ours, theirs = torch.tensor(ours), torch.tensor(theirs)
        else:
            same = bool(ours == theirs)
            return Comparison(what, kind, 0.0 if same else None, same, "" if same else f"{ours!r} vs {theirs!r}")
    note = ""
    if ours.dim() == 0 and theirs.dim() == 1:
        # Replicas' 0-dim values are gathered to one value per replica: each must equal the one-device value.
        note = f"one value on one device, one per replica ({theirs.numel()}) in the split run"
        ours = ours.expand_as(theirs)
    elif ours.shape != theirs.shape:
        note = f"shape {tuple(ours.shape)} on one device, {tuple(theirs.shape)} in the split run"
        return Comparison(what, kind, None, False, note)
    a = ours.detach().to("cpu", torch.float64)
    b = theirs.detach().to("cpu", torch.float64)
    same = bool(torch.allclose(b, a, rtol=rtol, atol=atol, equal_nan=True))
    if a.numel() == 0:
        return Comparison(what, kind, 0.0, same, note)
    difference = torch.where(a == b, torch.zeros_like(a), (a - b).abs())
    difference = torch.where(torch.isnan(a) & torch.isnan(b), torch.zeros_like(a), difference)
    largest = float(difference.max())
    if not math.isfinite(largest):
        return Comparison(what, kind, None, same, "NaN or inf in one run only")
    return Comparison(what, kind, largest, same, note)


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


def differing(reference: Run, other: Run, atol: float, rtol: float) -> list[str]:
    """The key paths where ``other`` differs from ``reference``, in order; none when ``other`` failed."""
    if other.error is not None:
        return []
    return [comparison.what for comparison in compare_runs(reference, other, atol, rtol) if not comparison.same]
