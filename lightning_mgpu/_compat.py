"""The one place that touches private torch, Lightning, torchmetrics and jsonargparse API; each use says why, is tested.

Everything else in the package uses public API only. When a supported release changes one of these, this module
and ``tests/test_compat.py`` are what change. The module imports nothing from Lightning at import time, so the
engine, which never imports Lightning, can use its torch part.

torch:
    A replica must behave like the module it copies, and torch gives no public way to copy three kinds of module
    state: a module's own replication hook (RNNs keep caches of their weights), the forward that
    ``torch.compile(module)`` binds to the module it wraps, and the call that ``module.compile()`` binds to the
    module itself. Nor does it say which attributes its forward pre-hooks rewrite (``weight_norm``'s ``weight``),
    or cheaply whether a thread has any torch function mode active (``parallel_apply`` asks every step), or whether a
    tensor was changed in place (its version counter), and before
    torch 2.8 its ``get_default_device`` misses ``with torch.device(...)`` blocks. BatchNorm
    over the whole batch needs the BatchNorm base class, which torch does not export, and whether a module was
    compiled with ``fullgraph=True``, which only its compile context says. A replica
    of a LightningModule is built without ``.to()``, so its device is set where ``.to()`` keeps it. DDP explains
    parameters that got no gradient only in the text of its error. (A module's registries ``_parameters``,
    ``_buffers`` and ``_modules``, which ``engine/replicate.py`` fills for each replica as torch's own ``replicate``
    does, are treated as nn.Module's stable interface, like ``torch.nn.utils.stateless``; tests/test_replicate.py
    covers them.)

Lightning and torchmetrics:
    ``mgpu_ddp`` checks a launcher's process counts in ``_configure_launcher``, the hook Lightning calls once the
    cluster environment, the devices and ``num_nodes`` are known and before its own launcher checks run
    (``LaunchCheck``, covered by the Trainer-building tests of ``tests/test_launch_mismatch.py``), and removes the
    ``forward`` attribute Lightning's DDP strategy leaves on a module. Exact resume needs what Lightning does not
    checkpoint (the epoch's logged aggregates, the position in the epoch, whether an epoch of unknown length has run
    out) and what torchmetrics keeps out of the state dict (a metric's update count), a faithful copy of a
    DataLoader with another sampler, which only Lightning's private ``_update_dataloader`` builds, and the saved
    states of stateful DataLoaders, which Lightning drops when the data is set up before the checkpoint's loops are
    loaded. ``MGPUDDPStrategy(uneven_batches=True)`` weights
    logged values by the real rows of each rank's batch, which Lightning reads from its private result collection,
    and keeps the padding row out of epoch sums, maxima and minima kept there. It also judges the training
    DataLoader as the user's code built it, which only the fit loop's private data source returns. A metric merged
    from the replicas' copies of it must count one update per call and drop the value ``compute`` cached, and the
    value Lightning logs for it per step is the one torchmetrics keeps from its last call: three private fields.
    Whether torchmetrics' own code or the step's calls a copy's ``compute`` is read from the calling frame.

jsonargparse:
    Its errors name the config key, the class paths and a rejected option they concern only in their text, which
    the command line reads to say which class path does not import and why, and which setting was meant.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib
import inspect
import re
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Sampler

if TYPE_CHECKING:
    from lightning_mgpu.namespaces import Namespace

try:  # torch.compile's module wrapper; absent where dynamo is not built in
    from torch._dynamo.eval_frame import OptimizedModule
except ImportError:  # pragma: no cover - every supported torch has it
    OptimizedModule = None  # type: ignore[assignment,misc]

# ---------------------------------------------------------------------------------------------------------- torch


def has_own_replication(module: nn.Module) -> bool:
    """Whether ``module``'s class overrides ``nn.Module._replicate_for_data_parallel`` (RNNs do, for their caches)."""
    return type(module)._replicate_for_data_parallel is not nn.Module._replicate_for_data_parallel


def own_replica(module: nn.Module) -> nn.Module:
    """``module``'s own DataParallel replica: a shallow copy with the class's private caches copied too.

    ``_replicate_for_data_parallel`` is the hook torch's ``replicate`` calls; only classes that override it (checked
    by ``has_own_replication``) get here, because nn.Module's own version writes through ``__setattr__``, which
    classes such as torch.compile's wrapper redirect into the module they wrap.
    """
    return module._replicate_for_data_parallel()


def is_compiled_wrapper(module: nn.Module) -> bool:
    """Whether ``module`` is the wrapper that ``torch.compile(module)`` returns."""
    return OptimizedModule is not None and isinstance(module, OptimizedModule)


def bind_compiled_wrapper(shell: nn.Module) -> None:
    """Point a replica of ``torch.compile(module)``'s wrapper at the replica of the wrapped module.

    The wrapper keeps a ``forward`` bound to the module it wrapped; ``_initialize`` is what binds it, in the wrapper's
    constructor and after unpickling, so calling it again on the replica binds the replica's own copy.
    """
    shell._initialize()  # type: ignore[operator]


COMPILED_CALL = "_compiled_call_impl"
"""Where ``module.compile()`` keeps the compiled call that ``nn.Module.__call__`` then runs instead of its own."""

REPLICA_FLAG = "_is_replica"
"""The instance attribute torch's ``replicate`` sets on every replica: ``zero_grad()`` on a module that has it
warns that it has no effect, as on a replica of ``torch.nn.DataParallel``."""


def compiled_call(module: nn.Module) -> Callable[..., Any] | None:
    """The compiled call that ``module.compile()`` installed, or ``None`` for a module compiled in no such way."""
    return module.__dict__.get(COMPILED_CALL)


def set_compiled_call(shell: nn.Module, call: Callable[..., Any] | None) -> None:
    """Make ``shell`` (a replica's shell) run ``call`` as ``module.compile()`` would have it, or its own forward."""
    shell.__dict__[COMPILED_CALL] = call


alias: Callable[[torch.Tensor], torch.Tensor] = torch.ops.aten.alias.default._op
"""``aten.alias``: a tensor sharing its input's storage, whose backward passes the gradient through untouched.

The builtin behind the overload (private ``_op``), called without the Python frame of ``OpOverload.__call__``, which
only forwards to it."""


def recompile_call(compiled: Callable[..., Any], shell: nn.Module) -> Callable[..., Any] | None:
    """``compiled`` (from ``module.compile(...)``) applied to ``shell`` with the same compiler settings.

    ``torch.compile(fn, ...)`` returns a wrapper whose closure holds the compile context (backend, mode, options)
    as ``self``; applying that context to the replica's own ``_call_impl`` is what ``shell.compile(...)`` with the
    original arguments would do. Returns ``None`` when the context cannot be found (a torch that builds the wrapper
    differently), so the caller can fall back to running the replica uncompiled.
    """
    context = _compile_context(compiled)
    if context is None:
        return None
    rebound = context(shell._call_impl)
    return rebound if callable(rebound) else None


def _compile_context(compiled: Callable[..., Any]) -> Callable[..., Any] | None:
    """The compile context (backend, mode, options) that the wrapper ``torch.compile(fn, ...)`` returned holds."""
    code = getattr(compiled, "__code__", None)
    closure = getattr(compiled, "__closure__", None)
    if code is None or closure is None or "self" not in code.co_freevars:
        return None
    context = closure[code.co_freevars.index("self")].cell_contents
    return context if callable(context) else None


def compiled_with_fullgraph(module: nn.Module) -> bool:
    """Whether ``module`` is ``torch.compile(..., fullgraph=True)``'s wrapper or was compiled in place so.

    A fullgraph compile refuses any break in its graph. Both ways of compiling keep their settings in the compile
    context, which torch does not expose: the wrapper holds it as ``dynamo_ctx``, ``module.compile()`` in the
    closure of the call it installs. Newer torch names the setting ``fullgraph`` there; every supported torch also
    marks the context's frame callback as making one graph (``_one_graph``).
    """
    if is_compiled_wrapper(module):
        context = getattr(module, "dynamo_ctx", None)
    else:
        compiled = compiled_call(module)
        context = None if compiled is None else _compile_context(compiled)
    one_graph = getattr(getattr(context, "callback", None), "_one_graph", False)
    return bool(getattr(context, "fullgraph", False) or one_graph)


def names_rewritten_by_hooks(module: nn.Module, owned: Callable[[type], bool]) -> set[str]:
    """Attributes that forward pre-hooks of classes accepted by ``owned`` rewrite before every forward.

    ``weight_norm``, ``spectral_norm`` and ``torch.nn.utils.prune`` replace a parameter by a plain tensor attribute
    that their hook object recomputes from registered state; the hook object names that attribute in one of its
    string fields (``name``, ``_tensor_name``). The hooks live in the private ``_forward_pre_hooks``.
    """
    names: set[str] = set()
    for hook in module._forward_pre_hooks.values():
        owner = getattr(hook, "__self__", hook)
        if owned(type(owner)) and hasattr(owner, "__dict__"):
            names.update(value for value in vars(owner).values() if isinstance(value, str))
    return names


_TORCH_VERSION = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
_GET_DEFAULT_DEVICE_SEES_CONTEXTS = _TORCH_VERSION >= (2, 8)


def default_device() -> torch.device:
    """The device that tensors made without one land on in this thread, as ``torch.get_default_device()`` says it.

    Before torch 2.8, ``torch.get_default_device()`` reads only ``torch.set_default_device``'s setting and misses a
    ``with torch.device(...)`` block, which is a ``DeviceContext`` on this thread's torch function mode stack; both the
    stack and ``DeviceContext`` are private. Later torch walks the stack itself.
    """
    if not _GET_DEFAULT_DEVICE_SEES_CONTEXTS:
        from torch.overrides import _get_current_function_mode_stack
        from torch.utils._device import DeviceContext

        for mode in reversed(_get_current_function_mode_stack()):
            if isinstance(mode, DeviceContext):
                device = mode.device
                return device if device.index is not None else torch.empty(0).device
    return torch.get_default_device()


function_mode_depth: Callable[[], int] = torch._C._len_torch_function_stack
"""How many torch function modes are active on this thread: a C call, cheap enough to ask every step."""


def version_counter(tensor: torch.Tensor) -> int:
    """How many times ``tensor`` was changed in place: autograd's version counter, which torch keeps private.

    Replicas share a module's plain tensor attributes; a change of this count during a call shows that one changed it.
    A tensor made in inference mode keeps no count (torch before 2.8 raises when asked): it reads as ``-1``, always.
    """
    if tensor.is_inference():
        return -1
    return int(tensor._version)


BatchNorm = nn.modules.batchnorm._BatchNorm
"""The base class of ``BatchNorm1d/2d/3d`` and ``SyncBatchNorm`` (lazy ones too), which torch does not export."""


def compiled_original(module: nn.Module) -> nn.Module:
    """The module inside ``torch.compile(module)``'s wrapper, kept as ``_orig_mod``, which has no public accessor."""
    original = module._orig_mod
    assert isinstance(original, nn.Module)
    return original


def set_lightning_device(module: nn.Module, device: torch.device) -> None:
    """Make a LightningModule replica's ``device`` property say ``device``.

    The property reads ``_device``, which Lightning's ``.to()`` keeps up to date; a replica is never moved with
    ``.to()`` (its tensors are made on its device), so the attribute is set on the replica directly.
    """
    if vars(module).get("_device", device) != device:
        module.__dict__["_device"] = device


_DDP_UNUSED_PARAMETERS = re.compile(r"Expected to have finished reduction in the prior iteration")
_DDP_UNUSED_INDICES = re.compile(r"Parameter indices which did not receive grad for rank \d+: ([\d ]+)")


def is_unused_parameters_error(message: str) -> bool:
    """Whether ``message`` is DDP's error for parameters that received no gradient in the previous step."""
    return _DDP_UNUSED_PARAMETERS.search(message) is not None


def unused_parameter_indices(message: str) -> list[int]:
    """The indices, among the trainable parameters, that DDP's error names; empty when it names none.

    torch lists them only at ``TORCH_DISTRIBUTED_DEBUG=INFO`` or more, and only as positions, not names.
    """
    match = _DDP_UNUSED_INDICES.search(message)
    return [int(index) for index in match.group(1).split()] if match else []


# ---------------------------------------------------------------------------------- Lightning and torchmetrics


class LaunchCheck:
    """A strategy base that runs ``check_launch()`` from Lightning's private ``_configure_launcher`` hook.

    Lightning calls that hook while building the Trainer, once the cluster environment, the devices and
    ``num_nodes`` are known and before its own launcher checks run: the earliest point to catch a launcher that
    started other process counts, before any rank waits on another. Put it before Lightning's strategy class.
    """

    def check_launch(self) -> None:
        """What the strategy checks before Lightning configures its launcher."""

    def _configure_launcher(self) -> None:
        self.check_launch()
        super()._configure_launcher()  # type: ignore[misc]


def drop_forward_left_by_lightning(module: Any) -> None:
    """Remove the ``forward`` attribute Lightning's DDP strategy leaves on ``module`` when it undoes its redirection.

    Lightning routes each DDP step through the module's ``forward`` by setting an instance attribute, and undoing that
    sets the class's own ``forward``, bound to the module, as an attribute; nothing public removes it, and a module
    that keeps it no longer sees a ``forward`` a subclass or a later strategy changes.
    """
    forward = module.__dict__.get("forward")
    own_forward = getattr(type(module), "forward", None)
    if getattr(forward, "__self__", None) is module and getattr(forward, "__func__", None) is own_forward:
        del module.__dict__["forward"]


def batches_done_in_epoch(trainer: Any) -> int:
    """How many training batches of the current epoch have run, counted by the fit loop's progress tracker.

    The loop's progress objects are not documented API; ``processed`` also counts the batch whose
    ``on_train_batch_end`` is running.
    """
    return int(getattr(trainer.fit_loop.epoch_loop.batch_progress.current, "processed", 0))


def last_batch_started(trainer: Any) -> bool:
    """Whether the current epoch's last training batch has started, by the fit loop's progress tracker.

    For a training DataLoader without a length (an ``IterableDataset``'s) it is the only sign that an epoch has run
    out: the fit loop learns it by fetching one batch ahead and keeps it in a private progress field.
    """
    return bool(getattr(trainer.fit_loop.epoch_loop.batch_progress, "is_last_batch", False))


def saved_dataloader_states(checkpoint: dict[str, Any]) -> list[Any]:
    """The states of the stateful training DataLoaders that Lightning saved in ``checkpoint``, in the loaders' order.

    Lightning keeps them under the fit loop's entry of its loops' state (``_FitLoop.on_save_checkpoint``) and hands
    them back only when the data is set up after the loops are loaded, which ``trainer.estimated_stepping_batches``
    in ``configure_optimizers`` reverses; the checkpoint's layout is Lightning's own, not documented API.
    """
    fit_loop = checkpoint.get("loops", {}).get("fit_loop", {})
    return list(fit_loop.get("state_dict", {}).get("combined_loader", []))


def with_sampler(dataloader: DataLoader, sampler: Sampler, namespace: Namespace) -> DataLoader:
    """A copy of ``dataloader`` that draws its indices from ``sampler``, made by ``namespace``'s Lightning.

    A DataLoader's sampler cannot be replaced after construction, and rebuilding one faithfully (custom subclasses,
    their init arguments, batch samplers) is what Lightning's private ``_update_dataloader`` does when it injects its
    own distributed samplers. Reusing it keeps our copy exactly as faithful as Lightning's.
    """
    update_dataloader = importlib.import_module(f"{namespace.name}.utilities.data")._update_dataloader
    return update_dataloader(dataloader, sampler)


def watch_training_data(trainer: Any, seen: Callable[[Any], None]) -> Callable[[], None]:
    """Hand ``seen`` the training data each time the fit loop fetches it, before Lightning rebuilds any DataLoader.

    The fit loop fetches the training data from its private data source (the dataloaders given to ``fit``, or the
    ``train_dataloader`` hook of the LightningModule or LightningDataModule) and then rebuilds each DataLoader around
    its ``DistributedSampler``, which loses what the DataLoader was built with: a sampler of one's own is dropped, a
    plain ``BatchSampler`` can become ``batch_size=1``. Only the fetched data still shows them, and no public hook
    receives it. ``seen`` must not raise: the fetch runs while Lightning has ``DataLoader.__init__`` patched, and
    the patch is undone only when the fetch returns.

    Returns:
        A function that stops watching and leaves the data source as it was.
    """
    source = trainer.fit_loop._data_source
    fetch = source.dataloader

    def fetch_and_show() -> Any:
        data = fetch()
        seen(data)
        return data

    source.dataloader = fetch_and_show

    def stop() -> None:
        if vars(source).get("dataloader") is fetch_and_show:
            del source.dataloader

    return stop


def training_results_state(trainer: Any) -> list[dict[str, Any]]:
    """The running epoch aggregates of the values logged in training so far (sums, counts, max, min).

    Lightning keeps them in the training loop's private ``_ResultCollection`` and does not checkpoint them, so a run
    resumed mid-epoch would report epoch metrics over the resumed part only. Each entry keeps what
    ``_ResultCollection.log`` needs to rebuild it.
    """
    entries = []
    for metric in trainer.fit_loop.epoch_loop._results.values():
        meta = metric.meta
        if not metric.is_tensor or meta.sync.group is not None:
            continue  # torchmetrics objects keep their own state; process groups cannot be saved
        entries.append(
            {
                "fx": meta.fx,
                "name": meta.name,
                "options": {
                    "prog_bar": meta.prog_bar,
                    "logger": meta.logger,
                    "on_step": meta.on_step,
                    "on_epoch": meta.on_epoch,
                    "reduce_fx": meta.reduce_fx.__name__,
                    "enable_graph": meta.enable_graph,
                    "add_dataloader_idx": meta.add_dataloader_idx,
                    "metric_attribute": meta.metric_attribute,
                    "sync_dist": meta.sync.should,
                    "rank_zero_only": meta.sync.rank_zero_only,
                },
                "value": metric.value.detach().cpu(),
                "count": metric.cumulated_batch_size.cpu() if meta.is_mean_reduction else None,
            }
        )
    return entries


def restore_training_results(trainer: Any, entries: list[dict[str, Any]]) -> None:
    """Log ``entries`` once, so the epoch aggregates continue from where the interrupted run stopped.

    Call it at the start of the first resumed batch: Lightning clears the aggregates at the first ``self.log`` of a
    run's first batch (it takes that batch for an epoch's first), so that clearing is switched off here too.
    """
    results = trainer.fit_loop.epoch_loop._results
    if entries:
        trainer._logger_connector._first_loop_iter = False
    for entry in entries:
        value, count = entry["value"], entry["count"]
        if count is not None:  # a mean: one logged value of the right weight adds back the sum and the count
            if int(count) == 0:
                continue
            value, batch_size = value / count, int(count)
        else:
            batch_size = 1
        results.log(
            entry["fx"],
            entry["name"],
            value.to(trainer.strategy.root_device),
            sync_dist_fn=trainer.strategy.reduce,
            batch_size=batch_size,
            **entry["options"],
        )


def metric_states(module: Any) -> dict[str, dict[str, Any]]:
    """The accumulated state of every torchmetrics ``Metric`` inside ``module``, by module path.

    A metric's states are not in the checkpoint (torchmetrics registers them as non-persistent), so a run resumed
    mid-epoch would compute its epoch value over the resumed batches only. ``metric_state`` is public; the number of
    updates, which some metrics read in ``compute``, is the private ``_update_count``.
    """
    from torchmetrics import Metric

    states = {}
    for name, metric in module.named_modules():
        if isinstance(metric, Metric):
            state = {key: _detached(value) for key, value in metric.metric_state.items()}
            states[name] = {"state": state, "updates": int(metric._update_count)}
    return states


def restore_metric_states(module: Any, states: dict[str, dict[str, Any]]) -> None:
    """Put back what ``metric_states`` returned, on the metrics' own devices."""
    from torchmetrics import Metric

    metrics = {name: metric for name, metric in module.named_modules() if isinstance(metric, Metric)}
    for name, saved in states.items():
        metric = metrics.get(name)
        if metric is None:
            continue
        device = metric.device
        for key, value in saved["state"].items():
            setattr(metric, key, [item.to(device) for item in value] if isinstance(value, list) else value.to(device))
        metric._update_count = saved["updates"]
        metric._computed = None


def set_update_count(metric: Any, count: int) -> None:
    """Set how many updates ``metric`` counts (public ``update_count`` reads it; only the private field sets it).

    A metric merged from the replicas' copies counts one update per call, as one device's does; ``merge_state`` reads
    the count of a state averaged over updates (``dist_reduce_fx="mean"``) as including the incoming one.
    """
    metric._update_count = count


def forget_computed(metric: Any) -> None:
    """Drop the value ``compute()`` cached, as ``update`` does, after states were merged into ``metric``."""
    metric._computed = None


def set_forward_value(metric: Any, value: Any) -> None:
    """Make ``value`` what ``metric`` last returned when called: Lightning logs a Metric object's step value from it."""
    metric._forward_cache = value


def caller_module(depth: int) -> str:
    """The module name of the function ``depth`` frames above the caller of this one (1: the caller's caller).

    Tells a torchmetrics metric's own code calling its ``compute`` or ``reset`` from the step's code calling it;
    ``sys._getframe`` is the cheap way to look, and CPython's.
    """
    return str(sys._getframe(depth + 1).f_globals.get("__name__", ""))


def _detached(value: Any) -> Any:
    if isinstance(value, list):
        return [item.detach().cpu().clone() for item in value]
    return value.detach().cpu().clone()


def converts_batchnorm_to_sync(strategy: Any) -> bool:
    """Whether the strategy will turn the model's BatchNorm layers into ``SyncBatchNorm`` when it sets up.

    ``Trainer(sync_batchnorm=True)`` hands the strategy a layer converter that it keeps in the private ``_layer_sync``
    and applies while setting up, after the hooks that could still refuse the combination have run.
    """
    return layer_sync(strategy) is not None


def layer_sync(strategy: Any) -> Any:
    """The layer converter the Trainer handed the strategy (``TorchSyncBatchNorm`` for ``sync_batchnorm=True``).

    Lightning keeps it in the strategy's private ``_layer_sync``, and its ``DDPStrategy.setup`` applies it from there
    (``revert`` in ``teardown``); ``mgpu_ddp`` puts its own in place of Lightning's for the time of a fit
    (``set_layer_sync``) so that BatchNorm syncs on CPU processes too.
    """
    return getattr(strategy, "_layer_sync", None)


def set_layer_sync(strategy: Any, converter: Any) -> None:
    """Make ``converter`` the layer converter Lightning's ``DDPStrategy.setup`` and ``teardown`` use."""
    strategy._layer_sync = converter


def _training_results(trainer: Any) -> Any:
    return trainer.fit_loop.epoch_loop._results


def training_batch(trainer: Any) -> Any:
    """The batch whose ``self.log`` calls the training loop is recording now; ``None`` between batches.

    Lightning's private result collection holds it from just before the ``on_train_batch_start`` hooks until just
    after the ``on_train_batch_end`` hooks, which is the span in which logged values belong to that batch.
    """
    return _training_results(trainer).batch


def set_logged_batch_size(trainer: Any, rows: int) -> None:
    """Make ``self.log`` calls without ``batch_size`` weight this training batch's values by ``rows``.

    Lightning takes an epoch mean as the synced sum of ``value * batch_size`` over the synced sum of batch sizes; when
    ``self.log`` gets no ``batch_size`` it reads the size from its private result collection (and measures the batch
    only when that is unset). A rank whose batch is a padding row sets 0, so that row adds nothing to epoch means.
    """
    _training_results(trainer).batch_size = rows


@contextlib.contextmanager
def logged_batch_size(trainer: Any, rows: int) -> Iterator[None]:
    """Inside, ``self.log`` calls without ``batch_size`` weight their values by ``rows``, in the loop that runs now.

    A ``*_step_end`` hook that gets every rank's outputs logs values of the whole step, which one device weights by
    the whole step's rows; Lightning's private result collection of the running loop holds the batch size it reads.
    """
    results = None if trainer is None else trainer._results
    if results is None:
        yield
        return
    saved, results.batch_size = results.batch_size, rows
    try:
        yield
    finally:
        results.batch_size = saved


def epoch_aggregates(trainer: Any) -> dict[str, torch.Tensor]:
    """The running epoch sums, maxima and minima of the values logged in training so far, by key.

    Means are weighted by ``set_logged_batch_size`` instead; these other reductions take every logged value as it is,
    so a batch that must not count is undone by putting them back with ``restore_epoch_aggregates``.
    """
    return {
        key: metric.value.detach().clone()
        for key, metric in _training_results(trainer).items()
        if metric.is_tensor and metric.meta.on_epoch and not metric.meta.is_mean_reduction
    }


def restore_epoch_aggregates(trainer: Any, saved: dict[str, torch.Tensor]) -> None:
    """Put back what ``epoch_aggregates`` returned; an aggregate logged for the first time since goes back to empty."""
    for key, metric in _training_results(trainer).items():
        if not metric.is_tensor or not metric.meta.on_epoch or metric.meta.is_mean_reduction:
            continue
        if key in saved:
            metric.value = saved[key].to(metric.value.device)
        elif metric.meta.is_sum_reduction:
            metric.value = torch.zeros_like(metric.value)
        elif metric.meta.is_max_reduction or metric.meta.is_min_reduction:
            bound = float("-inf") if metric.meta.is_max_reduction else float("inf")
            metric.value = torch.full_like(metric.value, bound)


# ---------------------------------------------------------------------------------------------------- jsonargparse

_PARSER_KEY = re.compile(r'Parser key "([^"]+)"')
_CLASS_PATH = re.compile(r"class_path '([\w.]+)'")


def parser_error_facts(message: str) -> tuple[str | None, list[str]]:
    """The config key and the class paths, first seen first, that a jsonargparse error names.

    jsonargparse states them only in the text of its error (``Parser key "model": ... class_path 'a.B' ...``), so
    the command line reads them from there to say which class path does not import, and why.
    """
    key = _PARSER_KEY.search(message)
    return (key.group(1) if key else None), list(dict.fromkeys(_CLASS_PATH.findall(message)))


_REJECTED_OPTION = re.compile(
    r"does not accept option '([^']+)'|Option '([^']+)' is not accepted|unrecognized arguments: --([^\s=]+)"
)
_EXPECTED = re.compile(r"Expected a <class '([\w.]+)'>")
_GIVEN = re.compile(r"Given value: (.*)")


def rejected_option(message: str) -> str | None:
    """The option a jsonargparse error says is not accepted (a misspelt key or init argument), if it says so.

    jsonargparse writes ``Subcommand 'fit' does not accept option 'trainer.max_epoch'`` for a key of the command,
    ``Option 'bach_size' is not accepted`` for an init argument of a class, and argparse ``unrecognized arguments:
    --trainr.max_epochs 3`` for a command-line flag; only the text says which.
    """
    found = _REJECTED_OPTION.search(message)
    return next((group for group in found.groups() if group), None) if found else None


def rejected_value(message: str) -> tuple[list[str], str] | None:
    """The types a jsonargparse error expected and the value it was given (``(['int', 'NoneType'], 'abc')``)."""
    expected, given = _EXPECTED.findall(message), _GIVEN.search(message)
    return (list(dict.fromkeys(expected)), given.group(1).strip()) if expected and given else None


_REJECTED_INIT_VALUE = re.compile(r"Problem with given class_path '([\w.]+)':\s*Parser key \"([^\"]+)\":")
_INIT_EXPECTED = re.compile(r"Expected a (?:<class '([\w.]+)'>|typing\.(Literal\[[^\]]*\]))")
_INIT_GIVEN = re.compile(r"(?:Got value|\n {4,}Given value): (.*)")
_NESTED_ARG = re.compile(r"^  Given value: NestedArg\(key='([^']*)', val=(.*)\)$", flags=re.MULTILINE)
_GIVEN_MAPPING = re.compile(r"^  Given value: (\{.*\})$", flags=re.MULTILINE)
_NOT_A_CLASS_PATH = re.compile(r"Expected a dot import path string: (\S+)")


def rejected_init_value(message: str) -> tuple[str, str, str, Any] | None:
    """The class path, init argument, type expected and value given of a jsonargparse error about an init argument.

    jsonargparse reports ``--model.init_args.lr fast`` (and ``lr: fast`` under ``model: init_args:``) against the
    key ``model``, with the argument's own error nested: ``Problem with given class_path 'a.Model': Parser key
    "lr": Expected a <class 'float'>. Got value: fast``. The type is a class's name (``float``) or a ``Literal``
    (``Literal['fork', 'spawn']``); the value is the one given (``given_init_args``), else the text after ``Got
    value``.
    """
    found = _REJECTED_INIT_VALUE.search(message)
    if found is None:
        return None
    class_path, name = found.groups()
    rest = message[found.end() :]
    expected, got = _INIT_EXPECTED.search(rest), _INIT_GIVEN.search(rest)
    type_name = next((group for group in expected.groups() if group), "") if expected else ""
    return class_path, name, type_name, given_init_args(message).get(name, got.group(1).strip() if got else "")


def given_init_args(message: str) -> dict[str, Any]:
    """The init arguments given for the key of a jsonargparse error, as read: ``{'lr': 'fast'}``; empty if none.

    The message holds the value given as its ``repr``: a ``NestedArg`` for ``--key.init_args.NAME VALUE``, or the
    config's mapping.
    """
    arg = _NESTED_ARG.search(message)
    if arg is not None:
        with contextlib.suppress(ValueError, SyntaxError):
            return {arg.group(1): ast.literal_eval(arg.group(2))}
        return {arg.group(1): arg.group(2)}
    mapping = _GIVEN_MAPPING.search(message)
    if mapping is not None:
        with contextlib.suppress(ValueError, SyntaxError):
            given = ast.literal_eval(mapping.group(1))
            init_args = given.get("init_args") if isinstance(given, dict) else None
            if isinstance(init_args, dict):
                return init_args
    return {}


def not_a_class_path(message: str) -> str | None:
    """Where a jsonargparse error found init arguments for a key without a class: the name given instead, if any.

    ``--trainer.strategy.init_args.X V`` on top of ``strategy: mgpu_dp`` names ``mgpu_dp`` (``Expected a dot import
    path string: mgpu_dp``); ``init_args:`` in a config whose key has no ``class_path`` names nothing (``''``).
    ``None`` for any other error.
    """
    found = _NOT_A_CLASS_PATH.search(message)
    if found is not None:
        return found.group(1)
    mapping = _GIVEN_MAPPING.search(message)
    without_class = mapping is not None and "'class_path'" not in mapping.group(1)
    return "" if without_class and "Not a valid subclass of" in message else None


def batch_norm_backward_parts(
    grad: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor,
    variance: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batch-norm backward for fixed statistics: the input's gradient, ``sum(grad * x_hat)`` and ``sum(grad)``.

    ``aten::native_batch_norm_backward`` in evaluation mode (``train=False``, the statistics passed as running ones)
    computes all three per channel in one call on every device; no public function gives them without building an
    autograd graph. Its signature has been the same in every torch this package supports; ``tests/test_compat.py``
    checks the three against the formulas. The saved statistics are passed empty rather than ``None``: CUDA's
    kernel asserts they are defined, and reads the running ones when they are empty, as the CPU's does.
    """
    unused = mean.new_empty(0)
    parts = torch.ops.aten.native_batch_norm_backward(
        grad, x, weight, mean, variance, unused, unused, False, eps, [True, True, True]
    )
    return parts[0], parts[1], parts[2]


def move_averages_(averages: list[torch.Tensor], values: list[torch.Tensor], factor: float) -> None:
    """``average.mul_(1 - factor).add_(value, alpha=factor)`` for every pair, in two calls into torch.

    ``torch._foreach_mul_`` and ``torch._foreach_add_`` update a list of tensors per call (one kernel per device
    where they live on one), as torch's own optimizers use them; they exist in every torch this package supports.
    ``tests/test_compat.py`` checks them against the one-tensor ops.
    """
    torch._foreach_mul_(averages, 1 - factor)
    torch._foreach_add_(averages, values, alpha=factor)


def copy_all_(targets: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    """``target.copy_(value)`` for every pair, in one call into torch.

    ``torch._foreach_copy_`` copies a list of tensors per call (one kernel per device where they live on one), as
    ``move_averages_``'s foreach ops do; it exists in every torch this package supports. ``tests/test_compat.py``
    checks it against ``copy_``.
    """
    with torch.no_grad():
        torch._foreach_copy_(targets, values)


def log_checker(module: Any, log: Callable[..., None]) -> Callable[..., None]:
    """``log`` (a namespace's ``LightningModule.log``) bound to a view of ``module`` that checks and records nothing.

    A replica must refuse what ``self.log`` refuses, at the call, with Lightning's own exception, and only
    ``LightningModule.log`` knows all it checks; but the Trainer's result collection it records into is shared and
    not thread-safe. So the view reads as ``module`` (its modules, device, running hook and trainer) except for three
    private fields: the trainer's ``_results`` is a ``_LogArguments`` of its own, its ``_logger_connector`` resets
    nothing, and ``_metric_attributes`` is unset, so a replica's metrics are looked for among its own modules rather
    than in the ids the module cached. ``tests/test_compat.py`` checks that a call leaves the Trainer's results alone.

    Lightning's checks of a tensor or a Python number depend only on the running hook, the arguments other than
    the value, and the value's type, dtype and whether it holds one element; of a torchmetrics metric, on which
    metric it is (its attribute name in the module). The checks take longer than the rest of a small step. So a
    call like one that passed before, in the same result collection, is not checked again: only its metadata is
    compared with what the name was logged with earlier in the step, or in the collection, as
    ``_ResultCollection.log`` compares it.
    """
    trainer = module._trainer
    arguments = None
    passed: dict[Any, _Passed] = {}
    if trainer is not None:
        results = trainer._results
        connector = _View(trainer._logger_connector, should_reset_tensors=lambda fx: False)
        if results is not None:
            arguments = _LogArguments(results)
            with _PASSED_LOCK:
                passed = _PASSED[id(results)] if id(results) in _PASSED else _passed_in(results)
        trainer = _View(trainer, _results=arguments, _logger_connector=connector)
    view = _View(module, _trainer=trainer, _metric_attributes=None)
    names = log_parameters(log)

    def check(*args: Any, **kwargs: Any) -> None:
        key = None
        if arguments is not None:
            key = _log_call_key((module._current_fx_name, arguments.dataloader_idx), names, args, kwargs)
        if key is not None:
            earlier = passed.get(key)
            if earlier is not None and (earlier[1] is None or earlier[1]() is not None):
                arguments.remember(*earlier[0])  # type: ignore[union-attr]
                return
            arguments.last = None  # type: ignore[union-attr]
        log(view, *args, **kwargs)
        if key is not None and arguments.last is not None:  # type: ignore[union-attr]
            # A metric is known by its id, kept only while the metric lives: a later object may get the same id.
            passed[key] = (arguments.last, _metric_logged(names, args, kwargs))  # type: ignore[union-attr]

    return check


_Passed = tuple[tuple[str, str, str, Any], "weakref.ref[Any] | None"]
"""A call ``log_checker``'s checks passed: its ``(key, name, fx, metadata)``, and the metric it logged, if one."""
_PASSED: dict[int, dict[Any, _Passed]] = {}
"""Per result collection, by ``id`` while it lives: the calls ``log_checker``'s checks passed, by ``_log_call_key``
(a result collection is a dict, which a weak dictionary cannot key)."""
_PASSED_LOCK = threading.Lock()


def _metric_logged(names: tuple[str, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> weakref.ref[Any] | None:
    """A weak reference to the torchmetrics metric a ``self.log`` call logged, or ``None`` for any other value."""
    value = kwargs["value"] if "value" in kwargs else dict(zip(names, args, strict=False)).get("value")
    return weakref.ref(value) if _is_metric(value) else None


def _is_metric(value: Any) -> bool:
    from torchmetrics import Metric  # Lightning's dependency, imported once a metric could be logged

    return isinstance(value, Metric)


def _passed_in(results: Any) -> dict[Any, _Passed]:
    passed = _PASSED[id(results)] = {}
    weakref.finalize(results, _PASSED.pop, id(results), None)
    return passed


@functools.cache
def log_parameters(log: Callable[..., None]) -> tuple[str, ...]:
    """The names of ``log``'s (``LightningModule.log``'s) parameters after ``self``, which name its arguments."""
    return tuple(inspect.signature(log).parameters)[1:]


def _log_call_key(place: Any, names: tuple[str, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What Lightning's checks of a ``self.log`` call in ``place`` (the hook, the dataloader index) depend on.

    ``None`` for a call that is always checked. The value counts by its type, dtype and whether it holds one
    element, a torchmetrics metric by its ``id``, and ``batch_size`` by whether it is given (only
    ``training_step(self, dataloader_iter)`` requires it); a dict, any other value and an argument that cannot be
    hashed leave the call to the checks.
    """
    options = dict(zip(names, args, strict=False))
    options.update(kwargs)
    value = options.pop("value", None)
    if isinstance(value, torch.Tensor):
        kind: tuple[Any, ...] = (type(value), value.dtype, value.numel() == 1)
    elif type(value) in (float, int, bool):
        kind = (type(value),)
    elif _is_metric(value):
        kind = ("metric", id(value))
    else:
        return None
    options["batch_size"] = options.get("batch_size") is None
    key = (place, kind, frozenset(options.items()))
    try:
        hash(key)
    except TypeError:
        return None
    return key


class _View:
    """Reads as ``target`` but for the attributes given; what code sets on it stays on it."""

    def __init__(self, target: Any, **own: Any) -> None:
        self.__dict__.update(own, _target=target)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_target"], name)


class _LogArguments:
    """Stands in for the result collection ``results``: refuses what recording refuses, records nothing.

    ``_ResultCollection.log`` builds the private ``_Metadata`` of each call, which refuses ``on_step=False,
    on_epoch=False`` and an unknown ``reduce_fx``, and refuses a name logged again in a hook with other metadata. Its
    key is ``hook.name`` (with the dataloader index), and the earlier metadata is this stand-in's or, from an earlier
    step, the one ``results`` holds. Building the metadata, not calling ``_ResultCollection.log``, because that also
    creates and moves a torchmetrics metric per name, which costs more than the step's own logging.
    """

    def __init__(self, results: Any) -> None:
        self._results = results
        self._classes = sys.modules[type(results).__module__]
        self.dataloader_idx = results.dataloader_idx
        self._metadata: dict[str, Any] = {}
        self.last: tuple[str, str, str, Any] | None = None
        """The last call's ``(key, name, fx, metadata)``, for ``remember``."""

    def log(
        self,
        fx: str,
        name: str,
        value: Any,
        *,
        add_dataloader_idx: bool,
        batch_size: int | None,
        sync_dist: bool,
        sync_dist_fn: Callable[..., Any],
        sync_dist_group: Any,
        rank_zero_only: bool,
        **fields: Any,
    ) -> None:
        key = f"{fx}.{name}"
        if add_dataloader_idx and self.dataloader_idx is not None:
            key += f".{self.dataloader_idx}"
            fx += f".{self.dataloader_idx}"
        meta = self._classes._Metadata(
            fx=fx, name=name, add_dataloader_idx=add_dataloader_idx, dataloader_idx=self.dataloader_idx, **fields
        )
        meta.sync = self._classes._Sync(
            _should=sync_dist, fn=sync_dist_fn, _group=sync_dist_group, rank_zero_only=rank_zero_only
        )
        self.last = (key, name, fx, meta)
        self.remember(key, name, fx, meta)

    def remember(self, key: str, name: str, fx: str, meta: Any) -> None:
        """Refuse ``meta`` if ``key`` was logged with other metadata, as ``_ResultCollection.log`` does; keep it."""
        earlier = self._metadata.get(key)
        if earlier is None and key in self._results:
            earlier = self._results[key].meta
        if earlier is not None and meta != earlier:
            raise self._classes.MisconfigurationException(
                f"You called `self.log({name}, ...)` twice in `{fx}` with different arguments. This is not allowed"
            )
        self._metadata[key] = meta
