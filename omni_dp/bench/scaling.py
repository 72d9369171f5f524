"""Each configuration's ratio to the single replica, each at its own saturating concurrency,
and the premise that says so, both derived from the configurations alone: the table, the JSON
and the figure then show one number and one premise, never two versions of either.

A ratio at one shared concurrency would compare a saturated single replica with N replicas that
still have room (or the reverse), so each configuration is taken where its own throughput
stopped rising. One whose sweep ended before that is taken at its highest level, and the
premise says so; a failed configuration gets no ratio and is named as failed.
"""

from __future__ import annotations

from collections.abc import Iterable

from omni_dp.bench.results import ConfigResult, LevelSummary, Range
from omni_dp.bench.stats import RAN_OUT

BASELINE = "1"  # the single replica every other configuration is measured against


def compared_level(config: ConfigResult) -> LevelSummary | None:
    """The level a configuration is compared at: its saturation's, else (the sweep stopped
    before throughput stopped rising) its highest median throughput; None when it failed or
    has no level."""
    if config.status == "failed" or not config.levels:
        return None
    for level in config.levels:
        if level.concurrency == config.saturation:
            return level
    # No saturation: the sweep ran out still rising (compare at its best level), or its first
    # level already broke a bound (p99, failures): no level of it is one to compare.
    if config.stop_reason is None or RAN_OUT not in config.stop_reason:
        return None
    return max(config.levels, key=lambda level: level.requests_per_s.median)


def saturated(config: ConfigResult) -> bool:
    """Whether the compared level is a saturation the sweep found (not just its highest)."""
    level = compared_level(config)
    return level is not None and level.concurrency == config.saturation


def _baseline(configs: Iterable[ConfigResult]) -> tuple[ConfigResult, LevelSummary] | None:
    for config in configs:
        level = compared_level(config) if config.name == BASELINE else None
        if level is not None and level.requests_per_s.median > 0:
            return config, level
    return None


def scaling(configs: Iterable[ConfigResult]) -> dict[str, float]:
    """Config name -> its median req/s at its compared level over config 1's at its own; {}
    without a single replica that ran (nothing to measure against)."""
    configs = tuple(configs)
    base = _baseline(configs)
    if base is None:
        return {}
    reference = base[1].requests_per_s.median
    ratios = {}
    for config in configs:
        level = compared_level(config)
        if config.name != BASELINE and level is not None:
            ratios[config.name] = level.requests_per_s.median / reference
    return ratios


def scaling_range(configs: Iterable[ConfigResult]) -> dict[str, Range]:
    """The ratio's range over the trials, the widest the ranges allow: its lowest trial over
    config 1's highest, its highest over config 1's lowest (omitted where that is 0)."""
    configs = tuple(configs)
    base = _baseline(configs)
    if base is None or base[1].requests_per_s.low <= 0:
        return {}
    reference = base[1].requests_per_s
    ranges = {}
    for config in configs:
        level = compared_level(config)
        if config.name != BASELINE and level is not None:
            mine = level.requests_per_s
            ranges[config.name] = Range(mine.low / reference.high,
                                        mine.median / reference.median,
                                        mine.high / reference.low)
    return ranges


def _where(config: ConfigResult, level: LevelSummary) -> str:
    replicas = config.replicas or 1
    each = level.concurrency / replicas
    each_text = f"{each:.0f}" if each == int(each) else f"{each:.1f}"
    share = f" ({each_text} per replica)" if replicas > 1 else ""
    if saturated(config):
        return f"{config.name} at c={level.concurrency}{share}"
    return (f"{config.name} at c={level.concurrency}{share}, not saturated (its highest "
            "throughput of the levels run)")


def premise_text(configs: Iterable[ConfigResult]) -> str:
    """The premise the ratios hold under, generated from the data: where each configuration
    was taken, and which have no ratio and why."""
    configs = tuple(configs)
    places, without = [], []
    for config in configs:
        level = compared_level(config)
        if level is not None:
            places.append(_where(config, level))
        elif config.status == "failed":
            without.append(f"{config.name} (failed)")
        else:
            without.append(f"{config.name} (no level ran)")
    text = "each configuration at its own saturating concurrency"
    if places:
        text += ": " + "; ".join(places)
    if without:
        text += "; no ratio for " + ", ".join(without)
    base = _baseline(configs)
    if base is None:
        text += (f"; no ratio: configuration {BASELINE} (the single replica) has no result to "
                 "compare with")
    else:
        text += (f"; ratio = median req/s there ÷ {BASELINE}'s median req/s at "
                 f"c={base[1].concurrency}")
    return text
