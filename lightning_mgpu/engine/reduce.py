"""Combine one value per replica the way a single device would have computed it over the whole batch."""

from __future__ import annotations

from collections.abc import Sequence

import torch


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
