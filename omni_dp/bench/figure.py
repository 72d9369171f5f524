"""The bench figure: throughput against concurrency per configuration (the trials' range as a
band, the compared level marked), and each configuration's ratio to the single replica at its
own saturation, with the premise written under them.

matplotlib's object API on the Agg canvas: no pyplot, so no display is ever opened, no global
backend is switched, and a figure is freed when it goes out of scope.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from omni_dp.bench.results import BenchResult, ConfigResult
from omni_dp.bench.scaling import BASELINE, compared_level, saturated, scaling_range
from omni_dp.bench.text import machine_text

WIDTH_IN, HEIGHT_IN, DPI = 13.0, 5.8, 110
PREMISE_WIDTH = 150  # characters per line of the premise under the panels


def _throughput_panel(ax: Axes, configs: tuple[ConfigResult, ...]) -> None:
    drawn = 0
    for index, config in enumerate(configs):
        color = f"C{index % 10}"
        levels = sorted(config.levels, key=lambda level: level.concurrency)
        if config.status == "failed" and not levels:
            ax.plot([], [], color=color, linestyle="none", marker="x",
                    label=f"{config.name}: failed")
            continue
        x = [level.concurrency for level in levels]
        median = [level.requests_per_s.median for level in levels]
        low = [level.requests_per_s.low for level in levels]
        high = [level.requests_per_s.high for level in levels]
        failed = " (failed)" if config.status == "failed" else ""
        ax.plot(x, median, color=color, marker="o", markersize=4,
                linestyle="--" if failed else "-", label=f"{config.name}{failed}")
        ax.fill_between(x, low, high, color=color, alpha=0.2, linewidth=0)
        drawn += 1
        level = compared_level(config)
        if level is not None:
            ax.plot([level.concurrency], [level.requests_per_s.median], color=color,
                    marker="*" if saturated(config) else "D", markersize=14,
                    markeredgecolor="black", linestyle="none")
            ax.annotate(f"c={level.concurrency}", (level.concurrency, level.requests_per_s.median),
                        textcoords="offset points", xytext=(6, 8), fontsize=8, color=color)
    concurrencies = sorted({lv.concurrency for c in configs for lv in c.levels})
    if len(concurrencies) > 1 and concurrencies[0] > 0:
        ax.set_xscale("log", base=2)
        ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
    if not drawn:
        why = [f"{c.name}: {c.reason or c.status}" for c in configs]
        ax.text(0.5, 0.5, "\n".join(["no configuration ran", *(textwrap.shorten(w, 70)
                                                                for w in why)]),
                ha="center", va="center", transform=ax.transAxes, color="red")
        ax.set_xticks([])
        ax.set_yticks([])
    ax.set_xlabel("concurrency (requests in flight, all replicas)")
    ax.set_ylabel("ok requests / s")
    highest = max((lv.requests_per_s.high for c in configs for lv in c.levels), default=0.0)
    ax.set_ylim(0, highest * 1.15 if highest > 0 else 1.0)
    ax.set_title("throughput: median line, trials' low–high band; ★ saturation, ◆ highest "
                 "(not saturated)", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="best")


def _scaling_panel(ax: Axes, result: BenchResult) -> None:
    others = [c for c in result.configs if c.name != BASELINE]
    ax.set_title(f"ratio to configuration {BASELINE}, each at its own saturation", fontsize=10)
    ax.set_ylabel(f"median req/s ÷ {BASELINE}'s")
    baseline = next((c for c in result.configs if c.name == BASELINE), None)
    base_level = compared_level(baseline) if baseline is not None else None
    if baseline is None or base_level is None or not others:
        if baseline is None:
            why = f"no configuration {BASELINE} (the single replica): no ratio"
        elif base_level is None:
            why = (f"configuration {BASELINE} failed ({baseline.reason or 'no reason given'}): "
                   "no ratio")
        else:
            why = "only one configuration: no ratio"
        ax.text(0.5, 0.5, textwrap.fill(why, 50), ha="center", va="center",
                transform=ax.transAxes, color="black" if base_level is not None else "red")
        ax.set_xticks([])
        ax.set_yticks([])
        return
    ranges = scaling_range(result.configs)
    top = 1.0
    for x, config in enumerate(others):
        ratio = result.scaling.get(config.name)
        if config.status == "failed" or ratio is None:
            ax.text(x, 0.05, "failed" if config.status == "failed" else "no level",
                    ha="center", va="bottom", color="red", rotation=90)
            continue
        r = ranges.get(config.name)
        yerr = [[ratio - r.low], [r.high - ratio]] if r else None
        ax.bar(x, ratio, color=f"C{result.configs.index(config) % 10}", yerr=yerr, capsize=4)
        ax.annotate(f"{ratio:.2f}×", (x, ratio / 2), ha="center", va="center", fontsize=11,
                    fontweight="bold", color="white")
        top = max(top, ratio, r.high if r else ratio)
        if config.replicas:
            ax.hlines(config.replicas, x - 0.4, x + 0.4, colors="black", linestyles=":")
            top = max(top, config.replicas)
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1,
               label=f"{BASELINE}: the single replica")
    ax.plot([], [], color="black", linestyle=":", label="ideal (× replicas)")
    ax.set_xticks(range(len(others)), [c.name for c in others])
    ax.set_xlim(-0.7, len(others) - 0.3)
    ax.set_ylim(0, top * 1.2)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")


def render_png(result: BenchResult, path: str | Path) -> Path:
    """Write the figure as a PNG at `path` (its directory must exist); returns the path."""
    figure = Figure(figsize=(WIDTH_IN, HEIGHT_IN), dpi=DPI)
    FigureCanvasAgg(figure)
    left, right = figure.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
    _throughput_panel(left, result.configs)
    _scaling_panel(right, result)
    figure.suptitle(f"omni-dp bench: {result.workload} on {machine_text(result.machine)}",
                    fontsize=12)
    premise = textwrap.fill(f"premise: {result.premise}", PREMISE_WIDTH)
    figure.text(0.01, 0.01, premise, fontsize=8, va="bottom", ha="left", wrap=False)
    lines = premise.count("\n") + 1
    figure.tight_layout(rect=(0, 0.03 + 0.025 * lines, 1, 0.95))
    path = Path(path)
    figure.savefig(path, format="png")
    return path
