"""mgpu_ddp's ``*_step_end`` hooks on each rank's rows, and on every rank's rows as ``gather_step_end=True`` gives them.

The probe batch stands for one global batch and each of its chunks for a rank, every rank holding as many rows, as
DDP's sampler gives them (rows past a multiple of the ranks are left out). Each rank runs the step on its chunk and
the hook on its own output, as ``mgpu_ddp`` does by default; DDP averages the ranks' gradients, so training follows
the mean of the ranks' losses, and ``self.log(..., sync_dist=True)`` combines what they log. With
``MGPUDDPStrategy(gather_step_end=True)`` the hook receives every rank's output gathered in batch order, as
``mgpu_dp`` gathers its replicas'; the doctor runs it once, on the module that ran the step on the whole batch.
Both ways take the same step outputs, as leaves with gradients, so whatever differs between them is the hook's own;
the step itself is judged by the runs of ``runs``.
"""

from __future__ import annotations

import copy
import inspect
import numbers
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import lightning.pytorch as pl
import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torchmetrics import Metric

from lightning_mgpu.doctor.runs import STEP_OUTPUT, fresh_copy, quiet_unattached_logging, seed_all
from lightning_mgpu.engine.gather import gather
from lightning_mgpu.engine.scatter import batch_size_of, field_values, is_dataclass_instance, scatter
from lightning_mgpu.errors import BatchSplitError, GatherError
from lightning_mgpu.namespaces import LIGHTNING, namespace_of
from lightning_mgpu.step.hooks import STEP_END_HOOKS, caller_runs_step_end, find_loss
from lightning_mgpu.step.replica_log import ReplicaLog, reduction, replay

_CPU = torch.device("cpu")


@dataclass
class HookResult:
    """What a ``*_step_end`` hook gave: its loss, the loss's gradients and what it logged.

    Attributes:
        loss: the loss, detached; ``None`` outside training or without a scalar loss.
        grads: the loss's gradients to the hook's input, by key path (``step output['image']``, every rank's rows
            flattened in batch order), and to the parameters the hook reads, by name; zeros where one way gives
            none and the other does.
        logged: what the hook passed to ``self.log``, by name (tensors and numbers; metrics sync themselves).
    """

    loss: torch.Tensor | None = None
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    logged: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class RankRuns:
    """One ``*_step_end`` hook on every rank's rows and on each rank's own.

    Attributes:
        hook: the hook's name.
        rows: the rows each rank held.
        loss_path: where the loss is in the hook's result; ``None`` outside training or without a loss.
        gathered: the hook on every rank's output gathered, as with ``gather_step_end=True``.
        ranks: the hook on each rank's own output: the losses and their gradients averaged over the ranks, as DDP
            averages gradients, and each logged name combined as ``self.log(..., sync_dist=True)`` combines it.
        failed: the ranks whose hook raised, with what it raised (``ranks`` is then empty).
    """

    hook: str
    rows: list[int]
    loss_path: str | None
    gathered: HookResult
    ranks: HookResult
    failed: list[tuple[int, BaseException]] = field(default_factory=list)


def run_ranks(model: pl.LightningModule, batch: Any, step: str, seed: int, ranks: int) -> RankRuns | str:
    """Run ``step`` on each rank's rows and its hook both ways; or say why the hook could not be run both ways."""
    hook = STEP_END_HOOKS[step]
    unchecked = f"{hook} was not run on each rank's rows and on every rank's:"
    training = step == "training_step"
    try:
        cut, rows = _equal_shares(batch, ranks)
    except BatchSplitError as error:
        return f"{unchecked} {error}"
    if len(rows) < 2:
        return f"{unchecked} the probe batch has fewer rows than the {ranks} ranks."
    with quiet_unattached_logging(), torch.set_grad_enabled(training):
        try:
            chunks, _ = scatter(cut, [_CPU] * ranks)
            stepped = [_step(model, chunk, step, seed, training) for chunk in chunks]
            one_device, _ = _step(model, cut, step, seed, training)
        except Exception as error:
            return f"{unchecked} {step} raised on the probe batch ({_describe(error)})."
        inputs = [apply_to_collection(output, torch.Tensor, _leaf, training) for _, output in stepped]
        try:
            together = gather(inputs, _CPU, rows)
        except GatherError as error:
            return f"{unchecked} the ranks' outputs of {step} cannot be gathered ({error})."
        gathered = _call(one_device, hook, together, seed, 0, sum(rows))
        if gathered.error is not None:
            return f"{unchecked} it raised on every rank's rows ({_describe(gathered.error)})."
        calls = [_call(module, hook, inputs[rank], seed, rank, rows[rank]) for rank, (module, _) in enumerate(stepped)]
    failed = [(rank, call.error) for rank, call in enumerate(calls) if call.error is not None]
    if failed:
        return RankRuns(hook, rows, None, HookResult(), HookResult(), failed)
    whole = HookResult(logged=_combined([gathered.log]))
    each = HookResult(logged=_combined([call.log for call in calls]))
    loss_path, loss = find_loss(gathered.result) if training else (None, None)
    losses = [call.loss_at(loss_path) for call in calls]
    if not isinstance(loss, torch.Tensor) or not all(_scalar(value) for value in [loss, *losses]):
        return RankRuns(hook, rows, loss_path if _scalar(loss) else None, whole, each)
    averaged = torch.stack([value.reshape(()) for value in losses]).mean()  # DDP averages the ranks' gradients
    leaves = [(path, tensor) for one in inputs for path, tensor in _tensor_leaves(one, STEP_OUTPUT)]
    whole.loss, whole.grads = loss.detach(), _gradients(loss, leaves, [one_device])
    each.loss, each.grads = averaged.detach(), _gradients(averaged, leaves, [module for module, _ in stepped])
    for one, other in ((whole, each), (each, whole)):
        for name, grad in other.grads.items():
            one.grads.setdefault(name, torch.zeros_like(grad))  # what one way gives no gradient, the other does
    return RankRuns(hook, rows, loss_path, whole, each)


@dataclass
class _Call:
    """One call of the hook: its result, what it logged, or what it raised."""

    result: Any = None
    log: ReplicaLog = field(default_factory=lambda: ReplicaLog(0, 0))
    error: BaseException | None = None

    def loss_at(self, path: str | None) -> Any:
        found, loss = find_loss(self.result)
        return loss if found == path else None


def _equal_shares(batch: Any, ranks: int) -> tuple[Any, list[int]]:
    """The batch cut to a multiple of ``ranks`` rows, as DDP's sampler gives every rank as many, and the shares."""
    rows = batch_size_of(batch)
    share = rows // ranks
    if share == 0:
        return batch, []
    if share * ranks < rows:
        batch = scatter(batch, [_CPU] * 2, weights=[share * ranks, rows - share * ranks])[0][0]
    return batch, [share] * ranks


def _step(model: pl.LightningModule, rows: Any, step: str, seed: int, training: bool) -> tuple[Any, Any]:
    """A fresh copy of ``model`` after ``step`` on ``rows``, and the step's output."""
    module = fresh_copy(model, training)
    seed_all(seed)
    with caller_runs_step_end():
        output = getattr(module, step)(copy.deepcopy(rows), 0)
    return module, output


def _leaf(tensor: torch.Tensor, training: bool) -> torch.Tensor:
    leaf = tensor.detach().clone()
    return leaf.requires_grad_() if training and leaf.is_floating_point() else leaf


def _call(module: pl.LightningModule, hook: str, inputs: Any, seed: int, rank: int, rows: int) -> _Call:
    namespace = namespace_of(type(module)) or LIGHTNING
    log = ReplicaLog(rank, rows, namespace)
    module.log = _recording_log(module, log)  # type: ignore[method-assign]
    seed_all(seed)
    try:
        return _Call(getattr(module, hook)(inputs), log)
    except Exception as error:
        return _Call(log=log, error=error)


def _recording_log(module: pl.LightningModule, log: ReplicaLog) -> Any:
    """``self.log`` for the doctor's copy: records scalars with their options, as Lightning would log them."""
    signature = inspect.signature(type(module).log)

    def record(*args: Any, **kwargs: Any) -> None:
        try:
            options = signature.bind(module, *args, **kwargs).arguments
        except TypeError:
            return
        name, value = options.pop("name"), options.pop("value")
        options.pop("self", None)
        if isinstance(value, Metric) or not isinstance(value, (torch.Tensor, numbers.Number)):
            return
        if isinstance(value, torch.Tensor) and value.numel() != 1:
            return
        try:
            reduction(name, options.get("reduce_fx", "mean"), log.index, log.namespace)
        except Exception:
            return
        log.records.append((name, value.detach() if isinstance(value, torch.Tensor) else value, options))

    return record


class _Logged(dict[str, torch.Tensor]):
    """Receives what ``replay`` logs: one value per name."""

    def log(self, name: str, value: Any, **kwargs: Any) -> None:
        self[name] = torch.as_tensor(value).detach().to(torch.float64).reshape(())


def _combined(logs: list[ReplicaLog]) -> dict[str, torch.Tensor]:
    """Each logged name's values combined over ``logs``, as ``mgpu_dp`` combines replicas' and ``sync_dist`` ranks'."""
    logged = _Logged()
    replay(logs, cast(Any, logged), _CPU, lambda value, index: None)
    return dict(logged)


def _scalar(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point()


def _tensor_leaves(value: Any, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of ``value`` that take gradients, by key path."""
    if isinstance(value, torch.Tensor):
        if value.requires_grad:
            yield path, value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _tensor_leaves(item, f"{path}[{key!r}]")
    elif is_dataclass_instance(value):
        for name, item in field_values(value):
            yield from _tensor_leaves(item, f"{path}.{name}")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _tensor_leaves(item, f"{path}[{index}]")


def _gradients(
    loss: torch.Tensor, leaves: list[tuple[str, torch.Tensor]], modules: list[pl.LightningModule]
) -> dict[str, torch.Tensor]:
    """``loss``'s gradients to the leaves and to the parameters of ``modules``; names given none are left out.

    The rows of every rank of a leaf's path are flattened in batch order; a parameter's gradients are summed over
    ``modules``, one per rank.
    """
    parameters = [(name, p) for module in modules for name, p in module.named_parameters() if p.requires_grad]
    tensors = [tensor for _, tensor in leaves] + [parameter for _, parameter in parameters]
    if not loss.requires_grad or not tensors:
        return {}
    grads = torch.autograd.grad(loss, tensors, allow_unused=True)
    found: dict[str, list[torch.Tensor]] = {}
    touched: set[str] = set()
    for (name, tensor), grad in zip([*leaves, *parameters], grads, strict=True):
        found.setdefault(name, []).append(torch.zeros_like(tensor) if grad is None else grad.detach())
        if grad is not None:
            touched.add(name)
    inputs = {path for path, _ in leaves}
    return {
        name: torch.cat([grad.reshape(-1) for grad in parts]) if name in inputs else torch.stack(parts).sum(0)
        for name, parts in found.items()
        if name in touched
    }


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"
