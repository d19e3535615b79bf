"""The command line's LightningCLI bound to ``pytorch_lightning``: what runs a ``pytorch_lightning`` model.

The same classes as ``cli/lightning_cli.py``'s, on ``pytorch_lightning.cli``'s; ``cli_for`` imports this module when
a command's model and data classes are ``pytorch_lightning``'s.

mypy reads each logic class as a subclass of ``lightning.pytorch``'s class (its base while type checking), whose
definitions it then finds incompatible with ``pytorch_lightning``'s copies: hence the ignored ``misc`` errors.
"""

from __future__ import annotations

from pytorch_lightning.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback

from lightning_mgpu.cli.lightning_cli import MGPUArgumentParserLogic, MGPULightningCLILogic, RunFolderConfigLogic


@MGPUArgumentParserLogic.bindings
class MGPUArgumentParser(MGPUArgumentParserLogic, LightningArgumentParser):  # type: ignore[misc]
    """``lightning_mgpu.cli.lightning_cli.MGPUArgumentParser`` for ``pytorch_lightning``."""


@RunFolderConfigLogic.bindings
class RunFolderConfig(RunFolderConfigLogic, SaveConfigCallback):  # type: ignore[misc]
    """``lightning_mgpu.cli.lightning_cli.RunFolderConfig`` for ``pytorch_lightning``."""


@MGPULightningCLILogic.bindings
class MGPULightningCLI(MGPULightningCLILogic, LightningCLI):  # type: ignore[misc]
    """``lightning_mgpu.cli.lightning_cli.MGPULightningCLI`` for ``pytorch_lightning``."""
