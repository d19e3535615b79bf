"""``mgpu_dp``: single-process data parallelism for Lightning 2.x, with the ``*_step_end`` hooks of 1.x."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from torch import nn
from typing_extensions import override

from lightning_mgpu.engine import DataParallel
from lightning_mgpu.errors import ConfigurationError
from lightning_mgpu.strategies._common import MGPUStrategyMixin
from lightning_mgpu.strategies._health import StepHealth, stop_iteration_is_an_error
from lightning_mgpu.strategies._replica_step import run_replica_step

_REPLICA_ATTRIBUTES = ("replica_index", "num_replicas")
_ABSENT = object()


class DataParallelStrategy(MGPUStrategyMixin, ParallelStrategy):
    """Split each batch across devices in one process and run the step of one replica per device in threads.

    The successor of Lightning 1.x's ``strategy="dp"``. Each step the batch is split along dim 0, the
    LightningModule is replicated onto the devices, every replica runs the current step (``training_step``,
    ``validation_step``, ``test_step``, ``predict_step``) on its chunk in its own thread, and the outputs are
    gathered on the root device in batch order. A ``*_step_end`` hook on the LightningModule then receives the
    gathered output; that is where the loss and batch-wise reductions belong. Without ``training_step_end`` the
    replicas' losses are averaged weighted by their chunk sizes, which equals the single-device loss.

    On CPU, or where a device repeats, replicas alias the original parameters, so
    ``Trainer(accelerator="cpu", devices=2, strategy="mgpu_dp")`` runs two real replicas in two threads.

    Args:
        accelerator: the accelerator; Lightning sets it from ``Trainer(accelerator=...)`` when left ``None``.
        parallel_devices: the devices to replicate onto, the first being the root device; Lightning sets them
            from ``Trainer(devices=...)`` when left ``None``.
        checkpoint_io: how checkpoints are written and read; Lightning's default when ``None``.
        precision_plugin: the precision plugin; its autocast context is entered in every replica thread.
        sync_batchnorm: BatchNorm layers in training mode normalise each chunk by the statistics of the whole batch,
            exchanged between the replicas, so they train exactly as on one device (unlike
            ``torch.nn.DataParallel``). ``False`` normalises each chunk by its own statistics, which saves the
            exchange and changes the results.
    """

    strategy_name = "mgpu_dp"

    def __init__(
        self,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        sync_batchnorm: bool = True,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=None,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._num_nodes = 1
        self._health = StepHealth(self.strategy_name)
        self._replaced_attributes: dict[str, Any] = {}
        self.sync_batchnorm = sync_batchnorm

    @property
    def num_nodes(self) -> int:
        """Always 1: one process drives every device, so the replicas cannot span machines."""
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        if num_nodes != 1:
            raise ConfigurationError(
                f"strategy='mgpu_dp' runs in one process on one machine, but num_nodes={num_nodes} was requested."
                " Use strategy='mgpu_ddp' to train on several machines, or set num_nodes=1."
            )
        self._num_nodes = num_nodes

    @property
    @override
    def root_device(self) -> torch.device:
        if not self.parallel_devices:
            raise ConfigurationError("DataParallelStrategy has no devices yet; pass it to a Trainer first.")
        return self.parallel_devices[0]

    @property
    def num_replicas(self) -> int:
        """The most replicas a step runs (fewer when a batch has fewer rows)."""
        return len(self.parallel_devices or [])

    @property
    @override
    def global_rank(self) -> int:
        return 0

    @property
    @override
    def local_rank(self) -> int:
        return 0

    @property
    @override
    def node_rank(self) -> int:
        return 0

    @property
    @override
    def world_size(self) -> int:
        return 1

    @property
    def is_distributed(self) -> bool:
        """One process: Lightning must not add a DistributedSampler."""
        return False

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": 1, "rank": 0}

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        module = self.lightning_module
        assert module is not None
        # Outside the replicas the module is "replica 0 of 1", so code that reads these runs anywhere; teardown
        # puts back what the module had.
        self._replaced_attributes = {name: vars(module).get(name, _ABSENT) for name in _REPLICA_ATTRIBUTES}
        module.__dict__.update(replica_index=0, num_replicas=1)
        self._prepare_module(trainer, module)
        super().setup(trainer)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def _setup_model(self, model: nn.Module) -> DataParallel:
        assert self.parallel_devices is not None
        if isinstance(model, DataParallel):
            return model
        return DataParallel(model, self.parallel_devices, sync_batchnorm=self.sync_batchnorm)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._parallel_step("training_step", self.precision_plugin.train_step_context, args, kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._parallel_step("validation_step", self.precision_plugin.val_step_context, args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._parallel_step("test_step", self.precision_plugin.test_step_context, args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._parallel_step("predict_step", self.precision_plugin.predict_step_context, args, kwargs)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        """One process holds every value already, so there is nothing to reduce across processes."""
        return tensor

    @override
    def barrier(self, name: str | None = None) -> None:
        """Nothing to wait for in one process."""

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        return obj

    @override
    def all_gather(self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False) -> torch.Tensor:
        return tensor

    @override
    def teardown(self) -> None:
        module = self.lightning_module
        self._release_module(module)
        if module is not None:
            for name, value in self._replaced_attributes.items():
                if value is _ABSENT:
                    module.__dict__.pop(name, None)
                else:
                    module.__dict__[name] = value
            self._replaced_attributes = {}
        if isinstance(self.model, DataParallel):
            self.model.close()
            self.model = self.lightning_module
        super().teardown()

    def _parallel_step(
        self,
        step: str,
        precision_context: Callable[[], AbstractContextManager[Any]],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        module = self.lightning_module
        wrapper = self.model
        assert module is not None
        if not isinstance(wrapper, DataParallel):
            raise ConfigurationError(f"{step} was called before the mgpu_dp strategy was set up by a Trainer.")
        if step == "training_step" and not self.sync_batchnorm and self._health.wants("batchnorm"):
            self._health.check_batchnorm(
                module,
                "each replica's chunk",
                "This is sync_batchnorm=False; leave it at its default (True) to train exactly.",
            )
        with stop_iteration_is_an_error(step):
            return run_replica_step(wrapper, module, step, args, kwargs, precision_context, self._health)
