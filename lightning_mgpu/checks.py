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


def check_gpus_exist(accelerator: object, devices: object) -> None:
    """Refuse ``accelerator="gpu"`` or ``"cuda"`` asking for more CUDA devices than exist, before a Trainer is built.

    Lightning's own refusal comes from deep inside the Trainer's constructor ("No supported gpu backend found!") and
    names neither the count asked for nor a way out. ``devices`` is read as the Trainer reads it: a count, ``-1`` or
    ``"auto"`` for every device, or a list (or comma-separated string) of indices. ``accelerator="gpu"`` on a Mac
    with MPS is left to Lightning, which picks MPS there, and so is any ``devices`` value it would refuse itself.
    """
    if not isinstance(accelerator, str) or accelerator.lower() not in ("gpu", "cuda"):
        return
    if accelerator.lower() == "gpu" and torch.backends.mps.is_available():
        return
    asked = _gpus_asked_for(devices)
    if asked is None:
        return
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if isinstance(asked, list):
        if all(index < available for index in asked):
            return
        wanted = f"{len(asked)} GPU(s), with indices {asked}"
    elif asked == -1:
        if available:
            return
        wanted = "every GPU (at least 1)"
    else:
        if asked <= available:
            return
        wanted = f"{asked} GPU(s)"
    fewer = f" Or ask for at most --trainer.devices {available}." if available else ""
    raise ConfigurationError(
        f"trainer.accelerator {accelerator!r} with trainer.devices {devices!r} asks for {wanted}, but this machine"
        f" has {available} CUDA device(s). Run on the CPU with --trainer.accelerator cpu (with --trainer.devices 2"
        f" for 2 virtual replicas or processes), or use a CPU config such as configs/quickstart.yaml.{fewer}"
    )


def _gpus_asked_for(devices: object) -> int | list[int] | None:
    """What ``Trainer(devices=...)`` asks for: a count, -1 for every device, indices, or ``None`` if it is invalid."""
    if isinstance(devices, str):
        text = devices.strip()
        if text == "auto":
            return -1
        try:
            if "," in text:
                return sorted({int(part) for part in text.split(",") if part.strip()}) or None
            return _gpus_asked_for(int(text))
        except ValueError:
            return None
    if isinstance(devices, int) and not isinstance(devices, bool):
        return devices if devices == -1 or devices > 0 else None
    if isinstance(devices, (list, tuple)) and devices and all(isinstance(index, int) for index in devices):
        return sorted(set(devices))
    return None
