"""A Hydra project's ``train.py`` as lightning-hydra-template writes it, reduced to what the strategy touches.

It never imports lightning_mgpu: a config of ``configs/hydra/`` names the strategy by ``_target_``, which Hydra imports.
Rank zero writes ``result.json`` (the final parameters, the strategy's class and settings) into the run's folder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import hydra
import lightning as L
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path="configs", config_name="train.yaml")
def main(cfg: DictConfig) -> None:
    """Build the data, the model and the Trainer from the config, fit, and record the result."""
    if cfg.get("seed") is not None:
        L.seed_everything(cfg.seed, workers=True)
    datamodule: L.LightningDataModule = hydra.utils.instantiate(cfg.data)
    model: L.LightningModule = hydra.utils.instantiate(cfg.model)
    trainer: L.Trainer = hydra.utils.instantiate(cfg.trainer, logger=False, enable_checkpointing=False)
    trainer.fit(model=model, datamodule=datamodule)
    if trainer.is_global_zero:
        strategy = trainer.strategy
        result: dict[str, Any] = {
            "strategy": type(strategy).__name__,
            "devices": trainer.num_devices,
            "world_size": trainer.world_size,
            "uneven_batches": getattr(strategy, "uneven_batches", None),
            "gather_step_end": getattr(strategy, "gather_step_end", None),
            "find_unused_parameters": getattr(strategy, "_ddp_kwargs", {}).get("find_unused_parameters"),
            "steps": trainer.global_step,
            "parameters": {name: value.tolist() for name, value in model.state_dict().items()},
        }
        Path(cfg.paths.output_dir, "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
