"""Rows of ratios (median, min, max over repeats) from the suites' measurements, written as JSON and markdown."""

from __future__ import annotations

import json
import operator
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import batchnorm
from benchmarks.ddp_suite import variant_key

_COMPARE = {">=": operator.ge, "<=": operator.le, "<": operator.lt}
_SPEED, _STEP, _CPU = "samples_per_s", "step_s", "cpu_step_s"
# name, what, measurement, unit, variant a, variant b, at which world sizes ("n": all processes, "1": one)
_DDP = (
    ("mgpu_ddp_vs_ddp", "samples/s: mgpu_ddp / Lightning ddp", _SPEED, "ratio", "mgpu_ddp", "ddp", "n1"),
    ("mgpu_ddp_vs_torch", "samples/s: mgpu_ddp / hand-written DDP", _SPEED, "ratio", "mgpu_ddp", "torch", "n"),
    ("ddp_vs_torch", "samples/s: Lightning ddp / hand-written DDP", _SPEED, "ratio", "ddp", "torch", "n1"),
    ("lightning_ms", "ms per step: Lightning ddp - hand-written DDP", _STEP, "ms", "ddp", "torch", "n"),
    ("package_ms", "ms per step: mgpu_ddp - Lightning ddp", _STEP, "ms", "mgpu_ddp", "ddp", "n1"),
    ("mgpu_ddp_vs_ddp_cpu", "main-thread CPU time per step: mgpu_ddp / Lightning ddp", _CPU, "ratio", "mgpu_ddp",
     "ddp", "n"),
    ("package_cpu_us", "main-thread CPU us per step: mgpu_ddp - Lightning ddp", _CPU, "us", "mgpu_ddp", "ddp", "1"),
)  # fmt: skip
_DDP_TARGETS = {"mgpu_ddp_vs_ddp": ">= 0.97"}
# id, what, measurement, variant a, variant b, target: step-time ratios of the single-process variants
_LOCAL = (
    ("dp/mgpu_dp_vs_single", "step time: mgpu_dp ({dp}) / one device", _STEP, "mgpu_dp", "single", ""),
    ("dp/mgpu_dp_vs_single_2t", "step time: mgpu_dp / one device with 2 intra-op threads", _STEP, "mgpu_dp",
     "single_2t", ""),
    ("dp/mgpu_dp_vs_torch_dp", "step time: mgpu_dp / hand-written loop with torch.nn.DataParallel", _STEP, "mgpu_dp",
     "torch_dp", ""),
    ("dp/engine_vs_torch_dp", "step time: engine DataParallel / torch.nn.DataParallel (same hand-written loop)", _STEP,
     "raw_engine", "torch_dp", ""),
    ("dp/engine_vs_raw", "step time: engine DataParallel ({dp}) / one device (hand-written loops)", _STEP,
     "raw_engine", "raw", ""),
    ("dp/single_vs_raw", "step time: Lightning on one device / hand-written loop", _STEP, "single", "raw", ""),
    ("mixin/mixin_vs_single", "step time: MGPUMixin model / same model without it (default strategy)", _STEP, "mixin",
     "single", "<= 1.02"),
    ("mixin/mixin_vs_single_cpu", "main-thread CPU time per step: MGPUMixin model / same model without it", _CPU,
     "mixin", "single", "<= 1.02"),
)  # fmt: skip


def row(row_id: str, what: str, unit: str, values: Sequence[float], target: str = "") -> dict[str, Any]:
    """One result, ``<group>/<name>/<model>``: a value per repeat, its median, min and max, and the target met."""
    median = statistics.median(values)
    met = None
    if target:
        sign, bound = target.split()[:2]
        met = bool(_COMPARE[sign](median, float(bound)))
    group, *_, model = row_id.split("/")
    return {
        "id": row_id, "group": group, "model": model, "what": what, "unit": unit, "values": list(values),
        "target": target, "median": median, "min": min(values), "max": max(values), "met": met,
    }  # fmt: skip


def _compare(unit: str, a: Sequence[float], b: Sequence[float]) -> list[float]:
    if unit == "ratio":
        return [x / y for x, y in zip(a, b, strict=True)]
    scale = 1e3 if unit == "ms" else 1e6
    return [(x - y) * scale for x, y in zip(a, b, strict=True)]


def ddp_rows(ddp: dict[str, Any]) -> list[dict[str, Any]]:
    """The multi-process rows: ratios and differences between variants of the same repeat and round."""
    rows, world = [], ddp["world_size"]
    sizes = (("n", world, ""), ("1", 1, "_1proc")) if world > 1 else (("n", world, ""),)
    for model in ddp[_SPEED]:
        for name, what, key, unit, a, b, where in _DDP:
            for size, processes, suffix in sizes:
                measured = ddp[key][model]
                pair = variant_key(a, processes), variant_key(b, processes)
                if size in where and all(variant in measured for variant in pair):
                    values = _compare(unit, *(measured[variant] for variant in pair))
                    target = _DDP_TARGETS.get(name, "") if size == "n" else ""
                    rows.append(row(f"ddp/{name}{suffix}/{model}", f"{what} ({processes} proc.)", unit, values, target))
        speed = ddp[_SPEED][model]
        for variant, name in (("mgpu_ddp", "mgpu_ddp"), ("torch", "hand-written DDP")):
            if world > 1 and variant_key(variant, 1) in speed:
                what = f"samples/s: {name} {world} proc. / 1 proc. (ideal {world})"
                values = _compare("ratio", speed[variant_key(variant, world)], speed[variant_key(variant, 1)])
                target = ">= 1.7" if variant == "mgpu_ddp" and model == "conv" else ""
                rows.append(row(f"scaling/{variant}/{model}", what, "ratio", values, target))
    return rows


def local_rows(local: dict[str, Any], device: str, mixin_us: float) -> list[dict[str, Any]]:
    """The single-process rows: step-time ratios within each repeat, the engine's overhead share, the mixin's cost."""
    dp = f"{local['replicas']} {'virtual replicas' if device == 'cpu' else 'replicas on the GPUs'}"
    rows = []
    for model, runs in local["measurements"].items():
        values = {
            variant: {key: [run[key] for run in per_run] for key in per_run[0]} for variant, per_run in runs.items()
        }
        for row_id, what, key, a, b, target in _LOCAL:
            if a in values and b in values:
                ratios = _compare("ratio", values[a][key], values[b][key])
                rows.append(row(f"{row_id}/{model}", what.format(dp=dp), "ratio", ratios, target))
        if "mgpu_dp" in values:
            what = "mgpu_dp engine overhead / step time (the strategy's training_step but the replicas' step bodies)"
            target = "< 0.10" if model == "conv" else ""
            rows.append(row(f"dp/overhead_share/{model}", what, "share", values["mgpu_dp"]["overhead_share"], target))
        if "raw_engine" in values:
            what = (
                "engine DataParallel overhead / step time (hand-written loop; its 4 phases but the replicas' forward)"
            )
            rows.append(row(f"dp/engine_overhead_share/{model}", what, "share", values["raw_engine"]["overhead_share"]))
        what = f"MGPUMixin's wrapper ({mixin_us:.1f} us per call, timed alone) / one-device step time"
        shares = [mixin_us * 1e-6 / step for step in values["single"][_STEP]]
        rows.append(row(f"mixin/per_step_share/{model}", what, "share", shares, "< 0.02"))
    return rows


def overhead_rows(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per case of ``benchmarks/overhead.py``: what the engine adds per call, in us, against its target."""
    rows = []
    for case in cases:
        replicas, depth, bound = case["replicas"], case["depth"], case["target_us"]
        row_id = f"overhead/{replicas}_replica{'s' if replicas > 1 else ''}/linear4x{depth}"
        if replicas == 1:
            what = f"us per call over the plain module: engine DataParallel, 1 replica (Linear(4,4) x {depth})"
            rows.append(row(row_id, what, "us", case["overhead_us"], f"<= {bound:.0f}"))
        else:
            what = (
                f"us per call over the same {replicas} chunks in turn, above a no-op round trip to the {replicas}"
                f" replica threads: engine DataParallel, {replicas} virtual CPU replicas (Linear(4,4) x {depth})"
            )
            target = f"<= {bound:.0f} (20 + 2 x {case['modules']} modules x {replicas})"
            rows.append(row(row_id, what, "us", case["above_floor_us"], target))
    return rows


_BATCHNORM_RATIO_TARGET = {"conv16_bn16": "<= 1.15"}
_BATCHNORM_LAYER_TARGET = "<= 100"


def batchnorm_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per model of ``benchmarks/batchnorm.py``: the sync on/off ratio, and the cost per layer above a hand-off.

    The hand-off is a meeting of the replica threads through the exchange's rendezvous, with nothing exchanged.
    """
    rows = []
    for model, times in result["models"].items():
        on, off = times["sync_on"], times["sync_off"]
        layers = result["layers"][model]
        what = f"step time: mgpu_dp sync_batchnorm=True / False, 2 CPU replicas ({layers} BatchNorm layers)"
        rows.append(row(f"batchnorm/sync_on_vs_off/{model}", what, "ratio", _compare("ratio", on, off),
                        _BATCHNORM_RATIO_TARGET.get(model, "")))  # fmt: skip
        above = [seconds * 1e6 for seconds in batchnorm.above_handoffs_s(result, model)]
        what = "us per BatchNorm layer per step: sync on - off, above one hand-off between the replica threads"
        rows.append(row(f"batchnorm/per_layer_above_handoff/{model}", what, "us", above, _BATCHNORM_LAYER_TARGET))
    return rows


def phase_table(local: dict[str, Any]) -> list[dict[str, Any]]:
    """Per model and engine variant, milliseconds per step of each part (medians over repeats)."""
    parts = ("scatter", "replicate", "dispatch", "compute", "settle", "gather", "glue", "overhead", "step")
    return [
        {"model": model, "variant": variant}
        | {f"{part}_ms": statistics.median(run[f"{part}_s"] for run in runs[variant]) * 1e3 for part in parts}
        for model, runs in local["measurements"].items()
        for variant in ("mgpu_dp", "raw_engine")
        if variant in runs
    ]


def _table(header: Sequence[str], lines: Sequence[Sequence[Any]], align: str) -> list[str]:
    """A markdown table after a blank line; ``align`` has an ``l`` or ``r`` per column."""
    rule = ["---:" if side == "r" else "---" for side in align]
    return ["", *("| " + " | ".join(map(str, cells)) + " |" for cells in (header, rule, *lines))]


def _fmt(value: float, unit: str) -> str:
    return {"share": f"{value * 100:.1f}%", "ms": f"{value:+.3f}", "us": f"{value:+.1f}"}.get(unit, f"{value:.3f}")


def _profile(title: str, intro: str, sections: dict[str, list[dict[str, Any]]]) -> list[str]:
    cells = [(kind, f"`{e['name']}`", f"{e['calls_per_step']:.1f}", f"{e['us_per_step']:.1f}",
              _fmt(e["share_of_step"], "share")) for kind, entries in sections.items() for e in entries]  # fmt: skip
    return ["", f"## {title}", "", intro, *_table(("kind", "name", "calls/step", "us/step", "share"), cells, "llrrr")]


def markdown(results: dict[str, Any]) -> str:
    """The markdown report: the rows, the phase split, the overhead cases and the profiles."""
    meta = results["meta"]
    load = meta["load_average"]
    lines = [
        f"# lightning_mgpu benchmarks ({meta['mode']}, {meta['device']})",
        "",
        f"{meta['when']}; torch {meta['torch']}, lightning {meta['lightning']}, Python {meta['python']},"
        f" {meta['cpus']} CPU(s){', ' + meta['gpus'] if meta['gpus'] else ''}; package at {meta['git']};"
        f" {meta['duration_s']:.0f} s in all; load average (1, 5, 15 min) {load['before']} before,"
        f" {load['after']} after.",
        "",
        "Each row: a quantity measured once per repeat, variants alternating; median [min, max] over"
        f" {meta['ddp_repeats']} repeats of the multi-process jobs ({meta['ddp_layout']}) or {meta['local_repeats']}"
        " repeats of the single-process variants. Ratios of samples/s: above 1 is faster; of step time: below 1.",
    ]
    met = {None: "", True: "yes", False: "**no**"}
    cells = [
        (r["id"], r["what"], *(_fmt(r[k], r["unit"]) for k in ("median", "min", "max")), r["target"], met[r["met"]])
        for r in results["rows"]
    ]
    lines += _table(("id", "what", "median", "min", "max", "target", "met"), cells, "llrrrll")
    if results["phases"]:
        lines += ["", "## Where an engine step goes (ms per step, medians)"]
        header = ("model", "variant", "scatter", "replicate", "dispatch", "replicas' compute", "settle", "gather",
                  "glue", "overhead", "step")  # fmt: skip
        cells = [[f"{v:.3f}" if isinstance(v, float) else v for v in e.values()] for e in results["phases"]]
        lines += _table(header, cells, "ll" + "r" * 9)
    lines += [
        "",
        "## Engine overhead per call (CPU proxy, 1 thread; us, medians over repeats)",
        "",
        "DataParallel with N virtual CPU replicas against the same N chunks run in turn on the plain module in the"
        " calling thread (N = 1: against the plain module); forward, backward and an SGD step per call. CPU: the"
        " process's CPU time (all threads) per call, engine minus plain.",
    ]
    header = ("depth", "replicas", "modules", "plain", "engine", "overhead [min, max]", "CPU overhead",
              "no-op round trip", "above it", "target", "met")  # fmt: skip
    cells = [(c["depth"], c["replicas"], c["modules"], f"{c['sequential_us']:.1f}", f"{c['engine_us']:.1f}",
              f"{c['overhead_us']:+.1f} [{c['min_us']:+.1f}, {c['max_us']:+.1f}]", f"{c['cpu_overhead_us']:+.1f}",
              f"{c['floor_us']:.1f}", f"{c['above_floor_us']:+.1f}", f"<= {c['target_us']:.0f}", met[c["met"]])
             for c in results["overhead"]]  # fmt: skip
    lines += _table(header, cells, "r" * 10 + "l")
    if results.get("batchnorm"):
        lines += [
            "",
            "## Exact BatchNorm under mgpu_dp (CPU proxy, 2 replicas, 1 thread; ms per step, medians over repeats)",
            "",
            "Forward and backward of a batch of 8 (8 channels, 8x8): one device, the two chunks in turn on the plain"
            " module, mgpu_dp with sync_batchnorm off and on; per layer: (on - off) / layers, and that above one"
            " hand-off between the replica threads (through the exchange's own rendezvous) measured in the same run.",
        ]
        header = ("model", "BatchNorm layers", "one device", "in turn", "sync off", "sync on", "on / off [min, max]",
                  "per layer (us)", "above the hand-off (us)", "hand-off (us)")  # fmt: skip
        cells = [(b["model"], b["layers"], f"{b['single_ms']:.2f}", f"{b['in_turn_ms']:.2f}", f"{b['sync_off_ms']:.2f}",
                  f"{b['sync_on_ms']:.2f}", f"{b['ratio']:.2f} [{b['ratio_min']:.2f}, {b['ratio_max']:.2f}]",
                  f"{b['per_layer_us']:+.0f}", f"{b['above_handoffs_us']:+.0f}", f"{b['handoff_us']:.0f}")
                 for b in results["batchnorm"]]  # fmt: skip
        lines += _table(header, cells, "lr" + "r" * 8)
    for model, p in results["profile_dp"].items():
        threads = "replica threads included" if p["replica_threads_profiled"] else "calling thread only"
        title = (
            f"torch.profiler: mgpu_dp, {model} ({p['profiled_step_ms']:.2f} ms per step, {p['steps']} steps, {threads})"
        )
        intro = (
            "Labels: inclusive CPU time of the engine's and the strategy's parts (`mgpu::replica_thread` and"
            " `mgpu::replica_step_body` run in the replica threads while the caller waits in `mgpu::parallel_apply`);"
            " self: the operators and labels with the most time of their own."
        )
        lines += _profile(title, intro, {"label": p["labels"], "self": p["self_time"]})
    if results.get("profile_batchnorm"):
        p = results["profile_batchnorm"]
        threads = "replica threads included" if p["replica_threads_profiled"] else "calling thread only"
        title = (
            f"torch.profiler: exact BatchNorm, {p['model']} ({p['layers']} layers; {p['profiled_step_ms']:.2f} ms per"
            f" step under the profiler, {p['steps']} steps, {threads})"
        )
        intro = (
            "Labels, inclusive: `mgpu::function_mode`, every torch call of a replica through the function mode (the"
            " call itself included); `mgpu::bn_call`, a replica's batch-norm call; `mgpu::bn_meeting`, its meeting"
            " with the others, waiting included; `mgpu::bn_whole_batch`, the last to arrive normalising every chunk"
            " (`mgpu::bn_statistics` its first part); `mgpu::bn_backward`, the backward of every chunk. Waiting in the"
            f" meetings (meeting less the work done inside): {p['waiting_us_per_step']:.0f} us per step."
        )
        lines += _profile(title, intro, {"label": p["labels"], "self": p["self_time"]})
    for model, p in results["profile_ddp"].items():
        title = f"cProfile: mgpu_ddp, {model} ({p['profiled_step_ms']:.2f} ms per step, {p['steps']} steps)"
        intro = (
            f"Self time in lightning_mgpu: {_fmt(p['package_self_share'], 'share')} of the step; in torch and builtins"
            f" called directly from it: {_fmt(p['called_from_package_share'], 'share')}."
        )
        sections = {"self": p["package_self_time"], "called from package": p["called_from_package"]}
        lines += _profile(title, intro, sections)
    return "\n".join([*lines, ""])


def write(results: dict[str, Any], out: Path) -> None:
    """Write ``results.json`` and ``results.md`` under ``out``."""
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "results.md").write_text(markdown(results))
