"""Plots: PNG charts of one sweep or of several result files side by side.

`plot_results` writes three files: latency percentiles (median, p90, p99 of TTFT, TPOT, ITL,
E2E) vs the swept value, throughput (output tokens/s, requests/s, goodput) vs the swept value,
and TTFT and TPOT distributions (one empirical CDF per run). Results are grouped into lines by
label and arrival mode; the x axis is categorical over the swept values (so rate inf fits).
Uses matplotlib's object API (`Figure`, Agg canvas): no pyplot, no global state, no display.
"""

from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from loadtests.metrics import tpot_ms, ttft_ms
from loadtests.report import LATENCIES, records_of, result_name

PERCENTILE_STYLES = (("median", "-"), ("p90", "--"), ("p99", ":"))


def plot_results(results: list[dict], out_dir, prefix: str = "") -> list[Path]:
    """Write latency, throughput and distribution PNGs into out_dir; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{prefix}latency.png", out / f"{prefix}throughput.png",
             out / f"{prefix}distributions.png"]
    for plot, path in zip((plot_latency, plot_throughput, plot_distributions), paths):
        fig = plot(results)
        fig.savefig(path, dpi=100)
    return paths


def plot_latency(results: list[dict]) -> Figure:
    fig = Figure(figsize=(11, 8), layout="constrained")
    axes = fig.subplots(2, 2).ravel()
    xs = _x_values(results)
    for ax, (name, key) in zip(axes, LATENCIES):
        for i, (group, runs) in enumerate(_groups(results).items()):
            for stat, style in PERCENTILE_STYLES:
                ys = [r["summary"][key][stat] for r in runs]
                ax.plot(_positions(runs, xs), _nan(ys), style, marker="o", color=f"C{i}",
                        label=f"{group} {stat}")
        _x_axis(ax, results, xs)
        ax.set_ylabel(f"{name} (ms)")
        ax.set_title(f"{name} percentiles")
    axes[0].legend(fontsize="small")
    return fig


def plot_throughput(results: list[dict]) -> Figure:
    fig = Figure(figsize=(11, 4.5), layout="constrained")
    tokens_ax, requests_ax = fig.subplots(1, 2)
    xs = _x_values(results)
    for i, (group, runs) in enumerate(_groups(results).items()):
        pos = _positions(runs, xs)
        tokens_ax.plot(pos, [r["summary"]["output_throughput"] for r in runs], "-o",
                       color=f"C{i}", label=group)
        requests_ax.plot(pos, [r["summary"]["request_throughput"] for r in runs], "-o",
                         color=f"C{i}", label=f"{group} requests")
        if all("goodput" in r["summary"] for r in runs):
            requests_ax.plot(pos, [r["summary"]["goodput"]["request_rate"] for r in runs], "--s",
                             color=f"C{i}", label=f"{group} goodput")
    for ax, ylabel in ((tokens_ax, "output tokens/s"), (requests_ax, "requests/s")):
        _x_axis(ax, results, xs)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize="small")
    return fig


def plot_distributions(results: list[dict]) -> Figure:
    """Empirical CDFs (fraction of requests at or below x), which overlay cleanly."""
    fig = Figure(figsize=(11, 4.5), layout="constrained")
    for ax, (name, measure) in zip(fig.subplots(1, 2), (("TTFT", ttft_ms), ("TPOT", tpot_ms))):
        for i, result in enumerate(results):
            ok = [r for r in records_of(result) if r.is_ok and not r.is_warmup]
            values = np.sort([v for r in ok if (v := measure(r)) is not None])
            if values.size:
                ax.step(values, np.arange(1, values.size + 1) / values.size, where="post",
                        color=f"C{i % 10}", label=result_name(result))
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests <= x")
        ax.set_title(f"{name} distribution")
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize="small")
    return fig


def _groups(results: list[dict]) -> dict[str, list[dict]]:
    """Results by label (and arrival mode when a label has both), sorted by swept value."""
    modes: dict[str, set] = {}
    for r in results:
        modes.setdefault(r["label"], set()).add(r["config"]["arrival"]["mode"])
    groups: dict[str, list[dict]] = {}
    for r in results:
        mode = r["config"]["arrival"]["mode"]
        name = r["label"] if len(modes[r["label"]]) == 1 else f"{r['label']} ({mode})"
        groups.setdefault(name, []).append(r)
    return {k: sorted(v, key=_x) for k, v in groups.items()}


def _x(result: dict) -> float:
    return float(result["config"]["arrival"]["x"])


def _x_values(results: list[dict]) -> list[float]:
    return sorted({_x(r) for r in results})


def _positions(runs: list[dict], xs: list[float]) -> list[int]:
    return [xs.index(_x(r)) for r in runs]


def _x_axis(ax, results: list[dict], xs: list[float]) -> None:
    modes = {r["config"]["arrival"]["mode"] for r in results}
    label = {frozenset({"closed"}): "concurrency", frozenset({"open"}): "request rate (req/s)"}
    ax.set_xlabel(label.get(frozenset(modes), "concurrency / request rate"))
    ax.set_xticks(range(len(xs)), [f"{x:g}" for x in xs])
    ax.grid(alpha=0.3)


def _nan(values: list) -> list[float]:
    return [np.nan if v is None else v for v in values]
