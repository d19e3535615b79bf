"""Configuration checks shared by the strategies, run before any process starts or any step runs."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_mgpu.errors import ConfigurationError


def check_devices_exist(devices: Sequence[torch.device], strategy_name: str) -> None:
    """Refuse CUDA devices that this machine does not have, naming them and the fix."""
    cuda_indices = [device.index or 0 for device in devices if device.type == "cuda"]
    if not cuda_indices:
        return
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    missing = sorted({index for index in cuda_indices if index >= available})
    if missing:
        raise ConfigurationError(
            f"{strategy_name} was asked for CUDA devices {sorted(set(cuda_indices))}, but this machine has"
            f" {available} CUDA device(s), so {missing} do not exist. Ask for at most devices={available}, or use"
            " accelerator='cpu' to run on the CPU."
        )
