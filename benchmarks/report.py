"""Turn the suites' measurements into rows of ratios (median, min, max over repeats) and write them out.

``results.json`` holds every row with its per-repeat values, plus the raw measurements, the engine's phase split,
the engine-overhead cases, the micro-benchmarks and the profiles; ``results.md`` holds the same rows as markdown
tables; ``results.png`` plots the ratio rows (skipped, with a note, when matplotlib is not installed).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.ddp_suite import variant_key


@dataclass
class Row:
    """One result: a quantity measured in every repeat, summarized by its median, min and max.

    Attributes:
        id: stable key, ``<group>/<name>/<model>``.
        group: ``ddp``, ``scaling``, ``dp``, ``mixin``, ``overhead``.
        model: ``mlp`` or ``conv``, or for ``overhead`` the proxy net (``linear4x16``: 16 ``Linear(4, 4)`` layers).
        what: what was measured, in words (``mgpu_ddp / ddp samples/s``).
        unit: ``ratio``, ``share`` (of the step time), ``ms`` or ``us`` (per step).
        values: one value per repeat.
        target: the target in words (``>= 0.97``), or empty.
        check: whether a median meets the target; ``None`` when there is no target.
    """

    id: str
    group: str
    model: str
    what: str
    unit: str
    values: list[float]
    target: str = ""
    check: Callable[[float], bool] | None = field(default=None, repr=False)

    @property
    def median(self) -> float:
        """Median over repeats."""
        return statistics.median(self.values)

    @property
    def met(self) -> bool | None:
        """Whether the median meets the target (``None`` without one)."""
        return None if self.check is None else bool(self.check(self.median))

    def as_dict(self) -> dict[str, Any]:
        """The row for ``results.json``."""
        data = {key: value for key, value in asdict(self).items() if key != "check"}
        data.update(median=self.median, min=min(self.values), max=max(self.values), met=self.met)
        return data


def _ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    return [x / y for x, y in zip(a, b, strict=True)]


def _ms_differences(a: Sequence[float], b: Sequence[float]) -> list[float]:
    return [(x - y) * 1e3 for x, y in zip(a, b, strict=True)]


def _us_differences(a: Sequence[float], b: Sequence[float]) -> list[float]:
    return [(x - y) * 1e6 for x, y in zip(a, b, strict=True)]


def _at_least(bound: float) -> Callable[[float], bool]:
    return lambda value: value >= bound


def _at_most(bound: float) -> Callable[[float], bool]:
    return lambda value: value <= bound


def _below(bound: float) -> Callable[[float], bool]:
    return lambda value: value < bound


def ddp_rows(ddp: dict[str, Any]) -> list[Row]:
    """Rows of the multi-process suite: each ratio between jobs of the same repeat."""
    rows: list[Row] = []
    world = ddp["world_size"]
    for model, speed in ddp["samples_per_s"].items():
        step = ddp["step_s"][model]
        cpu = ddp["cpu_step_s"][model]
        mgpu, lightning, torch_ = (variant_key(v, world) for v in ("mgpu_ddp", "ddp", "torch"))
        if not all(key in speed for key in (mgpu, lightning, torch_)):
            continue
        procs = f"({world} proc.)"
        rows += [
            Row(f"ddp/mgpu_ddp_vs_ddp/{model}", "ddp", model, f"samples/s: mgpu_ddp / Lightning ddp {procs}",
                "ratio", _ratios(speed[mgpu], speed[lightning]), ">= 0.97", _at_least(0.97)),
            Row(f"ddp/mgpu_ddp_vs_torch/{model}", "ddp", model, f"samples/s: mgpu_ddp / hand-written DDP {procs}",
                "ratio", _ratios(speed[mgpu], speed[torch_])),
            Row(f"ddp/ddp_vs_torch/{model}", "ddp", model, f"samples/s: Lightning ddp / hand-written DDP {procs}",
                "ratio", _ratios(speed[lightning], speed[torch_])),
            Row(f"ddp/lightning_ms/{model}", "ddp", model, "ms per step: Lightning ddp - hand-written DDP",
                "ms", _ms_differences(step[lightning], step[torch_])),
            Row(f"ddp/package_ms/{model}", "ddp", model, "ms per step: mgpu_ddp - Lightning ddp",
                "ms", _ms_differences(step[mgpu], step[lightning])),
            Row(f"ddp/mgpu_ddp_vs_ddp_cpu/{model}", "ddp", model,
                f"main-thread CPU time per step: mgpu_ddp / Lightning ddp {procs}", "ratio",
                _ratios(cpu[mgpu], cpu[lightning])),
        ]  # fmt: skip
        single = {variant: variant_key(variant, 1) for variant in ("mgpu_ddp", "ddp", "torch")}
        if world > 1 and all(key in speed for key in single.values()):
            rows += [
                Row(f"ddp/mgpu_ddp_vs_ddp_1proc/{model}", "ddp", model, "samples/s: mgpu_ddp / Lightning ddp (1 proc.)",
                    "ratio", _ratios(speed[single["mgpu_ddp"]], speed[single["ddp"]])),
                Row(f"ddp/ddp_vs_torch_1proc/{model}", "ddp", model,
                    "samples/s: Lightning ddp / hand-written DDP (1 proc.)", "ratio",
                    _ratios(speed[single["ddp"]], speed[single["torch"]])),
                Row(f"ddp/package_ms_1proc/{model}", "ddp", model, "ms per step: mgpu_ddp - Lightning ddp (1 proc.)",
                    "ms", _ms_differences(step[single["mgpu_ddp"]], step[single["ddp"]])),
                Row(f"ddp/package_cpu_us_1proc/{model}", "ddp", model,
                    "main-thread CPU us per step: mgpu_ddp - Lightning ddp (1 proc.)", "us",
                    _us_differences(cpu[single["mgpu_ddp"]], cpu[single["ddp"]])),
            ]  # fmt: skip
        for variant, name in (("mgpu_ddp", "mgpu_ddp"), ("torch", "hand-written DDP")):
            one = variant_key(variant, 1)
            if world > 1 and one in speed:
                compute_bound = variant == "mgpu_ddp" and model == "conv"
                rows.append(
                    Row(f"scaling/{variant}/{model}", "scaling", model,
                        f"samples/s: {name} {world} proc. / 1 proc. (ideal {world})", "ratio",
                        _ratios(speed[variant_key(variant, world)], speed[one]),
                        ">= 1.7" if compute_bound else "", _at_least(1.7) if compute_bound else None)
                )  # fmt: skip
    return rows


def local_rows(local: dict[str, Any], device: str, mixin_cost_us: float | None) -> list[Row]:
    """Rows of the single-process suite: step-time ratios within each repeat, and the engine's overhead share."""
    replicas = local["replicas"]
    dp_name = f"{replicas} virtual replicas" if device == "cpu" else f"{replicas} GPUs"
    ratios = (
        ("dp/mgpu_dp_vs_single", f"step time: mgpu_dp ({dp_name}) / one device", "mgpu_dp", "single", None),
        ("dp/mgpu_dp_vs_single_2t", "step time: mgpu_dp / one device with 2 intra-op threads", "mgpu_dp",
         "single_2t", None),
        ("dp/mgpu_dp_vs_torch_dp", "step time: mgpu_dp / hand-written loop with torch.nn.DataParallel", "mgpu_dp",
         "torch_dp", None),
        ("dp/engine_vs_torch_dp", "step time: engine DataParallel / torch.nn.DataParallel (same hand-written loop)",
         "raw_engine", "torch_dp", None),
        ("dp/engine_vs_raw", f"step time: engine DataParallel ({dp_name}) / one device (hand-written loops)",
         "raw_engine", "raw", None),
        ("dp/single_vs_raw", "step time: Lightning on one device / hand-written loop", "single", "raw", None),
        ("mixin/mixin_vs_single", "step time: MGPUMixin model / same model without it (default strategy)", "mixin",
         "single", ("<= 1.02", lambda m: m <= 1.02)),
    )  # fmt: skip
    rows: list[Row] = []
    for model, per_variant in local["measurements"].items():
        step = {variant: [m["step_s"] for m in runs] for variant, runs in per_variant.items()}
        for key, what, a, b, target in ratios:
            if a in step and b in step:
                text, check = target or ("", None)
                rows.append(Row(f"{key}/{model}", key.split("/")[0], model, what, "ratio", _ratios(step[a], step[b]),
                                text, check))  # fmt: skip
        if "mixin" in per_variant and "single" in per_variant:
            rows.append(
                Row(f"mixin/mixin_vs_single_cpu/{model}", "mixin", model,
                    "main-thread CPU time per step: MGPUMixin model / same model without it", "ratio",
                    _ratios([m["cpu_step_s"] for m in per_variant["mixin"]],
                            [m["cpu_step_s"] for m in per_variant["single"]]), "<= 1.02", lambda m: m <= 1.02)
            )  # fmt: skip
        if "mgpu_dp" in per_variant:
            conv = model == "conv"
            rows.append(
                Row(f"dp/overhead_share/{model}", "dp", model,
                    "mgpu_dp engine overhead / step time (everything in the strategy's training_step but the"
                    " replicas' step bodies)", "share", [m["overhead_share"] for m in per_variant["mgpu_dp"]],
                    "< 0.10" if conv else "", _below(0.10) if conv else None)
            )  # fmt: skip
        if "raw_engine" in per_variant:
            rows.append(
                Row(f"dp/engine_overhead_share/{model}", "dp", model,
                    "engine DataParallel overhead / step time (hand-written loop; its 4 phases but the replicas'"
                    " forward)", "share", [m["overhead_share"] for m in per_variant["raw_engine"]])
            )  # fmt: skip
        if mixin_cost_us is not None and "single" in step:
            rows.append(
                Row(f"mixin/per_step_share/{model}", "mixin", model,
                    f"MGPUMixin's wrapper ({mixin_cost_us:.1f} us per call, micro-benchmark) / one-device step time",
                    "share", [mixin_cost_us * 1e-6 / value for value in step["single"]], "< 0.02", _below(0.02))
            )  # fmt: skip
    return rows


def overhead_rows(cases: list[dict[str, Any]]) -> list[Row]:
    """One row per case of ``benchmarks/overhead.py``: what the engine adds per call, in us, against its target."""
    rows = []
    for case in cases:
        replicas, depth, modules = case["replicas"], case["depth"], case["modules"]
        bound = case["target_us"]
        if replicas == 1:
            what = f"us per call over the plain module: engine DataParallel, 1 replica (Linear(4,4) x {depth})"
            target = f"<= {bound:.0f}"
        else:
            what = (
                f"us per call over the same {replicas} chunks in turn: engine DataParallel, {replicas} virtual CPU"
                f" replicas (Linear(4,4) x {depth})"
            )
            target = f"<= {bound:.0f} (40 + 2 x {modules} modules x {replicas})"
        rows.append(
            Row(f"overhead/{replicas}_replica{'s' if replicas > 1 else ''}/linear4x{depth}", "overhead",
                f"linear4x{depth}", what, "us", case["overhead_us"], target, _at_most(bound))
        )  # fmt: skip
    return rows


def phase_table(local: dict[str, Any]) -> list[dict[str, Any]]:
    """Per model and engine variant: milliseconds per step of each part, medians over repeats."""
    parts = ("scatter_s", "replicate_s", "dispatch_s", "compute_s", "gather_s", "glue_s", "overhead_s", "step_s")
    table = []
    for model, per_variant in local["measurements"].items():
        for variant in ("mgpu_dp", "raw_engine"):
            runs = per_variant.get(variant)
            if not runs:
                continue
            entry: dict[str, Any] = {"model": model, "variant": variant}
            for part in parts:
                entry[part.removesuffix("_s") + "_ms"] = statistics.median(run[part] for run in runs) * 1e3
            table.append(entry)
    return table


def _fmt(value: float, unit: str) -> str:
    if unit == "share":
        return f"{value * 100:.1f}%"
    if unit == "ms":
        return f"{value:+.3f}"
    if unit == "us":
        return f"{value:+.1f}"
    return f"{value:.3f}"


def markdown(results: dict[str, Any]) -> str:
    """The markdown report: main table, phase split, micro-benchmarks, profile."""
    meta = results["meta"]
    lines = [
        f"# lightning_mgpu benchmarks ({meta['mode']}, {meta['device']})",
        "",
        f"{meta['when']}; torch {meta['torch']}, lightning {meta['lightning']}, Python {meta['python']},"
        f" {meta['cpus']} CPU(s){', ' + meta['gpus'] if meta.get('gpus') else ''}; package at {meta['git']};"
        f" {meta['duration_s']:.0f} s in all; load average (1, 5, 15 min) {meta['load_average']['before']} before,"
        f" {meta['load_average']['after']} after.",
        "",
        "Each row: a quantity measured once per repeat, variants alternating; median [min, max] over"
        f" {meta['ddp_repeats']} repeats of the multi-process jobs ({meta['ddp_layout']}) or"
        f" {meta['local_repeats']} repeats of the single-process variants.",
        "Ratios of samples/s: above 1 is faster. Ratios of step time: below 1 is faster.",
        "",
        "| id | what | median | min | max | target | met |",
        "| --- | --- | ---: | ---: | ---: | --- | --- |",
    ]
    for row in results["rows"]:
        met = "" if row["met"] is None else ("yes" if row["met"] else "**no**")
        lines.append(
            f"| {row['id']} | {row['what']} | {_fmt(row['median'], row['unit'])} | {_fmt(row['min'], row['unit'])}"
            f" | {_fmt(row['max'], row['unit'])} | {row['target']} | {met} |"
        )
    if results.get("phases"):
        lines += [
            "",
            "## Where an engine step goes (ms per step, medians)",
            "",
            "| model | variant | scatter | replicate | dispatch | replicas' compute | gather | glue | overhead"
            " | step |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for entry in results["phases"]:
            lines.append(
                f"| {entry['model']} | {entry['variant']} | {entry['scatter_ms']:.3f} | {entry['replicate_ms']:.3f}"
                f" | {entry['dispatch_ms']:.3f} | {entry['compute_ms']:.3f} | {entry['gather_ms']:.3f}"
                f" | {entry['glue_ms']:.3f} | {entry['overhead_ms']:.3f} | {entry['step_ms']:.3f} |"
            )
    lines += _overhead_markdown(results.get("overhead", []))
    lines += _micro_markdown(results.get("micro", {}))
    for model, profile in results.get("profile_dp", {}).items():
        lines += _torch_profile_markdown(f"mgpu_dp, {model}", profile)
    for model, profile in results.get("profile_ddp", {}).items():
        lines += _profile_markdown(f"mgpu_ddp, {model}", profile)
    absolute = results.get("absolute", {})
    if absolute:
        lines += ["", "## For context: absolute medians (noisy; compare only the ratios above)", "",
                  "| model | variant | ms per step | samples/s |", "| --- | --- | ---: | ---: |"]  # fmt: skip
        for model, per_variant in absolute.items():
            for variant, values in per_variant.items():
                lines.append(f"| {model} | {variant} | {values['step_ms']:.3f} | {values['samples_per_s']:.0f} |")
    lines += ["", f"Plot: {results['plot']}", ""]
    return "\n".join(lines)


def _overhead_markdown(cases: list[dict[str, Any]]) -> list[str]:
    if not cases:
        return []
    lines = ["", "## Engine overhead per call (CPU proxy, 1 thread; us, medians over repeats)", "",
             "DataParallel with N virtual CPU replicas against the same N chunks run in turn on the plain module in"
             " the calling thread (N = 1: against the plain module); forward, backward and an SGD step per call.",
             "CPU: the process's CPU time (all threads) per call, engine minus plain.", "",
             "| depth | replicas | modules | plain | engine | overhead [min, max] | CPU overhead | target | met |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]  # fmt: skip
    for case in cases:
        lines.append(
            f"| {case['depth']} | {case['replicas']} | {case['modules']} | {case['sequential_us']:.1f}"
            f" | {case['engine_us']:.1f} | {case['overhead_us']:+.1f} [{case['min_us']:+.1f}, {case['max_us']:+.1f}]"
            f" | {case['cpu_overhead_us']:+.1f} | <= {case['target_us']:.0f} | {'yes' if case['met'] else '**no**'} |"
        )
    return lines


def _micro_markdown(micro: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    if "per_step" in micro:
        lines += ["", "## Per-call costs (us per call, median [min, max])", "", "| piece | median [min, max] |",
                  "| --- | ---: |"]  # fmt: skip
        for name, timing in micro["per_step"].items():
            lines.append(f"| {name} | {_us(timing)} |")
    return lines


def _us(timing: dict[str, float] | None) -> str:
    if timing is None:
        return "-"
    return f"{timing['median_us']:.1f} [{timing['min_us']:.1f}, {timing['max_us']:.1f}]"


def _torch_profile_markdown(title: str, profile: dict[str, Any]) -> list[str]:
    threads = "replica threads included" if profile["replica_threads_profiled"] else "calling thread only"
    lines = [
        "",
        f"## torch.profiler: {title} ({profile['profiled_step_ms']:.2f} ms per profiled step, {profile['steps']} steps,"
        f" {threads})",
        "",
        "Labels are inclusive CPU time of the engine's and the strategy's parts (`mgpu::replica_thread` and"
        " `mgpu::replica_step_body` run in the replica threads, side by side, while the caller waits inside"
        " `mgpu::parallel_apply`, whose self time is mostly that wait); self time lists the operators and labels"
        " with the most time of their own.",
        "",
        "| kind | label | calls/step | us/step | share of step |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for kind, key in (("label", "labels"), ("self", "self_time")):
        for entry in profile[key]:
            lines.append(
                f"| {kind} | `{entry['label']}` | {entry['calls_per_step']:.1f} | {entry['us_per_step']:.1f}"
                f" | {entry['share_of_step'] * 100:.1f}% |"
            )
    return lines


def _profile_markdown(title: str, profile: dict[str, Any]) -> list[str]:
    lines = [
        "",
        f"## cProfile: {title} ({profile['profiled_step_ms']:.2f} ms per profiled step, {profile['steps']} steps,"
        f" {profile['worker_threads_profiled']} replica threads)",
        "",
        f"Self time in lightning_mgpu: {profile['package_self_time_total_share'] * 100:.1f}% of the step; in torch and"
        f" builtins called directly from it: {profile['called_from_package_total_share'] * 100:.1f}%.",
        "",
        "| kind | function | calls/step | us/step | share of step |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for kind, key in (("self", "package_self_time"), ("called from package", "called_from_package"),
                      ("cumulative", "cumulative"), ("any, by self time", "overall_self_time")):  # fmt: skip
        for entry in profile[key]:
            lines.append(
                f"| {kind} | `{entry['function']}` | {entry['calls_per_step']:.1f} | {entry['us_per_step']:.1f}"
                f" | {entry['share_of_step'] * 100:.1f}% |"
            )
    return lines


def plot(rows: list[dict[str, Any]], path: Path) -> str:
    """Plot the ratio and share rows with min-max bars; returns the file name, or why there is no plot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "not drawn: matplotlib is not installed (pip install matplotlib)"
    shown = [row for row in rows if row["unit"] in ("ratio", "share")]
    if not shown:
        return "not drawn: no ratio rows"
    figure, axis = plt.subplots(figsize=(10, 0.32 * len(shown) + 1.2))
    positions = list(range(len(shown)))[::-1]
    medians = [row["median"] for row in shown]
    errors = [[row["median"] - row["min"] for row in shown], [row["max"] - row["median"] for row in shown]]
    colors = ["tab:blue" if row["model"] == "mlp" else "tab:orange" for row in shown]
    axis.barh(positions, medians, xerr=errors, color=colors, capsize=2)
    axis.set_yticks(positions, [row["id"] for row in shown], fontsize=7)
    axis.axvline(1.0, color="grey", linewidth=0.8)
    axis.set_xlabel("median of per-repeat ratios (bars: min-max); blue: mlp, orange: conv")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path.name


def write(results: dict[str, Any], out: Path) -> None:
    """Write ``results.json``, ``results.md`` and (when matplotlib is there) ``results.png`` under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    results["plot"] = plot(results["rows"], out / "results.png")
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "results.md").write_text(markdown(results))
