"""Combine one value per replica the way a single device would have computed it over the whole batch."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def weighted_mean(values: torch.Tensor, weights: Sequence[float]) -> torch.Tensor:
    """Mean of ``values`` (one per replica, along dim 0) weighted by ``weights`` (rows per replica).

    A replica's mean over 3 rows and another's over 2 rows combine to the mean over all 5, which is what one device
    computes; a plain mean of the two would weigh the 2 rows more.
    """
    if values.shape[0] != len(weights):
        raise ValueError(f"weighted_mean got {values.shape[0]} values but {len(weights)} weights")
    dtype = values.dtype if values.is_floating_point() else torch.get_default_dtype()
    if len(set(weights)) == 1:  # an even split: the plain mean is the weighted one, and cheaper
        return values.to(dtype).mean(dim=0)
    scale = torch.tensor([float(weight) for weight in weights], dtype=dtype, device=values.device)
    scale = scale / scale.sum()
    shape = (-1,) + (1,) * (values.dim() - 1)
    return (values.to(dtype) * scale.view(shape)).sum(dim=0)
