"""Combine one value per replica the way a single device would have computed it over the whole batch."""

from __future__ import annotations

from collections.abc import Sequence

import torch

_REDUCE_OP_NAMES = {"mean": "mean", "avg": "mean", "sum": "sum", "max": "max", "min": "min"}


def reduce_op_name(reduce_op: object) -> str | None:
    """``"mean"``, ``"sum"``, ``"max"`` or ``"min"`` for a reduction named so or given as a ``ReduceOp``, else ``None``.

    Names are read in any letter case, and ``"avg"`` (``ReduceOp.AVG``) is the mean, as Lightning reads them.
    """
    if isinstance(reduce_op, str):
        return _REDUCE_OP_NAMES.get(reduce_op.lower())
    if not torch.distributed.is_available():
        return None
    ops = torch.distributed.ReduceOp
    if not isinstance(reduce_op, ops | ops.RedOpType):
        return None
    by_op = ((ops.AVG, "mean"), (ops.SUM, "sum"), (ops.MAX, "max"), (ops.MIN, "min"))
    return next((name for op, name in by_op if reduce_op == op), None)


def weighted_mean(values: torch.Tensor, weights: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` (one per replica, along dim 0) weighted by ``weights`` (rows per replica, or a tensor).

    A replica's mean over 3 rows and another's over 2 rows combine to the mean over all 5, which is what one device
    computes; a plain mean of the two would weigh the 2 rows more. A replica of weight 0 (a mean over nothing, which
    may be NaN) adds nothing, as its rows add nothing on one device. Tensor weights stay on their device, so no
    value is read back to the host.
    """
    if values.shape[0] != len(weights):
        raise ValueError(f"weighted_mean got {values.shape[0]} values but {len(weights)} weights")
    dtype = values.dtype if values.is_floating_point() else torch.get_default_dtype()
    if not isinstance(weights, torch.Tensor):
        if len(set(weights)) == 1 and weights[0] > 0:  # an even split: the plain mean is the weighted one, cheaper
            return values.to(dtype).mean(dim=0)
        weights = torch.tensor([float(weight) for weight in weights], device=values.device)
    scale = weights.to(device=values.device, dtype=dtype)
    shape = (-1,) + (1,) * (values.dim() - 1)
    scale = scale.view(shape)
    weighted = torch.where(scale > 0, values.to(dtype) * scale, torch.zeros((), dtype=dtype, device=values.device))
    return weighted.sum(dim=0) / scale.sum()
