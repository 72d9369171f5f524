"""`omni-dp top` without a launch: its figures from exposition text the real metric classes
(ReplicaMetrics, RouterMetrics) write after known observations, exact; its command on bad
input; its view of a run whose router and replicas do not answer (--once --json, and the live
view under a pseudo-terminal, left with Ctrl-C). The live check against a launched run is in
tests/test_voice_run.py, on that module's launch."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
from dataclasses import replace

import pytest
from prometheus_client import generate_latest

from omni_dp.audio_slo_metrics import MeteredAnswer
from omni_dp.contract import Priority
from omni_dp.engine.metrics import ReplicaMetrics
from omni_dp.launcher.views.exposition import Histogram, Scrape, parse, unreadable
from omni_dp.launcher.views.top import Sweep, frame, health
from omni_dp.router.metrics import RouterMetrics
from omni_dp.router.replicas import Backends, Health, Replica
from omni_dp.runfile import ReplicaState, RunRecord

from support.plans import run_record, stored_state

MODEL = "tiny"


def record(restarts: tuple[int, ...] = (0, 0), states: tuple[str, ...] = ("healthy",) * 2
           ) -> RunRecord:
    return RunRecord.from_json(run_record("run-top", [
        {"index": i, "restarts": [1.0] * n, "state": s}
        for i, (n, s) in enumerate(zip(restarts, states, strict=True))]))


class Fleet:
    """A router's and two replicas' metrics, the real classes; `look(at)` scrapes all three
    as top does (the text they expose, parsed), at a given clock."""

    def __init__(self) -> None:
        self.replicas = [Replica("0", "http://127.0.0.1:1", health=Health.HEALTHY),
                         Replica("1", "http://127.0.0.1:2", health=Health.HEALTHY)]
        self.backends = Backends(self.replicas)
        self.router = RouterMetrics(lambda: self.backends)
        self.engines = [ReplicaMetrics(lambda: None, MODEL) for _ in range(2)]

    def look(self, at: float, down: tuple[int, ...] = ()) -> Sweep:
        return Sweep(parse(self.router.exposition().decode(), at),
                     {i: unreadable(at, "connection refused") if i in down else
                      parse(generate_latest(m.registry).decode(), at)
                      for i, m in enumerate(self.engines)})


def speak(metrics: ReplicaMetrics, chunks: list[tuple[float, float]], completed: bool = True,
          fmt: str = "pcm", priority: Priority = Priority.DEFAULT) -> None:
    """One answer arrived at 0 whose chunks of (seconds of audio) were written at (time)."""
    answer = metrics.answer(fmt, priority, 0.0)
    for at, seconds in chunks:
        answer.add(at, seconds, MODEL)
    answer.finish(completed, MODEL)


def without_router_audio(scrape: Scrape) -> Scrape:
    """The router's scrape as a router without the audio series (older) answers it."""
    return replace(scrape, samples={k: v for k, v in scrape.samples.items()
                                    if not k.startswith("omni_dp_router_audio_")},
                   families=frozenset(f for f in scrape.families
                                      if not f.startswith("omni_dp_router_audio_")))


# --- the pure parts ----------------------------------------------------------------------------


def test_requests_per_second_are_the_routers_counter_deltas_over_the_window():
    fleet = Fleet()
    for _ in range(3):
        fleet.router.count_request("0", 200)
    before = fleet.look(10.0)
    for _ in range(6):
        fleet.router.count_request("0", 200)
    fleet.router.count_request("0", 503)  # every status counts: it was answered
    fleet.router.count_request("1", 200)
    fleet.replicas[0].in_flight = 2
    shown = frame(record(), before, fleet.look(12.5))
    assert shown.window_s == 2.5
    rows = {row.index: row for row in shown.rows}
    assert (rows[0].requests, rows[0].requests_per_s, rows[0].in_flight) == (10, 7 / 2.5, 2)
    assert (rows[1].requests, rows[1].requests_per_s, rows[1].in_flight) == (1, 1 / 2.5, 0)
    assert (shown.fleet.requests, shown.fleet.requests_per_s, shown.fleet.in_flight) == (
        11, 8 / 2.5, 2)


def test_ttfa_percentiles_are_from_the_bucket_deltas_of_the_window_only():
    """10 answers before the window at 20 ms; in it 40 at 40 ms and 60 at 300 ms. Over the
    window: p50 = rank 50 of 100, the 10th of the 60 in (0.25, 0.5] -> 0.25 + 0.25 * 10/60;
    p99 the 59th of them. The first frame (since the start) counts the 10 as well."""
    fleet = Fleet()
    for _ in range(10):
        speak(fleet.engines[0], [(0.02, 0.5)])
    before = fleet.look(0.0)
    for value, times in ((0.04, 40), (0.3, 60)):
        for _ in range(times):
            speak(fleet.engines[0], [(value, 0.5)])
    after = fleet.look(2.0)
    row = frame(record(), before, after).rows[0]
    assert row.ttfa_p50_s == pytest.approx(0.25 + 0.25 * 10 / 60, rel=1e-12)
    assert row.ttfa_p99_s == pytest.approx(0.25 + 0.25 * 59 / 60, rel=1e-12)
    first = frame(record(), None, after)
    assert first.window_s is None and first.to_json()["basis"] == "cumulative"
    # 110 in all: rank 55 is the 5th of the 60 in (0.25, 0.5], 50 being below it
    assert first.rows[0].ttfa_p50_s == pytest.approx(0.25 + 0.25 * 5 / 60, rel=1e-12)
    assert first.rows[0].requests_per_s is None
    assert frame(record(), after, fleet.look(4.0)).rows[0].ttfa_p50_s is None  # none in it


def test_rtf_and_underruns_are_the_replicas_audio_series_over_the_window():
    """In the window, replica 0 completes a 2 s answer in 1 s (RTF 0.5, no stall) and a 1 s
    one in 1 s whose player ran dry for 300 ms (RTF 1.0, an underrun over 100 ms), in two
    formats and classes (summed); one answer is cut (not completed: not counted). The answer
    before the window, a 2 s stall, is not in it."""
    fleet = Fleet()
    engine = fleet.engines[0]
    speak(engine, [(0.1, 0.5), (2.6, 0.5)])  # before: stalled 2 s
    before = fleet.look(0.0)
    speak(engine, [(0.5, 1.0), (1.0, 1.0)])
    speak(engine, [(0.2, 0.5), (1.0, 0.5)], fmt="wav", priority=Priority.INTERACTIVE)
    speak(engine, [(0.3, 0.5)], completed=False)
    after = fleet.look(1.0)
    shown = frame(record(), before, after)
    row = shown.rows[0]
    assert (row.completed, row.underruns) == (2, 1)
    assert row.rtf == pytest.approx(0.75, rel=1e-12)
    # TTFA: 0.5, 0.2 and the cut answer's 0.3 -> (0.1, 0.25]: 1, (0.25, 0.5]: 2
    assert row.ttfa_p50_s == pytest.approx(0.25 + 0.25 * 0.5 / 2, rel=1e-12)
    since_start = frame(record(), None, after).rows[0]
    assert (since_start.completed, since_start.underruns) == (3, 2)
    assert (shown.rows[1].completed, shown.rows[1].underruns, shown.rows[1].rtf) == (
        None, None, None)  # no answer yet: no series of it


def test_the_fleets_audio_is_what_the_router_wrote_to_clients_a_resumed_gap_included():
    """Each replica wrote its answer without a stall; the router's client heard one answer
    stall 400 ms (resumed on replica 1 after replica 0 failed): the fleet's underrun, not a
    replica's."""
    fleet = Fleet()
    speak(fleet.engines[0], [(0.1, 1.0), (0.6, 1.0)])
    speak(fleet.engines[1], [(0.1, 1.0)])
    before = fleet.look(0.0)
    speak(fleet.engines[1], [(0.2, 1.0)])
    relayed = MeteredAnswer(fleet.router.audio, "pcm", Priority.DEFAULT.label, 0.0)
    relayed.add(0.2, 1.0, "0")
    relayed.add(1.6, 1.0, "1")  # the player ran dry at 1.2: a 400 ms gap
    relayed.finish(True, "0")
    shown = frame(record(), before, fleet.look(1.0))
    assert shown.fleet.audio_source == "router"
    assert (shown.fleet.completed, shown.fleet.underruns) == (1, 1)
    assert shown.fleet.rtf == pytest.approx(1.6 / 2.0, rel=1e-12)
    assert shown.fleet.ttfa_p50_s == pytest.approx(0.1 + 0.15 * 0.5, rel=1e-12)
    assert [(r.completed, r.underruns) for r in shown.rows] == [(0, 0), (1, 0)]


def test_the_fleets_audio_is_the_replicas_summed_where_the_router_exports_none():
    fleet = Fleet()
    speak(fleet.engines[0], [(0.5, 1.0), (1.0, 1.0)])  # RTF 0.5
    speak(fleet.engines[1], [(0.2, 0.5), (1.0, 0.5)])  # RTF 1.0, an underrun
    before, after = fleet.look(0.0), fleet.look(1.0)
    old = [replace(s, router=without_router_audio(s.router)) for s in (before, after)]
    shown = frame(record(), None, old[1])
    assert shown.fleet.audio_source == "replicas"
    assert (shown.fleet.completed, shown.fleet.underruns) == (2, 1)
    assert shown.fleet.rtf == pytest.approx(0.75, rel=1e-12)
    assert frame(record(), *old).fleet.completed == 0  # nothing in the window


def test_a_restarted_replica_counts_from_zero_again_and_its_window_is_all_new():
    fleet = Fleet()
    for _ in range(100):
        speak(fleet.engines[1], [(0.3, 0.5)])
    before = fleet.look(0.0)
    fleet.engines[1] = ReplicaMetrics(lambda: None, MODEL)  # the new process
    for _ in range(4):
        speak(fleet.engines[1], [(0.007, 0.5)])
    row = frame(record(restarts=(0, 1)), before, fleet.look(1.0)).rows[1]
    assert row.ttfa_p50_s == pytest.approx(0.01 * 0.5, rel=1e-12)  # (0, 0.01]: 2 of 4
    assert (row.completed, row.restarts) == (4, 1)


def test_a_replica_without_the_audio_slo_series_has_its_ttfa_from_the_older_one():
    """A replica of before the audio SLOs observes omni_dp_time_to_first_audio_seconds only."""
    fleet = Fleet()
    for value in (0.02, 0.2, 0.2, 0.2):
        fleet.engines[0].first_audio.observe(value)
    row = frame(record(), None, fleet.look(0.0)).rows[0]
    assert row.ttfa_p50_s == pytest.approx(0.1 + 0.15 * 1 / 3, rel=1e-12)  # rank 2 of 4
    assert (row.rtf, row.completed, row.underruns) == (None, None, None)


def test_histogram_quantile_follows_prometheus_in_the_inf_bucket_and_without_observations():
    h = Histogram((0.1, 1.0, float("inf")), (1.0, 1.0, 3.0), 12.0)
    assert h.quantile(0.99) == 1.0  # in +Inf: the highest finite bound, as histogram_quantile
    assert h.quantile(0.2) == pytest.approx(0.1 * 0.6)
    assert h.mean() == 4.0
    assert Histogram((0.1, float("inf")), (0.0, 0.0)).quantile(0.5) is None
    assert h.since(h).count == 0
    assert h.plus(Histogram((0.5, float("inf")), (1.0, 1.0))) is None  # other buckets


def test_health_is_the_routers_view_unless_the_record_says_it_is_not_serving():
    fleet = Fleet()
    fleet.replicas[1].disabled = True  # drained for a restart: healthy, not routed to
    rows = frame(record(), None, fleet.look(0.0)).rows
    assert [(r.health, r.healthy, r.routable) for r in rows] == [
        ("healthy", True, True), ("held out", True, False)]
    fleet.replicas[0].health = Health.UNHEALTHY
    rows = frame(record(states=("healthy", "restarting")), None, fleet.look(1.0)).rows
    assert [r.health for r in rows] == ["not routed", "restarting"]
    assert frame(record(), None, fleet.look(2.0)).fleet.routable == 0
    assert health(ReplicaState.HEALTHY, None, None) == "healthy (as recorded)"


def test_an_unreadable_replica_or_router_is_shown_as_such_with_its_reason():
    fleet = Fleet()
    speak(fleet.engines[0], [(0.2, 0.5)])
    sweep = fleet.look(0.0, down=(1,))
    rows = frame(record(), None, sweep).rows
    assert rows[0].metrics_error is None and rows[0].ttfa_p50_s is not None
    assert rows[1].metrics_error == "connection refused"
    assert (rows[1].ttfa_p50_s, rows[1].completed, rows[1].health) == (None, None, "healthy")
    gone = replace(sweep, router=unreadable(0.0, "timed out"))
    shown = frame(record(), sweep, replace(gone, router=unreadable(1.0, "timed out")))
    assert shown.fleet.router_error == "timed out"
    assert (shown.fleet.in_flight, shown.fleet.requests, shown.fleet.requests_per_s) == (
        None, None, None)
    assert shown.rows[0].health == "healthy (as recorded)"


def test_the_json_frame_has_the_documented_fields():
    fleet = Fleet()
    shown = frame(record(), fleet.look(0.0), fleet.look(1.0)).to_json()
    assert set(shown) == {"run_id", "router_url", "window_s", "basis",
                          "underrun_threshold_ms", "replicas", "fleet"}
    assert set(shown["replicas"][0]) == {
        "index", "url", "state", "health", "healthy", "routable", "in_flight", "requests",
        "requests_per_s", "ttfa_p50_s", "ttfa_p99_s", "rtf", "completed", "underruns",
        "restarts", "metrics_error"}
    assert set(shown["fleet"]) == {
        "replicas", "routable", "in_flight", "requests", "requests_per_s", "ttfa_p50_s",
        "ttfa_p99_s", "rtf", "completed", "underruns", "restarts", "audio_source",
        "router_error"}
    json.dumps(shown)  # one object a script reads


# --- the command -------------------------------------------------------------------------------


def omni_dp(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "omni_dp", *args], capture_output=True,
                          text=True, timeout=60, env=env, stdin=subprocess.DEVNULL)


@pytest.fixture
def silent_run(tmp_path):
    """A stored run whose router and replicas are recorded on ports nothing listens on."""
    stored_state(tmp_path / "runs" / "run-top",
                 run_record("run-top", [{"index": 0}, {"index": 1, "restarts": [1.0, 2.0]}]))
    return {**os.environ, "OMNI_DP_STATE_DIR": str(tmp_path)}


@pytest.mark.parametrize(("args", "code", "said"), [
    (["--interval", "0"], 2, "Invalid value for '--interval'"),
    (["--interval", "nan"], 2, "--interval"),
    (["--interval", "soon"], 2, "Invalid value for '--interval'"),
    (["--json"], 2, "--json needs --once"),
    (["no-such-run", "--once"], 1, "no run 'no-such-run'"),  # nothing there: 1, as status
    (["../etc", "--once"], 2, "is not a run id"),
])
def test_bad_input_is_named_and_exits_as_the_other_commands_do(silent_run, args, code, said):
    result = omni_dp("top", *args, env=silent_run)
    assert result.returncode == code, result.stderr
    assert said in result.stderr and "Traceback" not in result.stderr


def test_once_json_of_a_run_that_does_not_answer_names_why_and_keeps_the_record(silent_run):
    result = omni_dp("top", "--once", "--json", "--interval", "0.2", env=silent_run)
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert shown["run_id"] == "run-top" and shown["basis"] == "window"
    assert [(r["index"], r["metrics_error"], r["restarts"]) for r in shown["replicas"]] == [
        (0, "connection refused", 0), (1, "connection refused", 2)]
    assert shown["fleet"]["router_error"] == "connection refused"
    assert shown["fleet"]["restarts"] == 2


def test_the_live_view_redraws_on_a_terminal_and_ctrl_c_leaves_it_cleanly(silent_run):
    """Under a pseudo-terminal: frames drawn, then ^C (the terminal's interrupt) exits 0 with
    no traceback."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: the command on the terminal
        os.execve(sys.executable, [sys.executable, "-m", "omni_dp", "top", "--interval",
                                   "0.3"], {**silent_run, "COLUMNS": "160", "LINES": "40"})
    seen, deadline, interrupted = b"", time.monotonic() + 60, False
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.5)
            if ready:
                try:
                    seen += os.read(fd, 65536)
                except OSError:  # the child is gone
                    break
            if not interrupted and seen.count(b"over the last") >= 2:
                os.write(fd, b"\x03")  # Ctrl-C
                interrupted = True
        _, status = os.waitpid(pid, 0)
    finally:
        if not interrupted:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    text = seen.decode(errors="replace")
    assert interrupted, text[-2000:]
    assert "since each process started" in text  # the first frame, at once
    assert "connection refused" in text
    assert os.waitstatus_to_exitcode(status) == 0, text[-2000:]
    assert "Traceback" not in text
