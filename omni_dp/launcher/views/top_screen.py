"""`omni-dp top`'s I/O: scrape a run's router and replicas (all at once, each bounded by a
timeout), draw the frame top.py computes, and loop. A target that does not answer, answers an
error or answers something that is not Prometheus text is a scrape with its reason, drawn as
such: never an exception out of here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TextIO

from omni_dp.blocking_http import call
from omni_dp.launcher.views.exposition import Scrape, parse, unreadable
from omni_dp.launcher.views.top import (
    UNDERRUN_THRESHOLD_MS,
    Frame,
    ReplicaRow,
    Sweep,
    frame,
    router_url,
)
from omni_dp.runfile import RunFileError, RunRecord, read_run
from omni_dp.tables import Grid, render, rich_table

METRICS_PATH = "/metrics"
HEALTHY = ("healthy",)
_SOURCES = {"router": "the router's", "replicas": "the replicas' summed"}


def scrape(url: str, timeout: float) -> Scrape:
    """GET url/metrics, parsed; its reason where it cannot be read."""
    answer = call("GET", url + METRICS_PATH, timeout=timeout, headers={"Accept": "text/plain"})
    at = time.monotonic()
    if answer.status == 0:
        return unreadable(at, answer.error or "no answer")
    if answer.status != 200:
        return unreadable(at, f"HTTP {answer.status}")
    try:
        return parse(answer.text, at)
    except ValueError as exc:
        return unreadable(at, f"not Prometheus text ({exc})")


def sweep(record: RunRecord, timeout: float) -> Sweep:
    """The router's and every replica's /metrics, fetched side by side."""
    urls = {None: router_url(record), **{r.index: r.url for r in record.replicas}}
    with ThreadPoolExecutor(max_workers=len(urls)) as pool:
        found = dict(zip(urls, pool.map(lambda u: scrape(u, timeout), urls.values()),
                         strict=True))
    return Sweep(found.pop(None), found)


def reread(directory: Path, last: RunRecord) -> RunRecord:
    """The run's record as it is now (replicas restart, are added or removed); the last one
    read where it cannot be read this time."""
    try:
        return read_run(directory)[0]
    except RunFileError:
        return last


# --- drawing -----------------------------------------------------------------------------------

HEADERS = ("replica", "health", "in flight", "req/s", "requests", "TTFA p50", "TTFA p99", "RTF",
           "underruns", "restarts")


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def _number(value: float | int | None, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)


def _underruns(underruns: int | None, completed: int | None) -> str:
    return "-" if underruns is None else f"{underruns}/{completed}"


def _row(row: ReplicaRow) -> tuple[str, ...]:
    health = row.health if row.metrics_error is None else \
        f"{row.health}; /metrics unreadable: {row.metrics_error}"
    return (str(row.index), health, _number(row.in_flight), _number(row.requests_per_s, ".1f"),
            _number(row.requests), _seconds(row.ttfa_p50_s), _seconds(row.ttfa_p99_s),
            _number(row.rtf, ".2f"), _underruns(row.underruns, row.completed),
            str(row.restarts))


def grid(shown: Frame) -> Grid:
    """The frame as a table: one row per replica, the fleet's last, what the figures cover in
    the title and how they were measured in the caption."""
    fleet = shown.fleet
    window = ("since each process started" if shown.window_s is None
              else f"over the last {shown.window_s:.1f} s")
    routable = "router unreadable: " + (fleet.router_error or "") if fleet.routable is None \
        else f"{fleet.routable}/{fleet.replicas} routable"
    rows = [_row(row) for row in shown.rows]
    rows.append(("fleet", routable, _number(fleet.in_flight),
                 _number(fleet.requests_per_s, ".1f"), _number(fleet.requests),
                 _seconds(fleet.ttfa_p50_s), _seconds(fleet.ttfa_p99_s),
                 _number(fleet.rtf, ".2f"), _underruns(fleet.underruns, fleet.completed),
                 str(fleet.restarts)))
    warn = frozenset(n for n, row in enumerate(shown.rows)
                     if row.health not in HEALTHY or row.metrics_error)
    return Grid(f"run {shown.run_id}  router {shown.router_url}  figures {window}", HEADERS,
                rows, caption=f"TTFA, RTF (mean), underruns (completed responses with a "
                              f"stall over {UNDERRUN_THRESHOLD_MS} ms): a replica's from its "
                              f"/metrics, the fleet's from {_SOURCES[fleet.audio_source]}; "
                              "in flight, requests, health: the router's; restarts: run.json",
                sections=frozenset({len(rows) - 1}), warn=warn)


# --- the loops ---------------------------------------------------------------------------------


def once(directory: Path, record: RunRecord, interval: float, timeout: float) -> Frame:
    """Two looks `interval` seconds apart, and the frame of the second over the window."""
    before = sweep(record, timeout)
    time.sleep(interval)
    record = reread(directory, record)
    return frame(record, before, sweep(record, timeout))


def print_frame(shown: Frame, stream: TextIO | None = None) -> None:
    render([grid(shown)], "table", stream)


def live(directory: Path, record: RunRecord, interval: float, timeout: float, *,
         console=None, ticks: Callable[[], bool] = lambda: True) -> None:
    """Redraw every `interval` seconds in place (rich.live.Live) until Ctrl-C (the caller's
    KeyboardInterrupt) or `ticks` says stop; the first frame at once, since the start."""
    from rich.live import Live

    before = sweep(record, timeout)
    with Live(rich_table(grid(frame(record, None, before))), console=console,
              auto_refresh=False, transient=False) as screen:
        while ticks():
            time.sleep(interval)
            record = reread(directory, record)
            after = sweep(record, timeout)
            screen.update(rich_table(grid(frame(record, before, after))), refresh=True)
            before = after
