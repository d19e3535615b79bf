"""``mgpu_dp``: single-process data parallelism for Lightning 2.x, with the ``*_step_end`` hooks of 1.x."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, ClassVar

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning_utilities.core.apply_func import apply_to_collection
from torch.utils.data import DataLoader, default_collate
from typing_extensions import override

from lightning_mgpu.engine import MGPUDataParallel
from lightning_mgpu.engine.reduce import reduce_op_name
from lightning_mgpu.engine.scatter import check_chunk_weight_count, check_chunk_weights
from lightning_mgpu.errors import ConfigurationError
from lightning_mgpu.namespaces import Bindings
from lightning_mgpu.step.health import StepHealth, stop_iteration_is_an_error
from lightning_mgpu.step.hooks import call_step_end, caller_runs_step_end
from lightning_mgpu.step.replicas import mark_outside_replicas, run_replica_step
from lightning_mgpu.strategies.base import MGPUStrategyMixin, bind_strategy, suggest_keywords

if TYPE_CHECKING:
    _Base = ParallelStrategy
else:
    _Base = object

LIGHTNING_1X_NAME = "dp"
"""Lightning 1.x's name for its DataParallel strategy, registered as another name of ``mgpu_dp``."""

_REDUCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "mean": lambda tensor: tensor.float().mean().to(tensor.dtype),  # as 1.x: in float, back to the tensor's dtype
    "sum": torch.sum,
    "max": torch.amax,
    "min": torch.amin,
}

_STEP_LOADERS = {
    "training_step": "train_dataloader",
    "validation_step": "val_dataloaders",
    "test_step": "test_dataloaders",
    "predict_step": "predict_dataloaders",
}
"""The Trainer property holding the loaders whose batches each step receives."""

_BATCH_HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")


class MGPUDPLogic(MGPUStrategyMixin, _Base):
    """What ``mgpu_dp`` does, bound to each Lightning namespace by a class that adds its ``ParallelStrategy``."""

    bindings: ClassVar[Bindings[type[MGPUDPLogic]]] = Bindings()

    strategy_name = "mgpu_dp"

    @suggest_keywords
    def __init__(
        self,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        sync_batchnorm: bool = True,
        device_weights: Sequence[float] | None = None,
    ) -> None:
        # Set before Lightning's __init__, which assigns parallel_devices, whose setter checks the count.
        self._device_weights = None if device_weights is None else check_chunk_weights(device_weights, "device_weights")
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=None,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._num_nodes = 1
        self._health = StepHealth(self.strategy_name)
        self._restore_replica_attributes: Callable[[], None] = _nothing_to_restore
        self.sync_batchnorm = sync_batchnorm

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``mgpu_dp``, and ``dp`` for code written for Lightning 1.x, unless something else owns ``dp``.

        Lightning 2.x has no ``dp``; should a later release (or another plugin) register one, it is left alone.
        """
        super().register_strategies(strategy_registry)
        owner = strategy_registry[LIGHTNING_1X_NAME]["strategy"] if LIGHTNING_1X_NAME in strategy_registry else None
        if owner is None or getattr(owner, "__module__", "").startswith("lightning_mgpu."):
            strategy_registry.register(
                LIGHTNING_1X_NAME,
                cls,
                description=f"{cls.__name__} ({cls.strategy_name}) under Lightning 1.x's name",
                override=True,
            )

    @property
    def device_weights(self) -> tuple[float, ...] | None:
        """Each device's relative share of every batch, or ``None`` for an even split."""
        return self._device_weights

    @property
    def parallel_devices(self) -> list[torch.device] | None:
        """The devices to replicate onto; checked when assigned, against ``device_weights`` too."""
        return super().parallel_devices

    @parallel_devices.setter
    def parallel_devices(self, parallel_devices: list[torch.device] | None) -> None:
        MGPUStrategyMixin.parallel_devices.fset(self, parallel_devices)  # type: ignore[attr-defined]
        if parallel_devices and self._device_weights is not None:
            check_chunk_weight_count(
                self._device_weights, parallel_devices, "device_weights", "MGPUDPStrategy", "Trainer(devices=...)"
            )

    @property
    def num_nodes(self) -> int:
        """Always 1: one process drives every device, so the replicas cannot span machines."""
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        if num_nodes != 1:
            raise ConfigurationError(
                f"strategy='mgpu_dp' runs in one process on one machine, but num_nodes={num_nodes} was requested."
                " Use strategy='mgpu_ddp' to train on several machines, or set num_nodes=1.",
                setting="Trainer.num_nodes",
            )
        self._num_nodes = num_nodes

    @property
    @override
    def root_device(self) -> torch.device:
        if not self.parallel_devices:
            raise ConfigurationError(
                "MGPUDPStrategy has no devices yet; pass it to a Trainer first.", setting="Trainer.strategy"
            )
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
        self._restore_replica_attributes = mark_outside_replicas(module)
        self._prepare_module(trainer, module)
        super().setup(trainer)
        # Wrapped after Lightning's setup (which moves the module to the root device), for two or more devices;
        # with one device the module runs itself.
        assert self.parallel_devices is not None
        assert self.model is not None
        if not isinstance(self.model, MGPUDataParallel) and len(self.parallel_devices) > 1:
            self.model = MGPUDataParallel(
                self.model,
                self.parallel_devices,
                sync_batchnorm=self.sync_batchnorm,
                chunk_weights=self._device_weights,
            )

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

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
        """Reduce each tensor in ``tensor`` (a tensor or a collection) to one value, as Lightning 1.x's ``dp`` did.

        One process holds every value already, so the reduction is over a tensor's own elements: the per-replica
        values that ``*_step_end`` receives (``self.trainer.strategy.reduce(outputs["loss"])``) become their mean,
        like the 1.x code that calls it expects. A mean is taken in float and cast back to the tensor's dtype, as in
        1.x. ``reduce_op`` ``"sum"``, ``"max"`` or ``"min"`` (any case, or ``torch.distributed.ReduceOp``) reduce by
        that instead; 1.x ignored it and always averaged. 0-dim tensors and everything that is not a tensor come
        back unchanged, which is what Lightning needs when it reduces one process's values.

        Raises:
            ValueError: for a ``reduce_op`` other than mean (``"avg"``), sum, max and min.
        """
        op = "mean" if reduce_op is None else reduce_op_name(reduce_op)
        if op is None:
            raise ValueError(
                f"strategy.reduce(..., reduce_op={reduce_op!r}) under mgpu_dp: use 'mean' (the default), 'sum', 'max'"
                " or 'min'."
            )
        reduction = _REDUCTIONS[op]

        def reduce_tensor(value: torch.Tensor) -> torch.Tensor:
            return value if value.dim() == 0 else reduction(value)

        return apply_to_collection(tensor, torch.Tensor, reduce_tensor)

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
        restore, self._restore_replica_attributes = self._restore_replica_attributes, _nothing_to_restore
        restore()
        if isinstance(self.model, MGPUDataParallel):
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
        split = self.num_replicas > 1
        if module is None or wrapper is None or (split and not isinstance(wrapper, MGPUDataParallel)):
            raise ConfigurationError(
                f"{step} was called before the mgpu_dp strategy was set up by a Trainer.", setting="Trainer.strategy"
            )
        if not split:  # nothing to split
            with stop_iteration_is_an_error(step), caller_runs_step_end():
                return self._module_step(module, step, precision_context, args, kwargs)
        assert isinstance(wrapper, MGPUDataParallel)
        if step == "training_step" and not self.sync_batchnorm and self._health.wants("batchnorm"):
            self._health.check_batchnorm(
                module,
                "each replica's chunk",
                "This is sync_batchnorm=False; leave it at its default (True) to train exactly.",
            )
        collated = _collated_by_torch(module, step)
        with stop_iteration_is_an_error(step), caller_runs_step_end():
            return run_replica_step(wrapper, module, step, args, kwargs, precision_context, self._health, collated)

    def _module_step(
        self,
        module: pl.LightningModule,
        step: str,
        precision_context: Callable[[], AbstractContextManager[Any]],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """The step on one device: the module itself runs it, then its ``*_step_end`` hook, as a replica step does.

        No replica means no copy: what the step assigns to ``self`` stays, any output reaches the hook as it is,
        and ``self.log`` and ``self.manual_backward`` are Lightning's own.
        """
        with precision_context():
            output = getattr(module, step)(*args, **kwargs)
        result = call_step_end(module, step, output)
        if step == "training_step":
            self._health.check_loss(result, lambda: f"at step {module.global_step}")
        return result


def _collated_by_torch(module: pl.LightningModule, step: str) -> bool:
    """Whether torch's ``default_collate`` built every batch that ``step`` can receive in this run.

    It transposes samples into fields, so the batch's lists are fields by construction. That holds only when every
    loader of the step's stage batches with it (``batch_size=None`` converts samples instead) and no batch hook of
    the module or datamodule rebuilds the batch; anything else, a loader that is not a ``DataLoader`` included,
    leaves the reading of lists that read both ways to ``lightning_mgpu.engine.scatter``'s rule.
    """
    try:
        trainer = module.trainer
    except RuntimeError:  # not attached to a Trainer
        return False
    loaders = _leaves(getattr(trainer, _STEP_LOADERS[step], None))
    if not loaders or not all(_collates_by_default(loader) for loader in loaders):
        return False
    datamodule = getattr(trainer, "datamodule", None)  # set by the Trainer's data connector, undeclared
    kinds: list[type] = [type(module)] if datamodule is None else [type(module), type(datamodule)]
    return not any(_overrides_batch_hook(kind, hook) for kind in kinds for hook in _BATCH_HOOKS)


def _leaves(iterables: Any) -> list[Any]:
    """The loaders of a Trainer's ``*_dataloader(s)`` property: one, or a list, tuple or dict of them."""
    if isinstance(iterables, Mapping):
        return [leaf for value in iterables.values() for leaf in _leaves(value)]
    if isinstance(iterables, (list, tuple)):
        return [leaf for value in iterables for leaf in _leaves(value)]
    return [] if iterables is None else [iterables]


def _collates_by_default(loader: Any) -> bool:
    return isinstance(loader, DataLoader) and loader.batch_sampler is not None and loader.collate_fn is default_collate


@functools.lru_cache(maxsize=256)  # asked every step, of the same few classes
def _overrides_batch_hook(kind: type, hook: str) -> bool:
    """Whether ``kind`` defines ``hook`` itself, above Lightning's ``DataHooks`` (in either namespace)."""
    for cls in kind.__mro__:
        if hook in vars(cls):
            return cls.__name__ != "DataHooks"
    return False


@bind_strategy
class MGPUDPStrategy(MGPUDPLogic, ParallelStrategy):
    """Split each batch across devices in one process and run the step of one replica per device in threads.

    The successor of Lightning 1.x's ``strategy="dp"``. Each step the batch is split along dim 0, the
    LightningModule is replicated onto the devices, every replica runs the current step (``training_step``,
    ``validation_step``, ``test_step``, ``predict_step``) on its chunk in its own thread, and the outputs are
    gathered on the root device in batch order. A ``*_step_end`` hook on the LightningModule then receives the
    gathered output; that is where the loss and batch-wise reductions belong. Without the hook each 0-dim value the
    replicas return (the loss) is averaged weighted by their chunk sizes, which equals the single-device value of a
    mean over the rows. What a step changes besides parameters and buffers (torchmetrics metrics, lists) is each
    replica's own and goes back into the module in batch order after the step.

    On CPU, or where a device repeats, replicas alias the original parameters, so
    ``Trainer(accelerator="cpu", devices=2, strategy="mgpu_dp")`` runs two real replicas in two threads. With one
    device there is nothing to split: the module itself runs each step, as on Lightning's single device, and then
    its ``*_step_end`` hook. ``import lightning_mgpu`` also registers 1.x's name, so ``strategy="dp"`` selects this
    strategy.

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
        device_weights: each device's relative share of every batch, one number per device in ``parallel_devices``
            order, so the root device, which also holds the gathered outputs and the loss, can take fewer rows:
            ``[1, 2, 2, 2]`` gives it a seventh of each batch and the three others two sevenths each. Rows are
            assigned by largest-remainder rounding, in contiguous chunks in batch order, and the loss is still
            combined by the rows each replica actually received, so training equals one device's. A device whose
            share of a batch rounds to no rows (a weight of 0, or a batch smaller than the device count) runs no
            replica for that batch. ``None`` (the default) splits evenly. Checked when the Trainer assigns the
            devices, so a wrong count fails before any step.
    """


def _nothing_to_restore() -> None:
    return None
