"""How much of the replicas' GPU busy time overlapped: the arithmetic of `verify-mps --overlap`.

Input: each replica's busy intervals on one GPU (wall-clock seconds, from its GET /gpu_busy).
A replica's own intervals are merged first (its talker and vocoder overlap each other, and that
says nothing about MPS); then one sweep over every boundary gives the union (time at least one
replica was busy) and the time two or more were busy at once. The share is the second over the
first.

The threshold, DEFAULT_MIN_SHARE = 0.2. Under MPS each replica's kernels run whenever it has
work, so replicas busy a fraction f of the time each, independently, are busy together about
f² of it: the share is f/(2 − f), 0.82 at f = 0.9 (a loaded replica is inside a step most of
the time), 0.33 at f = 0.5, 0.2 at f = 1/3. Without MPS the GPU runs one context at a time:
steps whose kernels keep the GPU busy alternate, and what overlaps is the event timing's error
(microseconds at each boundary of millisecond steps), a share of a few percent at most. 0.2
sits far from both. Replicas too idle to tell (independent ones this busy would share less than
the threshold: `independent_share`) are CANNOT_CHECK, not FAIL: a light load is no proof of
alternation.

Caveat, for the first GPU runs to settle: a step is bracketed as a whole, so where a step
leaves the GPU idle between its kernels (a small model, launch-bound) another context can run
inside it even without MPS and the brackets overlap; bench/gpu_run.sh's overlap step records
the share with and without MPS.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

PASS, FAIL, CANNOT_CHECK = "PASS", "FAIL", "CANNOT_CHECK"
DEFAULT_MIN_SHARE = 0.2
# Less busy time than this over all replicas is a few steps: no basis for a verdict.
MIN_UNION_S = 0.05

Interval = tuple[float, float]


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, overlapping or touching ones joined, empty ones dropped; ValueError for an
    interval that ends before it starts or is not finite."""
    ordered = []
    for start, end in intervals:
        if not (math.isfinite(start) and math.isfinite(end)) or end < start:
            raise ValueError(f"[{start}, {end}] is not an interval")
        if end > start:
            ordered.append((start, end))
    ordered.sort()
    merged: list[Interval] = []
    for start, end in ordered:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def sweep(per_replica: Iterable[list[Interval]]) -> tuple[float, float]:
    """(union, time with two or more busy) over replicas' merged intervals. At one instant an
    end counts before a start: intervals that only touch never overlap."""
    edges = sorted((t, delta) for intervals in per_replica for start, end in intervals
                   for t, delta in ((start, 1), (end, -1)))
    union = together = 0.0
    busy, last = 0, 0.0
    for t, delta in edges:
        if busy >= 1:
            union += t - last
        if busy >= 2:
            together += t - last
        busy += delta
        last = t
    return union, together


def independent_share(fractions: Iterable[float]) -> float:
    """The share replicas busy these fractions of the window would have if each were busy
    regardless of the others (as under MPS): P(two or more) / P(one or more)."""
    fs = [min(max(f, 0.0), 1.0) for f in fractions]
    none = math.prod(1 - f for f in fs)
    one = sum(f * math.prod(1 - g for j, g in enumerate(fs) if j != i)
              for i, f in enumerate(fs))
    some = 1 - none
    return (some - one) / some if some > 0 else 0.0


@dataclass(frozen=True)
class OverlapReport:
    """The overlap of one GPU's replicas over a window (seconds)."""

    result: str
    reason: str
    share: float | None  # together / union; None when nothing was busy
    union_s: float
    together_s: float
    window_s: float
    busy_s: dict[str, float] = field(default_factory=dict)  # per replica, own steps merged
    independent_share: float | None = None
    min_share: float = DEFAULT_MIN_SHARE

    def to_json(self) -> dict:
        return {"result": self.result, "reason": self.reason, "share": self.share,
                "min_share": self.min_share, "union_s": self.union_s,
                "together_s": self.together_s, "window_s": self.window_s,
                "busy_s": dict(self.busy_s), "independent_share": self.independent_share}


def overlap_share(intervals_by_replica: Mapping[str, Iterable[Interval]], *,
                  window: Interval | None = None,
                  min_share: float = DEFAULT_MIN_SHARE) -> OverlapReport:
    """The share of busy time with two or more replicas busy at once, and its verdict.

    `window`: the span the busy fractions are taken over (the load's); default the span of
    the intervals. ValueError when an interval is not one."""
    merged = {name: merge(found) for name, found in intervals_by_replica.items()}
    busy = {name: sum(end - start for start, end in found) for name, found in merged.items()}
    union, together = sweep(merged.values())
    if window is None:
        edges = [t for found in merged.values() for iv in found for t in iv]
        window = (min(edges), max(edges)) if edges else (0.0, 0.0)
    span = max(window[1] - window[0], union)
    share = together / union if union > 0 else None
    expected = independent_share(b / span for b in busy.values()) if span > 0 else None
    report = {"share": share, "union_s": union, "together_s": together, "window_s": span,
              "busy_s": busy, "independent_share": expected, "min_share": min_share}
    active = [name for name, b in busy.items() if b > 0]
    if len(active) < 2:
        return OverlapReport(CANNOT_CHECK, f"{len(active)} replica(s) were busy on the GPU "
                             "(two are needed to overlap)", **report)
    if union < MIN_UNION_S:
        return OverlapReport(CANNOT_CHECK, f"{union * 1000:.1f} ms of busy time in all, less "
                             f"than the {MIN_UNION_S * 1000:.0f} ms a verdict needs", **report)
    assert share is not None and expected is not None
    if share >= min_share:
        return OverlapReport(PASS, f"two or more replicas busy at once {share:.0%} of the busy "
                             f"time (≥ {min_share:.0%})", **report)
    if expected < min_share:
        return OverlapReport(CANNOT_CHECK, f"the replicas were too idle to tell: even "
                             f"independent ones this busy would overlap {expected:.0%} of "
                             f"the time (< {min_share:.0%}); drive more load", **report)
    return OverlapReport(FAIL, f"two or more replicas busy at once only {share:.0%} of the "
                         f"busy time (< {min_share:.0%}; independent ones this busy would "
                         f"overlap {expected:.0%}): their kernels take turns", **report)
