"""One scrape of a Prometheus `/metrics` page, parsed, and the sums `omni-dp top` reads from it.

Parsed by prometheus-client's own parser (the exporter's project keeps it in step with the
format), never by hand. A scrape is kept as its samples by sample name, so that a counter is read
as `name_total` and a histogram as its `_bucket`, `_count` and `_sum` series, summed over every
label set that matches: a replica's TTFA over all of its formats and classes, say. Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

Labels = Mapping[str, str]


@dataclass(frozen=True)
class Histogram:
    """A histogram's cumulative bucket counts by upper bound (the last one +Inf), and the sum
    of its observations."""

    bounds: tuple[float, ...]
    counts: tuple[float, ...]
    total: float = 0.0

    @property
    def count(self) -> float:
        return self.counts[-1] if self.counts else 0.0

    def since(self, earlier: Histogram | None) -> Histogram:
        """The observations made after `earlier`, bucket by bucket. One that went down (its
        process restarted and counts from 0 again) is all new, as Prometheus's rate() takes a
        counter reset."""
        if earlier is None or earlier.bounds != self.bounds or any(
                now < then for now, then in zip(self.counts, earlier.counts, strict=True)):
            return self
        return Histogram(self.bounds,
                         tuple(now - then for now, then in zip(self.counts, earlier.counts,
                                                                strict=True)),
                         self.total - earlier.total)

    def plus(self, other: Histogram) -> Histogram | None:
        """Both together; None where their buckets differ (they cannot be added)."""
        if other.bounds != self.bounds:
            return None
        return Histogram(self.bounds, tuple(a + b for a, b in zip(self.counts, other.counts,
                                                                  strict=True)),
                         self.total + other.total)

    def quantile(self, q: float) -> float | None:
        """The q-quantile as Prometheus's histogram_quantile() estimates it: linear within the
        bucket it falls in (the first from 0); in the +Inf bucket, the highest finite bound.
        None with no observation."""
        count = self.count
        if count <= 0:
            return None
        rank = q * count
        i = next(n for n, c in enumerate(self.counts) if c >= rank)
        upper = self.bounds[i]
        if math.isinf(upper):
            return self.bounds[i - 1] if i > 0 else None
        lower = self.bounds[i - 1] if i > 0 else min(0.0, upper)
        below = self.counts[i - 1] if i > 0 else 0.0
        inside = self.counts[i] - below
        return upper if inside <= 0 else lower + (upper - lower) * (rank - below) / inside

    def mean(self) -> float | None:
        return self.total / self.count if self.count > 0 else None


@dataclass(frozen=True)
class Scrape:
    """What one GET /metrics answered, at `at` (time.monotonic()), or why it could not be read
    (`error`: then no samples)."""

    at: float
    samples: Mapping[str, tuple[tuple[Labels, float], ...]] = field(default_factory=dict)
    families: frozenset[str] = frozenset()  # every family exported, with samples or none
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def has(self, family: str) -> bool:
        """The page exports this family (a labelled one may have no sample yet)."""
        return family in self.families

    def total(self, name: str, **labels: str) -> float:
        """The sum of sample `name` over every label set holding `labels` (0 where none)."""
        return sum(value for found, value in self.samples.get(name, ())
                   if _holds(found, labels))

    def histogram(self, family: str, **labels: str) -> Histogram | None:
        """Histogram `family` summed over every label set holding `labels`; None where the page
        has no bucket of it."""
        by_bound: dict[float, float] = {}
        for found, value in self.samples.get(family + "_bucket", ()):
            if _holds(found, labels):
                bound = float(found["le"])
                by_bound[bound] = by_bound.get(bound, 0.0) + value
        if not by_bound:
            return None
        bounds = tuple(sorted(by_bound))
        return Histogram(bounds, tuple(by_bound[b] for b in bounds),
                         self.total(family + "_sum", **labels))


def _holds(found: Labels, wanted: Mapping[str, str]) -> bool:
    return all(found.get(k) == v for k, v in wanted.items())


def parse(text: str, at: float) -> Scrape:
    """The scrape of this exposition text; ValueError where it is not Prometheus text."""
    samples: dict[str, list[tuple[Labels, float]]] = {}
    families = set()
    for family in text_string_to_metric_families(text):
        families.add(family.name)
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return Scrape(at, {name: tuple(found) for name, found in samples.items()},
                  frozenset(families))


def unreadable(at: float, why: str) -> Scrape:
    return Scrape(at, error=why)
