"""The strategies bound to ``pytorch_lightning``: what ``mgpu_dp``, ``dp`` and ``mgpu_ddp*`` select in its Trainer.

The same logic as ``lightning_mgpu.MGPUDPStrategy`` and ``lightning_mgpu.MGPUDDPStrategy``, on ``pytorch_lightning``'s
strategy classes. Subclass these to give a strategy of your own to a ``pytorch_lightning.Trainer``. Imported once
``pytorch_lightning`` is, by the hook ``strategies/__init__.py`` leaves for it (or by you, which imports
``pytorch_lightning``), and registers the strategies when it has bound both.

mypy reads each logic class as a subclass of ``lightning.pytorch``'s class (its base while type checking), whose
definitions it then finds incompatible with ``pytorch_lightning``'s copies: hence the ignored ``misc`` errors.
"""

from __future__ import annotations

from pytorch_lightning.strategies import DDPStrategy, ParallelStrategy

from lightning_mgpu.namespaces import pytorch_lightning_namespace
from lightning_mgpu.strategies.base import bind_strategy
from lightning_mgpu.strategies.ddp import MGPUDDPLogic
from lightning_mgpu.strategies.dp import MGPUDPLogic
from lightning_mgpu.strategies.registry import register_with


@bind_strategy
class MGPUDPStrategy(MGPUDPLogic, ParallelStrategy):  # type: ignore[misc]
    """``lightning_mgpu.MGPUDPStrategy`` for ``pytorch_lightning``: the same arguments and behaviour."""


@bind_strategy
class MGPUDDPStrategy(MGPUDDPLogic, DDPStrategy):  # type: ignore[misc]
    """``lightning_mgpu.MGPUDDPStrategy`` for ``pytorch_lightning``: the same arguments and behaviour."""


_namespace = pytorch_lightning_namespace()
if _namespace is None:  # its classes are bound above, so only a pytorch_lightning without Lightning 2.x's gets here
    raise ImportError("pytorch_lightning lacks the classes of Lightning 2.x that lightning_mgpu binds to")
register_with(_namespace)
