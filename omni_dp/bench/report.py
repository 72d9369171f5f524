"""A bench run as people and scripts read it: the tables (omni_dp/tables.py grids: rich on a
terminal, plain or markdown elsewhere), the JSON, and the figure (omni_dp/bench/figure.py,
behind render_png).

Every number the tables show is in the JSON: the results' own fields, plus what is derived
from them here (each configuration's per-replica balance at the level it is compared at, and
the scaling ratios' range). Ranges are written `median [low–high]`, never the best trial; every
failed, timed-out or 503'd request is counted; a failed configuration is a row saying FAILED
and why.
"""

from __future__ import annotations

import math
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from omni_dp.bench.results import (
    BenchResult,
    ConfigResult,
    LevelSummary,
    PointResult,
    Range,
)
from omni_dp.bench.scaling import BASELINE, compared_level, saturated, scaling_range
from omni_dp.bench.text import (
    failures_text,
    machine_text,
    range_text,
    settings_text,
)
from omni_dp.tables import Grid, render

SCHEMA = 1  # of to_json's output; raised when a key changes meaning


# --- what is derived from the results ----------------------------------------------------------


def points_at(config: ConfigResult, concurrency: int) -> list[PointResult]:
    return [p for p in config.points if p.concurrency == concurrency]


def balance(config: ConfigResult) -> dict[str, float]:
    """Replica id -> its share of the ok requests at the compared level, over its trials: a
    router that starved a replica shows here, not in the throughput alone."""
    level = compared_level(config)
    if level is None:
        return {}
    counts: dict[str, int] = {}
    for point in points_at(config, level.concurrency):
        for replica, ok in point.per_replica.items():
            counts[replica] = counts.get(replica, 0) + ok
    total = sum(counts.values())
    return {replica: ok / total for replica, ok in sorted(counts.items())} if total else {}


def balance_text(shares: dict[str, float]) -> str:
    return " / ".join(f"{replica}: {share:.0%}" for replica, share in shares.items()) or "—"


def throughput_columns(result: BenchResult) -> list[tuple[str, str]]:
    """(LevelSummary field, header): audio-s/s for speech, tokens/s for completions; both when
    both came, the workload's own when nothing did."""
    levels = [level for c in result.configs for level in c.levels]
    columns = [(name, header) for name, header in (("audio_s_per_s", "audio s/s"),
                                                    ("tokens_per_s", "tokens/s"))
               if any(getattr(level, name).high > 0 for level in levels)]
    if columns:
        return columns
    completions = any(word in result.workload.lower() for word in ("complet", "chat", "token"))
    return [("tokens_per_s", "tokens/s") if completions else ("audio_s_per_s", "audio s/s")]


# --- JSON --------------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """Plain JSON types: lists for tuples, str keys, None for a non-finite float (strict
    JSON has no inf or nan)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def to_json(result: BenchResult) -> dict:
    """The whole run, every field of the results, and what the tables derive from them: per
    configuration `compared_at` (the level of its ratio), `saturated` and `balance`; at the top
    `scaling_range` (each ratio's low/median/high)."""
    data = _plain(asdict(result))
    for config, shown in zip(result.configs, data["configs"], strict=True):
        level = compared_level(config)
        shown["compared_at"] = level.concurrency if level is not None else None
        shown["saturated"] = saturated(config)
        shown["balance"] = balance(config)
    data["scaling_range"] = {name: r.to_json()
                             for name, r in scaling_range(result.configs).items()}
    return {"schema": SCHEMA, **data}


def _range(data: dict | None) -> Range | None:
    return None if data is None else Range(**data)


def _level(data: dict) -> LevelSummary:
    ranges = ("requests_per_s", "audio_s_per_s", "tokens_per_s", "latency_p99_s", "ttfb_p50_s")
    return LevelSummary(**{**data, **{name: _range(data[name]) for name in ranges}})


def _config(data: dict) -> ConfigResult:
    own = {f.name for f in fields(ConfigResult)}
    values = {k: v for k, v in data.items() if k in own}
    values["points"] = tuple(PointResult(**p) for p in data["points"])
    values["levels"] = tuple(_level(level) for level in data["levels"])
    return ConfigResult(**values)


def from_json(data: dict) -> BenchResult:
    """to_json's output read back (what is derived is dropped: it is derived again)."""
    own = {f.name for f in fields(BenchResult)}
    values = {k: v for k, v in data.items() if k in own}
    values["configs"] = tuple(_config(c) for c in data["configs"])
    return BenchResult(**values)


# --- the tables ---------------------------------------------------------------------------------


def configs_table(result: BenchResult) -> Grid:
    """One row per configuration: how it ended (ok, degraded, FAILED and why), where it
    saturated and why the sweep stopped there, the verdict."""
    rows = [(c.name, str(c.replicas) if c.replicas is not None else "—",
             "yes" if c.mps else "no", "FAILED" if c.status == "failed" else c.status,
             f"c={c.saturation}" if c.saturation is not None else "—", c.stop_reason or "—",
             c.verdict or "—", c.reason or "—") for c in result.configs]
    return Grid(f"omni-dp bench: {result.workload} on {machine_text(result.machine)}",
                ("config", "replicas", "MPS", "status", "saturated at", "stopped because",
                 "verdict", "why"), rows, caption=settings_text(result.settings),
                warn=frozenset(n for n, c in enumerate(result.configs) if c.status == "failed"))


def _level_cells(c: ConfigResult, level: LevelSummary, throughput: list[tuple[str, str]]
                 ) -> list[str]:
    compared = compared_level(c)
    here = compared is not None and level.concurrency == compared.concurrency
    mark = ""
    if here:
        mark = "◀ saturation" if saturated(c) else "◀ compared (not saturated)"
    return [c.name, str(level.concurrency), str(level.trials), range_text(level.requests_per_s),
            *(range_text(getattr(level, name)) for name, _ in throughput),
            range_text(level.latency_p99_s), range_text(level.ttfb_p50_s),
            failures_text(level.failures, level.requests),
            balance_text(balance(c)) if here else "", mark]


def levels_table(result: BenchResult) -> Grid:
    """Per configuration and concurrency: the trials' ranges, the failures by kind, and at the
    compared level the per-replica balance and the saturation mark."""
    throughput = throughput_columns(result)
    headers = ("config", "c", "trials", "req/s", *(h for _, h in throughput), "p99 latency s",
               "TTFB p50 s", "failed/sent", "balance", "mark")
    rows: list[tuple[str, ...]] = []
    sections, warn = set(), set()
    for c in result.configs:
        sections.add(len(rows))
        rows += [tuple(_level_cells(c, level, throughput)) for level in c.levels]
        if c.status == "failed":
            warn.add(len(rows))
            rows.append((c.name, "—", "—", "FAILED", *[""] * (len(headers) - 5),
                         c.reason or ""))
        elif not c.levels:
            rows.append((c.name, "—", "—", "no level ran", *[""] * (len(headers) - 4)))
    return Grid("per concurrency level: median [low–high] over the trials", headers, rows,
                sections=frozenset(sections), warn=frozenset(warn))


def _ratio_cells(result: BenchResult, c: ConfigResult, ranges: dict[str, Range]) -> list[str]:
    level = compared_level(c)
    assert level is not None
    at = f"c={level.concurrency}" + ("" if saturated(c) else " (not saturated)")
    ratio, spread, each = "— (no baseline)", "—", "—"
    if c.name == BASELINE:
        ratio = "1 (baseline)"
    elif c.name in result.scaling:
        value = result.scaling[c.name]
        ratio = f"{value:.2f}×"
        if c.name in ranges:
            spread = f"{ranges[c.name].low:.2f}–{ranges[c.name].high:.2f}×"
        if c.replicas:
            each = f"{value / c.replicas:.2f}×"
    return [c.name, str(c.replicas or "—"), at, range_text(level.requests_per_s), ratio,
            spread, each]


def scaling_table(result: BenchResult) -> Grid:
    """Each configuration against the single replica, each at its own saturation; the premise
    is the table's caption, so the ratio is never shown without it."""
    ranges = scaling_range(result.configs)
    rows, warn = [], set()
    for c in result.configs:
        if compared_level(c) is None:
            why = "FAILED: no ratio" if c.status == "failed" else "no level ran: no ratio"
            warn.add(len(rows))
            rows.append((c.name, str(c.replicas or "—"), "—", "—", why, "—", "—"))
        else:
            rows.append(tuple(_ratio_cells(result, c, ranges)))
    return Grid(f"scaling against configuration {BASELINE}",
                ("config", "replicas", "at", "req/s there", "ratio vs 1", "ratio range",
                 "per replica"), rows, caption=f"premise: {result.premise}",
                warn=frozenset(warn))


def render_table(result: BenchResult) -> list[Grid]:
    """The configurations, the levels, the scaling with its premise: in that order."""
    return [configs_table(result), levels_table(result), scaling_table(result)]


def print_report(result: BenchResult, fmt: str = "table", stream=None) -> None:
    """The tables to `stream` (stdout): rich on a terminal, plain or markdown elsewhere."""
    render(render_table(result), fmt, stream)


def render_png(result: BenchResult, path: str | Path) -> Path:
    """The figure (omni_dp/bench/figure.py); matplotlib is imported only here."""
    from omni_dp.bench.figure import render_png as render

    return render(result, path)
