"""``mgpu_ddp``: the classic DistributedDataParallel recipe as a Lightning 2.x strategy, with ``*_step_end`` hooks."""

from __future__ import annotations

import atexit
import contextlib
import functools
import inspect
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mgpu._compat import (
    LaunchCheck,
    converts_batchnorm_to_sync,
    is_unused_parameters_error,
    layer_sync,
    logged_batch_size,
    set_layer_sync,
    unused_parameter_indices,
    with_sampler,
)
from lightning_mgpu.engine.reduce import reduce_op_name
from lightning_mgpu.engine.scatter import batch_size_of
from lightning_mgpu.errors import ConfigurationError
from lightning_mgpu.namespaces import Bindings, namespace_of
from lightning_mgpu.step.health import StepHealth, stop_iteration_is_an_error
from lightning_mgpu.step.hooks import call_step_end, caller_runs_step_end, has_step_end
from lightning_mgpu.strategies.base import MGPUStrategyMixin, bind_strategy, keyword_hint
from lightning_mgpu.strategies.launch_checks import check_launch_matches_trainer
from lightning_mgpu.strategies.rank_gather import NO_OUTPUT, RankGather
from lightning_mgpu.strategies.samplers import (
    EvenlyShardedSampler,
    evaluation_shards,
    evaluation_shards_of,
    is_padding_sampler,
)
from lightning_mgpu.strategies.uneven import UnevenTraining, reduce_over_real_rows
from lightning_mgpu.sync_batchnorm import SyncBatchNormLayers, rows_not_counted

if TYPE_CHECKING:
    _Base = LightningDDPStrategy
else:
    _Base = object

_EVALUATION_STAGES = (RunningStage.VALIDATING, RunningStage.TESTING, RunningStage.SANITY_CHECKING)
_PADDED_EVALUATION_WARNING = r"Using `DistributedSampler` with the dataloaders\. During `trainer\.(validate|test)\(\)`"
"""Lightning's warning that ``validate``/``test`` under DDP count padding duplicates: never true under ``mgpu_ddp``,
whose evaluation sampler (``process_dataloader``) replaces the padding one it is about, so it is filtered out."""
_EXIT_GRACE_S = 0.1
"""How long the exit handler leaves the GIL to torch.distributed's threads: many scheduler slices, room for load."""


@dataclass
class _ProcessExit:
    """What the exit handler of this process needs to know: whether it is registered, and whether a run failed."""

    registered: bool = False
    a_run_failed: bool = False


_process_exit = _ProcessExit()


def buffer_sync_keyword() -> str:
    """The DDP keyword that switches per-forward buffer broadcasting on the installed torch.

    torch 2.13 deprecates ``broadcast_buffers`` (with a FutureWarning) in favour of ``forward_sync_buffers``; older
    torch knows only ``broadcast_buffers``.
    """
    return (
        "forward_sync_buffers" if "forward_sync_buffers" in _keywords(DistributedDataParallel) else "broadcast_buffers"
    )


_SET_BY_THE_STRATEGY = ("module", "device_ids", "output_device")
"""The keywords of ``DistributedDataParallel`` that the strategy fills in: Lightning's passes the module and
``device_ids``, and ``output_device`` defaults to ``device_ids[0]``."""


@functools.cache
def strategy_keywords(strategy: type) -> tuple[str, ...]:
    """Every keyword ``strategy(...)`` takes, sorted: its own, Lightning's ``DDPStrategy``'s and DDP's.

    Read from the ``__init__`` of each class from ``strategy`` to its namespace's ``DDPStrategy``, and from the
    installed torch's ``DistributedDataParallel``, less ``_SET_BY_THE_STRATEGY``; so a keyword added to any of them
    is taken, and suggested for a misspelling, without a list to update.
    """
    namespace = namespace_of(strategy)
    assert namespace is not None, "a strategy's binding has a Lightning base"
    hierarchy = strategy.__mro__[: strategy.__mro__.index(namespace.DDPStrategy) + 1]
    names = {name for klass in hierarchy for name in _keywords(klass)}
    names |= set(_keywords(DistributedDataParallel)) - set(_SET_BY_THE_STRATEGY)
    return tuple(sorted(names))


def check_strategy_keywords(strategy: type, kwargs: Mapping[str, Any]) -> None:
    """Refuse the keywords that would reach DDP and stop every rank in ``setup``, while the strategy is built.

    Args:
        strategy: the class being built.
        kwargs: the keywords its ``__init__`` does not name, which go to Lightning's ``DDPStrategy`` and from there
            to ``DistributedDataParallel``; a keyword of ``_SET_BY_THE_STRATEGY`` is refused unless it is ``None``.

    Raises:
        ConfigurationError: a keyword no class on the way takes, with the closest one that is taken (or all of
            them), or one the strategy sets itself, with why.
    """
    accepted = strategy_keywords(strategy)
    for name, value in kwargs.items():
        if name in _SET_BY_THE_STRATEGY and value is not None:
            raise ConfigurationError(
                f"{strategy.__name__}({name}=...) is refused: the strategy gives DistributedDataParallel its module,"
                " device_ids and output_device itself (the LightningModule, and on CUDA the device of each process's"
                " local rank). Choose the devices with Trainer(devices=...), e.g. Trainer(devices=[0, 1]), and leave"
                f" {name} out.",
                setting=f"MGPUDDPStrategy.{name}",
            )
        if name not in accepted and name not in _SET_BY_THE_STRATEGY:
            raise ConfigurationError(
                f"{strategy.__name__} takes no keyword {name!r}: neither it, Lightning's DDPStrategy nor torch's"
                f" DistributedDataParallel (torch {torch.__version__}) has one of that name."
                f" {keyword_hint(name, accepted)}",
                setting=f"MGPUDDPStrategy.{name}",
            )


def _keywords(function: Callable[..., Any]) -> list[str]:
    """The parameters of ``function`` (of a class: its ``__init__``) that a keyword argument sets."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    parameters = inspect.signature(function).parameters.values()
    return [parameter.name for parameter in parameters if parameter.kind in kinds]


def release_process_group_at_exit() -> None:
    """Have this process release torch.distributed before the interpreter shuts down; registered once per process.

    Gloo runs collectives on threads of its own. An all-reduce that DDP starts during ``backward`` holds the Python
    context autograd stashes for the pass, and the gloo thread that finishes it frees it, which takes the GIL. That
    thread can keep losing the GIL to the busy main thread until the script ends; once the interpreter finalizes,
    Python ends it with ``pthread_exit`` inside a C++ destructor and the process dies of ``std::terminate``
    (SIGABRT, "terminate called without an active exception"), after all its work is done.
    ``destroy_process_group()`` alone does not prevent it: gloo's threads stop only when the group is freed, and torch
    keeps references to the default group once DDP has imported ``torch.distributed.nn``.

    At exit, while threads may still take the GIL, the handler destroys the default group (unless a run in this
    process failed: that rank leaves the group to its launcher), sleeping ``_EXIT_GRACE_S`` before and after, the GIL
    released, so gloo's threads finish freeing what they hold: before, because torch 2.6 joins them while destroying
    the group with the GIL held; after, for the threads that the destruction itself leaves freeing.
    """
    if not _process_exit.registered:
        atexit.register(_release_process_group)
        _process_exit.registered = True


def _release_process_group() -> None:
    try:
        if not _process_exit.a_run_failed and dist.is_available() and dist.is_initialized():
            # First let gloo's threads finish freeing the work of the last collectives, which takes the GIL: torch 2.6
            # joins those threads while destroying the group with the GIL held, and would wait for ever.
            time.sleep(_EXIT_GRACE_S)
            dist.destroy_process_group()
    finally:
        time.sleep(_EXIT_GRACE_S)


def _dataloader_index(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Which evaluation DataLoader a step's batch comes from: Lightning passes it only when there are several."""
    return int(args[2]) if len(args) > 2 else int(kwargs.get("dataloader_idx", 0))


def lightning_ddp_names(strategy_registry: Any, ddp_strategy: type) -> dict[str, dict[str, Any]]:
    """Lightning's registered names for its own ``DDPStrategy`` (``ddp``, ``ddp_spawn``, ...), with their settings.

    Args:
        strategy_registry: the registry of one Lightning namespace.
        ddp_strategy: that namespace's ``DDPStrategy``, which its registry names.
    """
    return {
        name: dict(strategy_registry[name]["init_params"])
        for name in strategy_registry.available_strategies()
        if name.startswith("ddp") and strategy_registry[name]["strategy"] is ddp_strategy
    }


class MGPUDDPLogic(MGPUStrategyMixin, LaunchCheck, _Base):
    """What ``mgpu_ddp`` does, bound to each Lightning namespace by a class that adds its ``DDPStrategy``."""

    bindings: ClassVar[Bindings[type[MGPUDDPLogic]]] = Bindings()

    strategy_name = "mgpu_ddp"

    def __init__(
        self,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        broadcast_buffers: bool = False,
        process_group_backend: str | None = None,
        timeout: timedelta | None = timedelta(minutes=30),
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        gradient_as_bucket_view: bool = False,
        uneven_batches: bool = False,
        gather_step_end: bool = False,
        forward_sync_buffers: bool | None = None,
        **kwargs: Any,
    ) -> None:
        check_strategy_keywords(type(self), kwargs)
        # None (checked), which leaves it to the strategy. Not kwargs.pop(name): jsonargparse would stop following
        # **kwargs into DDP, and the command line would refuse DDP's keywords.
        for name in _SET_BY_THE_STRATEGY:
            if name in kwargs:
                del kwargs[name]
        if uneven_batches and kwargs.get("model_averaging_period") is not None:
            raise ConfigurationError(
                "MGPUDDPStrategy(uneven_batches=True) cannot be combined with model_averaging_period: post-local SGD"
                " steps each rank on its own gradients, so the unequal last batches could not add up to one device's"
                " step. Remove model_averaging_period, or leave uneven_batches off.",
                setting="MGPUDDPStrategy.model_averaging_period",
            )
        if forward_sync_buffers is not None:
            broadcast_buffers = bool(forward_sync_buffers)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            find_unused_parameters=find_unused_parameters,
            static_graph=static_graph,
            gradient_as_bucket_view=gradient_as_bucket_view,
            **{buffer_sync_keyword(): broadcast_buffers},  # type: ignore[arg-type] # Lightning passes it to DDP
            **kwargs,
        )
        self.broadcast_buffers = broadcast_buffers
        self._uneven: UnevenTraining | None = None
        self.uneven_batches = uneven_batches
        self.gather_step_end = gather_step_end
        self._gathers: dict[str, RankGather] = {}
        self._health = StepHealth(self.strategy_name)
        self._lightnings_layer_sync: Any = None

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``mgpu_ddp`` and, for each of Lightning's DDP names, its ``mgpu_`` counterpart with its settings.

        ``mgpu_ddp_spawn`` is to ``mgpu_ddp`` what ``ddp_spawn`` is to ``ddp``, and so on for every name Lightning's
        registry gives its ``DDPStrategy`` (``start_method``, ``find_unused_parameters``), read from that registry
        so that the names always mean what Lightning's mean.
        """
        super().register_strategies(strategy_registry)
        namespace = namespace_of(cls)
        assert namespace is not None, "a strategy's binding has a Lightning base"
        for name, settings in lightning_ddp_names(strategy_registry, namespace.DDPStrategy).items():
            if name != "ddp":
                described = ", ".join(f"{key}={value!r}" for key, value in settings.items())
                strategy_registry.register(
                    f"mgpu_{name}", cls, description=f"{cls.__name__}({described})", override=True, **settings
                )

    @property
    def uneven_batches(self) -> bool:
        """Whether each optimizer step equals one device's on data the ranks do not divide (see the class)."""
        return self._uneven is not None

    @uneven_batches.setter
    def uneven_batches(self, uneven_batches: bool) -> None:
        if not uneven_batches:
            self._uneven = None
        elif self._uneven is None:
            self._uneven = UnevenTraining()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        module = self.lightning_module
        assert module is not None
        self._prepare_module(trainer, module)
        converter = layer_sync(self)
        if type(converter) is self._namespace.TorchSyncBatchNorm:
            # Lightning's converts into torch's SyncBatchNorm, which syncs GPU tensors only; ours syncs CPU ones too.
            self._lightnings_layer_sync = converter
            set_layer_sync(self, SyncBatchNormLayers(converter, self.root_device))
        if self._uneven is not None and trainer.state.fn == TrainerFn.FITTING:
            self._uneven.setup(trainer, module, converts_batchnorm_to_sync(self), self.root_device)
        super().setup(trainer)

    @override
    def teardown(self) -> None:
        self._release_module(self.lightning_module)
        if self._uneven is not None:
            self._uneven.teardown()
        super().teardown()
        if self._lightnings_layer_sync is not None:
            set_layer_sync(self, self._lightnings_layer_sync)
            self._lightnings_layer_sync = None

    @override
    def check_launch(self) -> None:
        """Process counts a launcher started that disagree with ``devices``/``num_nodes`` stop the Trainer's build."""
        check_launch_matches_trainer(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        # Lightning's CUDA accelerator pins this process to its card (torch.cuda.set_device) before the process
        # group, NCCL included, is created; DDP gets device_ids=[local rank], and output_device defaults to it.
        super().setup_environment()
        release_process_group_at_exit()
        category = self._namespace.PossibleUserWarning
        warnings.filterwarnings("ignore", message=_PADDED_EVALUATION_WARNING, category=category)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.world_size > 1 and self._health.wants("batchnorm"):
            assert self.lightning_module is not None
            self._health.check_batchnorm(self.lightning_module, "each rank's batch", self._batchnorm_fix())
        padding = self._uneven is not None and self._uneven.runs_padding_row(self._trainer())
        with stop_iteration_is_an_error("training_step"), caller_runs_step_end(), rows_not_counted(padding):
            output = super().training_step(*args, **kwargs)
            output = self._step_end("training_step", output, self._training_rows(args))
        if self._uneven is not None:
            self._uneven.undo_padding_step(self._trainer())
        self._health.check_loss(output, self._where)
        return output

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with stop_iteration_is_an_error("validation_step"), caller_runs_step_end():
            return self._evaluation_step("validation_step", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with stop_iteration_is_an_error("test_step"), caller_runs_step_end():
            return self._evaluation_step("test_step", args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with stop_iteration_is_an_error("predict_step"), caller_runs_step_end():
            return self._step_end("predict_step", super().predict_step(*args, **kwargs))

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        """Like Lightning's, but a mean of integers is taken in floating point instead of being truncated.

        Lightning's epoch-level ``sync_dist`` means divide the synced sum of values by the synced mean of the
        integer batch counts; on gloo that mean is truncated (ranks that saw 3 and 2 samples average to 2, not 2.5),
        which is wrong as soon as evaluation shards are uneven.

        With ``uneven_batches``, inside a training batch (where ``self.log(..., sync_dist=True)`` syncs its step
        values) a mean is weighted by each rank's real rows, and a rank whose batch is a padding row contributes
        nothing to a sum, maximum or minimum.
        """
        rows = None if self._uneven is None else self._uneven.rows_to_weight_by(self._trainer())
        if rows is not None and isinstance(tensor, torch.Tensor):
            return reduce_over_real_rows(tensor, rows, group, reduce_op, super().reduce)
        if isinstance(tensor, torch.Tensor) and not tensor.is_floating_point() and reduce_op_name(reduce_op) == "mean":
            tensor = tensor.to(torch.get_default_dtype())
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # noqa: A002 - Lightning's name
        """Lightning's: every rank's vote counts, padding row or not (checkpoint and early-stopping decisions)."""
        with contextlib.nullcontext() if self._uneven is None else self._uneven.unweighted():
            return super().reduce_boolean_decision(decision, all=all)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Give evaluation dataloaders a sampler that shards without padding, so each sample counts once.

        Training keeps the padding sampler (DDP needs every rank to run the same number of training steps) unless
        ``uneven_batches`` is on; then the training dataloader gets an ``UnevenShardSampler`` built from it.
        """
        if self._stage() in _EVALUATION_STAGES and is_padding_sampler(getattr(dataloader, "sampler", None)):
            sampler = dataloader.sampler  # type: ignore[attr-defined]
            if self._gathers_evaluation():
                stepped = evaluation_shards(dataloader, sampler)  # type: ignore[arg-type]
                return with_sampler(dataloader, stepped, self._namespace)  # type: ignore[arg-type]
            unpadded = EvenlyShardedSampler.like(sampler)
            return with_sampler(dataloader, unpadded, self._namespace)  # type: ignore[arg-type]
        if self._uneven is not None and self._stage() == RunningStage.TRAINING:
            dataloader = self._uneven.shard(dataloader)
        return super().process_dataloader(dataloader)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """With ``uneven_batches``: look up this step's real rows, and have logged values weighted by them."""
        super().on_train_batch_start(batch, batch_idx)
        trainer = self._trainer()
        if self._uneven is not None and trainer is not None:
            self._uneven.start_batch(trainer, batch, batch_idx)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Any:
        """With ``uneven_batches``, scale this rank's loss so DDP's average of gradients is one device's gradient.

        The factor (``UnevenTraining.loss_scale``) is 1 in full steps and 0 for a padding row, whose buffers are put
        back after its backward.
        """
        if self._uneven is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        trainer = self._trainer()
        # A loss over the gathered batch is the whole step's already, on every rank alike: nothing to scale.
        scale = None if self._gathers_now("training_step") else self._uneven.loss_scale(trainer, self.world_size)
        if scale is not None:
            closure_loss = closure_loss * scale
        try:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        finally:
            self._uneven.restore_padding_buffers(trainer)

    @override
    def on_validation_start(self) -> None:
        self._sync_buffers_for_evaluation()

    @override
    def on_test_start(self) -> None:
        self._sync_buffers_for_evaluation()

    @override
    def on_exception(self, exception: BaseException) -> None:
        _process_exit.a_run_failed = True
        if any(isinstance(arg, str) and is_unused_parameters_error(arg) for arg in exception.args):
            exception.args = (self._explain_unused_parameters(str(exception)),)
            return
        super().on_exception(exception)

    def _batchnorm_fix(self) -> str:
        """How to make BatchNorm layers train as on one device, with what this strategy's settings accept."""
        devices = self.parallel_devices
        if not self.uneven_batches or not devices or devices[self.local_rank].type == "cpu":
            return (
                "Pass Trainer(sync_batchnorm=True) to convert them to SyncBatchNorm, whose statistics span every"
                " rank's rows (on GPUs torch's own, on CPU processes the strategy's)."
            )
        return (
            "With uneven_batches=True on GPUs, use GroupNorm or LayerNorm, which normalise each row on its own (in"
            " the last step of an epoch a rank may hold a padding row, which torch's SyncBatchNorm would take into"
            " the statistics, so it is refused); or leave uneven_batches off and pass Trainer(sync_batchnorm=True)."
        )

    def _where(self) -> str:
        step = self.lightning_module.global_step if self.lightning_module is not None else 0
        return f"at step {step} on rank {self.global_rank}"

    def _step_end(self, step: str, output: Any, rows: int | None = None, total: int | None = None) -> Any:
        """The ``*_step_end`` hook gets this rank's output, or with ``gather_step_end`` every rank's, gathered.

        ``rows`` are this rank's real rows (0: a padding row, whose output is gathered but not merged) and ``total``
        the step's on every rank, by which values logged in the hook are weighted, as one device weights its batch.
        """
        module = self.lightning_module
        assert module is not None
        if rows is None or not self._gathers_now(step):
            return call_step_end(module, step, output)
        gathered = self._gathers.setdefault(step, RankGather(step))
        differentiable = step == "training_step" and torch.is_grad_enabled()
        output = gathered(output, rows, self.root_device, differentiable)
        with logged_batch_size(self._trainer(), total if total is not None else gathered.rows):
            return call_step_end(module, step, output)

    def _gathers_now(self, step: str) -> bool:
        """Whether ``step``'s outputs are gathered from every rank for its ``*_step_end`` hook."""
        module = self.lightning_module
        return (
            self.gather_step_end
            and step != "predict_step"
            and self.world_size > 1
            and module is not None
            and has_step_end(module, step)
        )

    def _gathers_evaluation(self) -> bool:
        """Whether the evaluation that runs now gathers, so its ranks run their batches in steps, together."""
        stage = self._stage()
        step = "test_step" if stage == RunningStage.TESTING else "validation_step"
        return self._gathers_now(step)

    def _training_rows(self, args: tuple[Any, ...]) -> int | None:
        """This rank's real rows in the training step that runs (0 for a padding row), where they are gathered."""
        if not self._gathers_now("training_step"):
            return None
        running = None if self._uneven is None else self._uneven.running(self._trainer())
        return running.rows if running is not None else batch_size_of(args[0])

    def _evaluation_step(self, step: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """An evaluation step and its ``*_step_end``; a rank whose batch is a padding row runs only the gather."""
        if not self._gathers_now(step):
            return self._step_end(step, self._evaluate(step, args, kwargs))
        shards = evaluation_shards_of(self._trainer(), step, _dataloader_index(args, kwargs))
        rows, total = shards.rows(args[1])
        output = self._evaluate(step, args, kwargs) if rows else NO_OUTPUT
        return self._step_end(step, output, rows, total)

    def _evaluate(self, step: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run an evaluation step on the module itself, never through the DDP wrapper.

        Evaluation needs no gradient sync, and without DDP's forward no rank waits on another, so ranks may run
        different numbers of evaluation batches (the price of counting each sample once).
        """
        module = self.lightning_module
        assert module is not None
        context = (
            self.precision_plugin.val_step_context
            if step == "validation_step"
            else self.precision_plugin.test_step_context
        )
        with context():
            return getattr(module, step)(*args, **kwargs)

    def _sync_buffers_for_evaluation(self) -> None:
        if not (self.broadcast_buffers and dist.is_available() and dist.is_initialized()):
            return
        module = self.lightning_module
        assert module is not None
        with torch.no_grad():
            for buffer in module.buffers():
                dist.broadcast(buffer, src=0)

    def _explain_unused_parameters(self, original: str) -> str:
        names = self._parameters_without_gradient(original)
        listed = ", ".join(names) if names else "(run with TORCH_DISTRIBUTED_DEBUG=DETAIL to have torch name them)"
        return (
            "DDP expected a gradient for every parameter, but these received none in the last step: "
            f"{listed}. Either make every parameter take part in the loss, or tell DDP to look for unused ones:"
            " strategy=lightning_mgpu.MGPUDDPStrategy(find_unused_parameters=True) (slower: it walks the graph"
            " every step), or static_graph=True when the same parameters are unused in every step. In YAML:"
            " trainer.strategy: {class_path: lightning_mgpu.MGPUDDPStrategy,"
            " init_args: {find_unused_parameters: true}}."
            f"\n\nThe original error from torch:\n{original}"
        )

    def _parameters_without_gradient(self, original: str) -> list[str]:
        module = self.lightning_module
        if module is None:
            return []
        trainable = [name for name, parameter in module.named_parameters() if parameter.requires_grad]
        return [trainable[index] for index in unused_parameter_indices(original) if index < len(trainable)]


@bind_strategy
class MGPUDDPStrategy(MGPUDDPLogic, LightningDDPStrategy):
    """One process per device, gradients all-reduced by ``DistributedDataParallel``, with the classic recipe built in.

    Compared with Lightning's ``"ddp"``: on CUDA the process's device is set from its local rank before the process
    group starts and DDP gets ``device_ids=[device]`` and ``output_device=device``; buffers are not broadcast on
    every forward (the recipe's ``broadcast_buffers=False``) unless ``broadcast_buffers=True``; the ``*_step_end``
    hooks run after every rank's step with that rank's output, so one LightningModule runs unchanged under
    ``mgpu_dp`` and ``mgpu_ddp``; validation and test count every sample exactly once (no padding duplicates);
    DDP's unused-parameter error names the parameters; a rank whose script ends after ``fit`` exits cleanly
    (:func:`release_process_group_at_exit`); under torchrun, SLURM or a hand-made launch, process counts that
    disagree with ``devices``/``num_nodes`` raise ``ConfigurationError`` on every rank while the Trainer is built
    (:func:`~lightning_mgpu.strategies.launch_checks.check_launch_matches_trainer`) instead of hanging.

    Args:
        accelerator: the accelerator; Lightning sets it from ``Trainer(accelerator=...)`` when left ``None``.
        parallel_devices: the devices of this node, one process each; from ``Trainer(devices=...)`` when ``None``.
        cluster_environment: where ranks come from (torchrun, SLURM, Lightning's launcher); detected when ``None``.
        checkpoint_io: how checkpoints are written and read; Lightning's default when ``None``.
        precision_plugin: the precision plugin.
        broadcast_buffers: broadcast buffers from rank 0 before every forward (and before evaluation); off by
            default, as in the classic recipe. Passed to DDP under the keyword the installed torch takes.
        process_group_backend: ``"nccl"``, ``"gloo"``, ...; the device's default when ``None``.
        timeout: how long a collective may wait for the other ranks before it fails, so a rank that died makes
            the others exit instead of hanging.
        start_method: ``"popen"`` (Lightning re-runs the script per rank), ``"spawn"``, ``"fork"`` or
            ``"forkserver"``.
        find_unused_parameters: let DDP find parameters that get no gradient in a step (slower); named here, not
            left to ``**kwargs``, so YAML configs can set it.
        static_graph: tell DDP the set of used parameters never changes between steps.
        gradient_as_bucket_view: let gradients alias DDP's communication buckets, saving memory.
        uneven_batches: train on every sample exactly once per epoch, with each optimizer step equal to one device
            stepping on the union of the ranks' batches (:class:`~lightning_mgpu.strategies.samplers.
            UnevenShardSampler`): the last step's rows are split unevenly, a rank left without a row runs a padding
            row that counts for nothing, and the losses, gradients and ``self.log(..., sync_dist=True)`` means are
            weighted by each rank's real rows. The loss ``training_step`` (or ``training_step_end``) returns must be
            the mean over its batch's rows. The order is the one the DataLoader was built for (``shuffle=False``
            keeps the dataset's, which Lightning's own sampler would shuffle); what cannot be made exact
            (:mod:`~lightning_mgpu.strategies.uneven_checks`) raises ``ConfigurationError`` on every rank before the
            first step. Off by default: training then uses Lightning's ``DistributedSampler``, which pads the last
            shards with duplicate samples.
        gather_step_end: give every rank's ``training_step_end``, ``validation_step_end`` and ``test_step_end``
            every rank's step output, merged in batch order as ``mgpu_dp`` merges its replicas'
            (:mod:`~lightning_mgpu.strategies.rank_gather`); in training the gather is differentiable, so a loss over
            the whole batch, written as for one device, gets one device's gradients. Outputs that cannot be gathered
            raise ``GatherError`` on every rank at the first step. Costs each rank the world size times its outputs
            (and their gradient). Off by default: each rank's hook gets its own output.
        forward_sync_buffers: torch 2.13's name for ``broadcast_buffers``, taken on any torch; it wins when given.
        **kwargs: passed to ``DistributedDataParallel`` (``bucket_cap_mb``, ...); ``ddp_comm_state``,
            ``ddp_comm_hook``, ``ddp_comm_wrapper`` and ``model_averaging_period`` go to Lightning's DDP strategy.
            A keyword that neither takes (read from the installed torch and Lightning) raises ``ConfigurationError``
            here, naming the closest one taken, instead of failing every rank in ``setup``; so do ``module``,
            ``device_ids`` and ``output_device``, which the strategy sets (``None`` is taken and left to it).
    """
