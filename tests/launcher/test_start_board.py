"""The start board: a wait over ~2 s is never silent, and says what the replica's log says."""

from __future__ import annotations

import threading
import time

from omni_dp.launcher.engines.readback import start_banner
from omni_dp.launcher.views.progress import StartBoard, last_line


def test_plain_lines_come_after_the_quiet_time_then_every_interval(tmp_path):
    log = tmp_path / "replica_0.log"
    log.write_text(start_banner(0, "text") + "\nINFO loading weights from /models/x\n")
    board = StartBoard(lambda line: None, live=False, quiet_s=2.0, every_s=10.0)
    board.begin(0, log, "starting, waiting for /health")
    since = board.waiting[0].since
    assert board.due(since + 1.0) == []
    assert board.due(since + 2.5) == [
        "replica 0: starting, waiting for /health (2 s); its log: INFO loading weights from "
        "/models/x"]
    assert board.due(since + 5.0) == []  # not again before every_s
    board.phase(0, "healthy, waiting for the KV read-back")
    assert board.due(since + 13.0) == [
        "replica 0: healthy, waiting for the KV read-back (13 s); its log: INFO loading weights "
        "from /models/x"]
    board.end(0)
    assert board.due(since + 60.0) == []


def test_the_launchers_own_banner_is_not_news(tmp_path):
    log = tmp_path / "replica_1.log"
    log.write_text(start_banner(1, "json") + "\n")
    assert last_line(log) == ""
    assert last_line(tmp_path / "absent.log") == ""
    log.write_text("x" * 500 + "\n")
    assert len(last_line(log)) == 100 and last_line(log).endswith("…")
    board = StartBoard(lambda line: None, live=False, quiet_s=0.0)
    board.begin(1, log.with_name("none.log"), "starting")
    assert board.due(time.monotonic()) == ["replica 1: starting (0 s); nothing in its log yet"]
    assert board.lines()[0].startswith("replica 1    0 s  starting  (nothing in its log yet)")


def test_the_ticker_says_lines_by_itself_and_stops(tmp_path):
    said: list[str] = []
    seen = threading.Event()

    def say(line: str) -> None:
        said.append(line)
        seen.set()

    board = StartBoard(say, live=False, quiet_s=0.0, every_s=60.0)
    board.begin(0, tmp_path / "replica_0.log", "starting")
    with board:
        assert seen.wait(5.0)
    assert board.thread is not None and not board.thread.is_alive()
    assert len(said) == 1 and said[0].startswith("replica 0: starting ("), said
    assert said[0].endswith(" s); nothing in its log yet"), said


def test_the_ready_line_counts_only_the_replicas_its_probe_found_healthy():
    """`verified` is said of what the summary's own health probe found: a replica that went
    down between the gates and the summary is not counted."""
    from omni_dp.launcher.views.summary import RunSummary

    def ready(*health: str) -> str:
        return RunSummary(run_id="r", endpoint="http://127.0.0.1:1",
                          replicas=[{"health": h} for h in health], checks=("health",),
                          try_command="", status_command="",
                          teardown_command="").ready_line

    assert ready("healthy", "healthy").startswith("ready: 2 replicas verified behind ")
    assert ready("healthy", "unhealthy (503)").startswith("ready: 1 of 2 replicas verified ")
