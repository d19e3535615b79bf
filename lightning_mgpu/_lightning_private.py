"""The one place that calls private Lightning (and torchmetrics) API, each use explained and covered by tests."""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader, Sampler


def with_sampler(dataloader: DataLoader, sampler: Sampler) -> DataLoader:
    """A copy of ``dataloader`` that draws its indices from ``sampler``.

    A DataLoader's sampler cannot be replaced after construction, and rebuilding one faithfully (custom subclasses,
    their init arguments, batch samplers) is what Lightning's private ``_update_dataloader`` does when it injects its
    own distributed samplers. Reusing it keeps our copy exactly as faithful as Lightning's.
    """
    from lightning.pytorch.utilities.data import _update_dataloader

    return _update_dataloader(dataloader, sampler)


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


def _detached(value: Any) -> Any:
    if isinstance(value, list):
        return [item.detach().cpu().clone() for item in value]
    return value.detach().cpu().clone()
