"""Every form of the strategy that the README and docs name, tried in a script of one's own of one Lightning namespace.

``python strategy_forms.py lightning.pytorch`` (or ``pytorch_lightning``) prints one JSON line per form: the form, the
class of the Trainer's strategy (or the error), its settings, and the steps ``fast_dev_run`` took where it fitted.
First what works before ``import lightning_mgpu`` (the ``class_path`` forms, which import it themselves) and what does
not (a name or a class-path string); then, with the package imported, every form through the namespace's own
LightningCLI and through ``Trainer(strategy=...)``. tests/test_registry.py runs it and reads the lines.
"""

from __future__ import annotations

import importlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

NAMESPACE = sys.argv[1]
pl: Any = importlib.import_module(NAMESPACE)
cli_module: Any = importlib.import_module(f"{NAMESPACE}.cli")
LightningModule: type[Any] = pl.LightningModule


class Tiny(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(2, 1)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(8, 2, generator=generator), torch.randn(8, 1)), batch_size=4)


QUIET = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False, "enable_checkpointing": False}
CPU = ["--trainer.accelerator", "cpu", "--trainer.devices", "2"]
CLI_QUIET = [f"--trainer.{key}={str(value).lower()}" for key, value in QUIET.items()]


def _settings(strategy: Any) -> dict[str, Any]:
    return {
        "sync_batchnorm": getattr(strategy, "sync_batchnorm", None),
        "gather_step_end": getattr(strategy, "gather_step_end", None),
        "find_unused_parameters": getattr(strategy, "_ddp_kwargs", {}).get("find_unused_parameters"),
    }


def report(form: str, build: Any, fit: bool) -> None:
    """Print what ``build()`` (a Trainer and a module) gives, fitting it with ``fast_dev_run`` when ``fit``."""
    line: dict[str, Any] = {"form": form, "imported": "lightning_mgpu" in sys.modules}
    try:
        trainer, module = build()
    except Exception as error:  # noqa: BLE001 - the error is the result
        line["error"] = f"{type(error).__name__}: {error}"
    else:
        strategy = trainer.strategy
        line |= {"class": f"{type(strategy).__module__}.{type(strategy).__name__}", **_settings(strategy)}
        if fit:
            trainer.fit(module)
            line["steps"] = trainer.global_step
    print("FORM " + json.dumps(line), flush=True)


def by_cli(*args: str) -> Any:
    def build() -> Any:
        cli = cli_module.LightningCLI(
            Tiny, run=False, save_config_callback=None, args=[*CPU, *CLI_QUIET, "--trainer.fast_dev_run=1", *args]
        )
        return cli.trainer, cli.model

    return build


def by_trainer(strategy: Any) -> Any:
    def build() -> Any:
        return pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, fast_dev_run=1, **QUIET), Tiny()

    return build


with tempfile.TemporaryDirectory() as folder:
    yaml = Path(folder, "strategy.yaml")
    yaml.write_text(
        "trainer:\n  strategy:\n    class_path: lightning_mgpu.MGPUDPStrategy\n    init_args: {sync_batchnorm: false}\n"
    )
    for name in ("mgpu_dp", "lightning_mgpu.MGPUDPStrategy"):
        report(f"before import: cli --trainer.strategy {name}", by_cli("--trainer.strategy", name), fit=False)
        report(f"before import: Trainer(strategy={name!r})", by_trainer(name), fit=False)
    report("before import: cli YAML class_path", by_cli("--config", str(yaml)), fit=True)

    import lightning_mgpu  # noqa: E402, F401 - what a script of one's own does to use the names

    for name in ("mgpu_dp", "lightning_mgpu.MGPUDPStrategy", "mgpu_ddp", "lightning_mgpu.MGPUDDPStrategy"):
        dp = "ddp" not in name.lower()  # mgpu_ddp is built only: fitting it would start processes
        report(f"cli --trainer.strategy {name}", by_cli("--trainer.strategy", name), fit=dp)
        report(f"Trainer(strategy={name!r})", by_trainer(name), fit=dp)
    report(
        "cli --trainer.strategy.class_path lightning_mgpu.MGPUDDPStrategy with init_args",
        by_cli(
            "--trainer.strategy.class_path=lightning_mgpu.MGPUDDPStrategy",
            "--trainer.strategy.init_args.gather_step_end=true",
            "--trainer.strategy.init_args.find_unused_parameters=true",
        ),
        fit=False,
    )
    report("cli YAML class_path", by_cli("--config", str(yaml)), fit=True)
    report(
        "Trainer(strategy=MGPUDPStrategy(...))", by_trainer(lightning_mgpu.MGPUDPStrategy(sync_batchnorm=False)), True
    )
    report(
        "Trainer(strategy=MGPUDDPStrategy(...))",
        by_trainer(lightning_mgpu.MGPUDDPStrategy(gather_step_end=True)),
        False,
    )
