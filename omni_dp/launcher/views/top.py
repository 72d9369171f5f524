"""`omni-dp top`: a run's replicas and its fleet from two looks at their /metrics. Pure: the
scrapes come in (exposition.py parsed them), the rows go out; top_screen.py fetches and draws.

Figures over a window: between two looks, counters' and histograms' deltas (`window_s` the
seconds between the router's two scrapes); with one look only (the live view's first frame),
everything since each process started (`window_s` None, no rates). Per replica, the audio
figures are the replica's own series (omni_dp_audio_*), summed over its formats and classes; the
fleet's are the router's (omni_dp_router_audio_*: what the clients got, resumed streams' gaps
included), or the replicas' summed where the router exports none. In flight, requests and
health are the router's view of each replica; state and restarts are the run record's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass

from omni_dp.launcher.views.exposition import Histogram, Scrape
from omni_dp.runfile import ReplicaRecord, ReplicaState, RunRecord

# Time to first audio: the audio SLO series, else (a replica without them) the older one.
TTFA = ("omni_dp_audio_ttfa_seconds", "omni_dp_time_to_first_audio_seconds")
RTF = "omni_dp_audio_real_time_factor"
UNDERRUN = "omni_dp_audio_underrun_seconds"
CONTINUITY = "omni_dp_audio_continuity_ok_total"
ROUTER = "omni_dp_router_"
# An underrun: a completed response whose largest stall a real-time player would hear passed
# this many milliseconds (the smallest threshold of the continuity counter).
UNDERRUN_THRESHOLD_MS = "100"


@dataclass(frozen=True)
class Sweep:
    """One look at a run: the router's scrape, and each replica's by index."""

    router: Scrape
    replicas: Mapping[int, Scrape]


@dataclass(frozen=True)
class AudioFigures:
    """The audio SLO figures of a window (None: no such series, or no observation in it).
    Its field names are ReplicaRow's and FleetRow's own: the rows take them by name."""

    ttfa_p50_s: float | None = None
    ttfa_p99_s: float | None = None
    rtf: float | None = None  # mean real-time factor: e2e latency / audio seconds
    completed: int | None = None  # responses completed (whose underrun was measured)
    underruns: int | None = None  # of them, those with a stall over the threshold


@dataclass(frozen=True)
class ReplicaRow:
    index: int
    url: str
    state: str  # the run record's: healthy, starting, restarting, down, failed, ...
    health: str  # one word from both views: healthy, held out, not routed, or the state
    healthy: bool | None  # the router's omni_dp_router_replica_healthy (None: unread)
    routable: bool | None  # the router's omni_dp_router_replica_routable
    in_flight: int | None
    requests: int | None  # answered through the router, since it started
    requests_per_s: float | None
    ttfa_p50_s: float | None
    ttfa_p99_s: float | None
    rtf: float | None
    completed: int | None
    underruns: int | None
    restarts: int
    metrics_error: str | None  # why its /metrics could not be read


@dataclass(frozen=True)
class FleetRow:
    replicas: int
    routable: int | None
    in_flight: int | None
    requests: int | None
    requests_per_s: float | None
    ttfa_p50_s: float | None
    ttfa_p99_s: float | None
    rtf: float | None
    completed: int | None
    underruns: int | None
    restarts: int
    audio_source: str  # "router" or "replicas": whose series the audio figures are
    router_error: str | None


@dataclass(frozen=True)
class Frame:
    run_id: str
    router_url: str
    window_s: float | None  # None: since each process started (one look only)
    rows: tuple[ReplicaRow, ...]
    fleet: FleetRow

    def to_json(self) -> dict:
        return {"run_id": self.run_id, "router_url": self.router_url,
                "window_s": self.window_s,
                "basis": "cumulative" if self.window_s is None else "window",
                "underrun_threshold_ms": int(UNDERRUN_THRESHOLD_MS),
                "replicas": [asdict(row) for row in self.rows], "fleet": asdict(self.fleet)}


def router_url(record: RunRecord) -> str:
    """Where the router serves: as recorded, else where the plan put it."""
    return record.router.url if record.router else record.plan.router.url


def frame(record: RunRecord, before: Sweep | None, after: Sweep) -> Frame:
    """The frame of `after`, over the window since `before` (None: since the start)."""
    window = after.router.at - before.router.at if before is not None else None
    rows = tuple(_row(r, before, after, window) for r in record.replicas)
    return Frame(record.run_id, router_url(record), window, rows,
                 _fleet(rows, before, after, window))


def _row(replica: ReplicaRecord, before: Sweep | None, after: Sweep,
         window: float | None) -> ReplicaRow:
    rid = str(replica.index)
    router = after.router
    healthy = routable = in_flight = requests = rate = None
    if router.ok:
        healthy = _flag(router, ROUTER + "replica_healthy", rid)
        routable = _flag(router, ROUTER + "replica_routable", rid)
        in_flight = int(router.total(ROUTER + "in_flight", replica=rid))
        requests = int(router.total(ROUTER + "requests_total", replica=rid))
        if before is not None and before.router.ok and window:
            then = int(before.router.total(ROUTER + "requests_total", replica=rid))
            rate = _increase(requests, then) / window
    scrape = after.replicas.get(replica.index)
    earlier = before.replicas.get(replica.index) if before else None
    audio = replica_audio(scrape, earlier) if scrape is not None and scrape.ok else AudioFigures()
    error = None if scrape is None else scrape.error
    return ReplicaRow(
        index=replica.index, url=replica.url, state=replica.state.value,
        health=health(replica.state, healthy, routable), healthy=healthy, routable=routable,
        in_flight=in_flight, requests=requests, requests_per_s=rate, **asdict(audio),
        restarts=len(replica.restarts), metrics_error=error)


def health(state: ReplicaState, healthy: bool | None, routable: bool | None) -> str:
    """The record's state where it says the replica is not serving (starting, restarting,
    down, failed, stopped); else the router's view: `healthy` (it routes to it), `held out`
    (healthy, but not routed to: drained for a restart or a removal), `not routed` (ejected
    or not yet checked); the record's state, `(as recorded)`, where the router could not be
    read."""
    if state not in (ReplicaState.HEALTHY, ReplicaState.UNHEALTHY):
        return state.value
    if healthy is None:
        return f"{state.value} (as recorded)"
    if routable:
        return "healthy"
    return "held out" if healthy else "not routed"


def _flag(scrape: Scrape, name: str, rid: str) -> bool | None:
    found = [v for labels, v in scrape.samples.get(name, ()) if labels.get("replica") == rid]
    return bool(found[-1]) if found else None


def _increase(now: float, then: float) -> float:
    """A counter's increase; one lower than before was reset (its process restarted)."""
    return now - then if now >= then else now


def _window(scrape: Scrape, earlier: Scrape | None, family: str,
            **labels: str) -> Histogram | None:
    now = scrape.histogram(family, **labels)
    if now is None:
        return None
    then = earlier.histogram(family, **labels) if earlier is not None and earlier.ok else None
    return now.since(then)


def _counter(scrape: Scrape, earlier: Scrape | None, name: str, **labels: str) -> float:
    now = scrape.total(name, **labels)
    if earlier is None or not earlier.ok:
        return now
    return _increase(now, earlier.total(name, **labels))


def replica_audio(scrape: Scrape, earlier: Scrape | None) -> AudioFigures:
    """A replica's audio figures over the window (or since its start, without `earlier`)."""
    return audio(_window(scrape, earlier, _ttfa(scrape)), _window(scrape, earlier, RTF),
                 _window(scrape, earlier, UNDERRUN),
                 _continuity(scrape, earlier, CONTINUITY))


def _ttfa(scrape: Scrape) -> str:
    """The TTFA family to read: the audio SLO one, else (a replica that exports none of it,
    or no observation yet) the older one where that has observations."""
    return next((name for name in TTFA if scrape.histogram(name) is not None), TTFA[0])


def router_audio(scrape: Scrape, earlier: Scrape | None) -> AudioFigures | None:
    """The router's audio figures over all replicas; None where it exports none."""
    prefix = "omni_dp_router_audio_"
    if not scrape.has(prefix + "ttfa_seconds"):
        return None
    return audio(_window(scrape, earlier, prefix + "ttfa_seconds"),
                 _window(scrape, earlier, prefix + "real_time_factor"),
                 _window(scrape, earlier, prefix + "underrun_seconds"),
                 _continuity(scrape, earlier, prefix + "continuity_ok_total"))


def _continuity(scrape: Scrape, earlier: Scrape | None, name: str) -> float | None:
    if not scrape.samples.get(name):
        return None
    return _counter(scrape, earlier, name, threshold_ms=UNDERRUN_THRESHOLD_MS)


def audio(ttfa: Histogram | None, rtf: Histogram | None, underrun: Histogram | None,
          continuity_ok: float | None) -> AudioFigures:
    """The figures from the window's histograms and the continuity counter's increase."""
    completed = int(underrun.count) if underrun is not None else None
    underruns = None
    if completed is not None and continuity_ok is not None:
        underruns = max(0, completed - int(continuity_ok))
    return AudioFigures(ttfa.quantile(0.5) if ttfa else None, ttfa.quantile(0.99) if ttfa else None,
                 rtf.mean() if rtf else None, completed, underruns)


def _summed(histograms: list[Histogram | None]) -> Histogram | None:
    present = [h for h in histograms if h is not None]
    if not present:
        return None
    total: Histogram | None = present[0]
    for h in present[1:]:
        total = total.plus(h) if total is not None else None
    return total


def replicas_audio(before: Sweep | None, after: Sweep) -> AudioFigures:
    """The replicas' audio series added together (where the router exports none)."""
    pairs = [(s, before.replicas.get(i) if before else None)
             for i, s in after.replicas.items() if s.ok]
    ttfa = [_window(s, e, _ttfa(s)) for s, e in pairs]
    ok = [_continuity(s, e, CONTINUITY) for s, e in pairs]
    return audio(_summed(ttfa), _summed([_window(s, e, RTF) for s, e in pairs]),
                 _summed([_window(s, e, UNDERRUN) for s, e in pairs]),
                 sum(v for v in ok if v is not None) if any(v is not None for v in ok)
                 else None)


def _fleet_audio(before: Sweep | None, after: Sweep) -> tuple[AudioFigures, str]:
    """The fleet's audio and where it was read: the router's series, where bytes leave for the
    client, or the replicas' added together where the router exports none."""
    router = after.router
    if router.ok:
        earlier = before.router if before is not None and before.router.ok else None
        figures = router_audio(router, earlier)
        if figures is not None:
            return figures, "router"
    return replicas_audio(before, after), "replicas"


def _fleet_rate(rows: tuple[ReplicaRow, ...], before: Sweep | None, after: Sweep,
                window: float | None) -> float | None:
    """Requests a second over the window, from the router's counts (None without two sweeps)."""
    if not window or before is None or not (after.router.ok and before.router.ok):
        return None
    earlier = before.router
    return sum(_increase(row.requests or 0, earlier.total(
        ROUTER + "requests_total", replica=str(row.index))) for row in rows) / window


def _fleet(rows: tuple[ReplicaRow, ...], before: Sweep | None, after: Sweep,
           window: float | None) -> FleetRow:
    router = after.router
    figures, source = _fleet_audio(before, after)

    def routed(count: int) -> int | None:  # the router's own figures, none when it is down
        return count if router.ok else None

    return FleetRow(
        replicas=len(rows),
        routable=routed(sum(1 for row in rows if row.routable)),
        in_flight=routed(sum(row.in_flight or 0 for row in rows)),
        requests=routed(sum(row.requests or 0 for row in rows)),
        requests_per_s=_fleet_rate(rows, before, after, window), **asdict(figures),
        restarts=sum(row.restarts for row in rows), audio_source=source,
        router_error=router.error)
