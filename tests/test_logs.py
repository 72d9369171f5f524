"""Logs: `--log-format json` for serve, router and launch (one JSON object per line), text
unchanged, and `omni-dp logs` (`-n`, `-f` printing whole lines only)."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from omni_dp.launcher.planning.facts import LaunchFacts
from omni_dp.launcher.planning.options import load_config_file, merge_options
from omni_dp.logs import FIELDS, Follower, JsonLines, formatter, setup_logging

from support.http_client import get, request, speech
from support.launcher import Run, describe, environ
from support.plans import healthy_facts, opts, plan, problems_of, run_record
from support.ports import free_port, free_ports
from support.wait import wait_for

CORE_KEYS = ("time", "level", "logger", "message")


def json_lines(text: str, what: str) -> list[dict]:
    """Every line of text parsed as one JSON object carrying the core keys."""
    assert text.strip(), f"{what} is empty"
    parsed = []
    for number, line in enumerate(text.splitlines(), 1):
        try:
            record = json.loads(line)
        except ValueError:
            raise AssertionError(f"{what} line {number} is not JSON: {line!r}\n{text}") from None
        assert isinstance(record, dict), f"{what} line {number}: {line!r}"
        for key in CORE_KEYS:
            assert key in record, f"{what} line {number} has no {key!r}: {line!r}"
        parsed.append(record)
    return parsed


def record(name: str, message: str, *args, **extra) -> logging.LogRecord:
    made = logging.LogRecord(name, logging.INFO, __file__, 1, message, args, None)
    made.__dict__.update(extra)
    return made


# --- the formats ------------------------------------------------------------------------------


def test_text_format_is_the_one_the_commands_always_had():
    line = formatter("text").format(record("omni_dp.serve", "listening on %s", "x"))
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO omni_dp\.serve: "
                        r"listening on x", line), line
    worker = formatter("text", worker=1).format(record("omni_dp.router", "up"))
    assert worker.endswith(" INFO omni_dp.router[1]: up"), worker


def test_json_format_is_one_object_per_record_with_fields_as_keys():
    fmt = formatter("json", worker=3)
    route = {"event": "route", "status": 200, "path": "/v1/audio/speech",
             "level": "spoofed", "message": "spoofed"}
    line = fmt.format(record("omni_dp.router.access", "%s", json.dumps(route),
                             **{FIELDS: route}))
    data = json.loads(line)
    assert data["logger"] == "omni_dp.router.access" and data["level"] == "INFO"
    assert data["message"] == "route" and data["status"] == 200 and data["worker"] == 3
    assert data["path"] == "/v1/audio/speech"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00", data["time"])
    try:
        raise ValueError("bad\nthing")
    except ValueError:
        failed = record("omni_dp.serve", "failed: %s", "x\ny", exc_info=sys.exc_info())
    line = formatter("json").format(failed)
    assert "\n" not in line
    data = json.loads(line)
    assert data["message"] == "failed: x\ny" and "ValueError: bad" in data["exc_info"]
    assert "worker" not in data


def test_json_setup_logs_uncaught_exceptions_and_warnings_as_json():
    code = ("import warnings\nfrom omni_dp.logs import setup_logging\n"
            "setup_logging('info', 'json')\nwarnings.warn('careful')\n"
            "raise RuntimeError('uncaught')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1
    records = json_lines(done.stderr, "stderr")
    assert [r["level"] for r in records] == ["WARNING", "CRITICAL"], records
    assert "careful" in records[0]["message"]
    assert "RuntimeError: uncaught" in records[1]["exc_info"]


def test_setup_logging_replaces_an_earlier_setup():
    """basicConfig alone does nothing once a handler exists: a second set-up must win."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        setup_logging("info", "json")
        assert sys.excepthook is not sys.__excepthook__
        setup_logging("debug", "text")  # also puts the default hooks back
        assert len(root.handlers) == 1 and root.level == logging.DEBUG
        assert not isinstance(root.handlers[0].formatter, JsonLines)
        assert sys.excepthook is sys.__excepthook__
        assert threading.excepthook is threading.__excepthook__
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])


# --- real processes ---------------------------------------------------------------------------


@pytest.fixture
def start_router():
    """Start `omni-dp router` processes (JSON logs by OMNI_DP_LOG_FORMAT: the router reads it
    from there too); any still running at teardown is stopped, then killed, by its pid."""
    started: list[subprocess.Popen] = []

    def start(log_path: Path, port: int, replica_url: str) -> subprocess.Popen:
        env = {**os.environ, "OMNI_DP_LOG_FORMAT": "json"}
        with open(log_path, "w") as log:
            started.append(subprocess.Popen(
                [sys.executable, "-m", "omni_dp", "router", "--port", str(port), "--workers",
                 "2", "--replica", f"r0={replica_url}", "--health-interval", "0.2"],
                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        return started[-1]

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


@pytest.mark.slow
def test_serve_and_a_two_worker_router_write_only_json_lines(tmp_path, start_replica,
                                                               start_router):
    replica = start_replica("--log-format", "json")
    port = free_port()
    router_log = tmp_path / "router.log"
    router = start_router(router_log, port, replica.url)
    url = f"http://127.0.0.1:{port}"
    wait_for("both router workers to listen",
             lambda: router_log.read_text().count("router listening on") == 2, 60)
    wait_for("the router to be ready", lambda: get(url + "/ready")[0] == 200, 60)
    status, _, body = speech(url, "Logged as JSON.")
    assert status == 200, body[:200]
    status, _, _ = request("POST", url + "/v1/audio/speech", {"input": "x", "voice": "nope"})
    assert status == 400
    router.send_signal(signal.SIGTERM)
    assert router.wait(60) == 0
    assert replica.stop() == 0

    served = json_lines(replica.log_text(), "serve's output")
    messages = [r["message"] for r in served]
    assert any(m.startswith("listening on http://") for m in messages), messages
    assert any("draining" in m for m in messages), messages
    assert all(r["logger"].startswith("omni_dp") for r in served), served

    routed = json_lines(router_log.read_text(), "the router's output")
    routes = [r for r in routed if r.get("event") == "route"]
    assert sorted(r["status"] for r in routes) == [200, 400], routes
    assert all(r["message"] == "route" and r["worker"] in (0, 1) for r in routes), routes
    assert {r["worker"] for r in routed if "listening" in r["message"]} == {0, 1}, routed


@pytest.mark.slow
def test_launch_json_reaches_launcher_supervisor_replicas_and_router(tmp_path):
    with Run(tmp_path, replicas=1) as run:
        config = tmp_path / "launch.yaml"
        config.write_text("log-format: json\n")  # from the YAML file, like every launch option
        launched = run.launch("--config", str(config), "--check-interval", "0.5")
        launch_records = json_lines(launched.stdout, "launch's stdout")
        preflight = json_lines(launched.stderr, "launch's stderr")  # where text mode has it too
        assert [r["message"] for r in preflight] == [
            "preflight (CPU topology, GPU, ports, engine dry run)…"], preflight
        assert any(r["message"].startswith("detached: supervisor pid")
                   for r in launch_records), launch_records
        # The summary and the ready line as fields a collector reads, not text with newlines
        assert not [r for r in launch_records if "\n" in r["message"]], launch_records
        assert any("replica 0" in line for line in launch_records[0]["lines"])  # the plan
        summary = next(r for r in launch_records if r["message"] == "run_summary")
        assert summary["endpoint"] == run.router_url and summary["run_id"] == run.run_id
        assert [r["health"] for r in summary["replicas"]] == ["healthy"]
        ready = launch_records[-1]
        assert (ready["message"], ready["replicas"], ready["endpoint"]) == (
            "ready", 1, run.router_url), launch_records
        data = run.run_json()
        assert data["plan"]["log_format"] == "json"
        argv = data["replicas"][0]["argv"]
        assert argv[argv.index("--log-format") + 1] == "json"
        assert speech(run.router_url)[0] == 200
        # A replica killed: the detached supervisor says so and restarts it (a second banner).
        pid = data["replicas"][0]["pid"]
        assert environ(pid)["OMNI_DP_RUN_TOKEN"] == run.token  # ours, not a recycled pid
        os.kill(pid, signal.SIGKILL)
        logs = run.run_dir / "logs"
        wait_for("the restart", lambda: "restarted" in (logs / "supervisor.log").read_text(),
                 60)
        texts = {name: (logs / name).read_text()
                 for name in ("replica_0.log", "router.log", "supervisor.log")}
        down = run.down()
        assert down.returncode == 0, describe(down)
    replica_records = json_lines(texts["replica_0.log"], "replica_0.log")
    banners = [r for r in replica_records if r["message"] == "starting replica 0"]
    assert len(banners) == 2 and banners[0]["logger"] == "omni_dp.launch", replica_records
    assert any(r.get("event") == "route" for r in json_lines(texts["router.log"], "router.log"))
    said = [r["message"] for r in json_lines(texts["supervisor.log"], "supervisor.log")]
    assert any(m.startswith("replica 0: ") and "restarting" in m for m in said), said


def test_launch_dry_run_json_keeps_stdout_the_plan_and_logs_json_on_stderr(tmp_path):
    base, router = free_ports(2)
    env = {**os.environ, "OMNI_DP_STATE_DIR": str(tmp_path / "state"),
           "OMNI_DP_LOG_FORMAT": "json"}
    done = subprocess.run(
        [sys.executable, "-m", "omni_dp", "launch", "--gpu", "none", "--cpu-blocks", "none",
         "--base-port", str(base), "--router-port", str(router), "--dry-run", "--json"],
        env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    plan_json = json.loads(done.stdout)  # the whole of stdout: one JSON document
    assert plan_json["log_format"] == "json"  # from OMNI_DP_LOG_FORMAT
    assert "--log-format" in plan_json["replica_plans"][0]["argv"]
    json_lines(done.stderr, "stderr")
    assert not (tmp_path / "state").exists()


# --- planning: the format is passed on --------------------------------------------------------


@pytest.fixture
def machine(tmp_path) -> LaunchFacts:
    """The healthy machine of the plan tests: one H200, free ports, no earlier runs."""
    return healthy_facts(tmp_path)


def test_the_plan_passes_the_log_format_to_every_replica_and_the_router(machine):
    for fmt in ("text", "json"):
        p = plan(opts(log_format=fmt), machine)
        for r in p.replicas:
            assert r.argv[r.argv.index("--log-format") + 1] == fmt
        router = list(p.router_argv)
        assert router[router.index("--log-format") + 1] == fmt
        assert p.to_json()["log_format"] == fmt


def test_a_bad_log_format_or_one_among_the_engine_args_is_a_problem(machine, tmp_path):
    config = tmp_path / "launch.yaml"
    config.write_text("log_format: xml\n")
    problems: list[str] = []
    values = load_config_file(str(config), problems)
    assert problems == []
    options = merge_options({}, values, str(config))
    assert any("--log-format must be one of text, json" in p
               for p in problems_of(options, machine))
    clash = problems_of(opts(engine_args=("--log-format", "json")), machine)
    assert any("--log-format is set by the launcher" in p for p in clash), clash


# --- omni-dp logs -----------------------------------------------------------------------------


@pytest.fixture
def fake_run(tmp_path) -> tuple[dict[str, str], Path]:
    """A run directory with a replica log and no process: what `omni-dp logs` reads."""
    root = tmp_path / "state"
    directory = root / "runs" / "r1"
    (directory / "logs").mkdir(parents=True)
    (directory / "run.json").write_text(json.dumps(run_record("r1", [{"index": 0}])))
    (directory / "run_token").write_text("t\n")
    (directory / "logs" / "replica_0.log").write_bytes(b"one\ntwo\nthree\n")
    env = {**os.environ, "OMNI_DP_STATE_DIR": str(root)}
    return env, directory


def logs_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "omni_dp", "logs", "r1", *args], env=env,
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


def test_logs_n_prints_that_many_last_lines_and_0_none(fake_run):
    env, _ = fake_run
    assert logs_cli(env, "--replica", "0", "-n", "2").stdout == "two\nthree\n"
    none = logs_cli(env, "--replica", "0", "-n", "0")
    assert none.returncode == 0 and none.stdout == ""
    assert logs_cli(env, "--replica", "0", "-n", "-1").returncode == 2


def test_logs_of_several_logs_prefix_each_line_and_a_missing_one_exits_2(fake_run):
    env, directory = fake_run
    (directory / "logs" / "router.log").write_bytes(b"up\nready\n")
    every = logs_cli(env, "-n", "1")
    assert every.returncode == 0 and every.stdout == "[replica_0] three\n[router] ready\n"
    assert logs_cli(env, "--router").stdout == "up\nready\n"  # one log: no prefix
    missing = logs_cli(env, "--replica", "7")
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert f"omni-dp logs: no replica_7.log in {directory / 'logs'}" in missing.stderr


def test_logview_selects_and_shows_without_a_command_line(tmp_path):
    from omni_dp.launcher.views.logview import LogError, select_logs, show_logs

    (tmp_path / "replica_0.log").write_bytes(b"a\nb\npartial")
    (tmp_path / "supervisor.log").write_bytes(b"s\n")
    assert select_logs(tmp_path) == [tmp_path / "replica_0.log", tmp_path / "supervisor.log"]
    assert select_logs(tmp_path, supervisor=True) == [tmp_path / "supervisor.log"]
    with pytest.raises(LogError, match=r"no router\.log in"):
        select_logs(tmp_path, router=True)
    written: list[str] = []
    show_logs(select_logs(tmp_path), lines=2, follow=False, write=written.append)
    assert written == ["[replica_0] b", "[replica_0] partial", "[supervisor] s"]
    written.clear()  # following: whole lines only, and stopped once the run is gone
    show_logs([tmp_path / "replica_0.log"], lines=5, follow=True, write=written.append,
              running=lambda: False)
    assert written == ["a", "b"]
    with pytest.raises(LogError, match="cannot read"):
        show_logs([tmp_path / "gone.log"], lines=1, follow=False, write=written.append)


class Followed:
    """`omni-dp logs -f` as a process, its output lines collected by a thread."""

    def __init__(self, env: dict[str, str], *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "omni_dp", "logs", "r1", "-f", *args], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.lines.append(raw.decode().rstrip("\n"))

    def wait_for_line(self, text: str, timeout: float = 30) -> None:
        wait_for(f"{text!r} in the followed output", lambda: text in self.lines, timeout, 0.05)

    def finish(self, directory: Path) -> list[str]:
        """Remove the run directory (as `down` does): the follower stops by itself."""
        for path in sorted(directory.rglob("*"), reverse=True):
            path.rmdir() if path.is_dir() else path.unlink()
        directory.rmdir()
        try:
            assert self.proc.wait(30) == 0
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(10)
        return self.lines


@pytest.fixture
def follow():
    """Start `omni-dp logs -f` processes; every one still running is killed at teardown, so a
    failing test leaves none behind."""
    started: list[Followed] = []

    def start(env: dict[str, str], *args: str) -> Followed:
        started.append(Followed(env, *args))
        return started[-1]

    yield start
    for followed in started:
        if followed.proc.poll() is None:
            followed.proc.kill()
        followed.proc.wait(10)


def append(path: Path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)


def test_logs_follow_prints_a_line_written_in_two_pieces_once_whole(fake_run, follow):
    env, directory = fake_run
    log = directory / "logs" / "replica_0.log"
    followed = follow(env, "--replica", "0", "-n", "1")
    followed.wait_for_line("three")
    append(log, b"half ")
    time.sleep(1.0)  # several polls of the follower see the line without its end
    append(log, b"line\nnext\n")
    followed.wait_for_line("next")
    assert followed.finish(directory) == ["three", "half line", "next"]


def test_logs_follow_holds_back_a_partial_last_line_until_it_is_whole(fake_run, follow):
    env, directory = fake_run
    log = directory / "logs" / "replica_0.log"
    append(log, b"unfinished ")
    followed = follow(env, "--replica", "0", "-n", "2")
    followed.wait_for_line("three")
    time.sleep(0.6)
    append(log, b"now\n")
    followed.wait_for_line("unfinished now")
    assert followed.finish(directory) == ["two", "three", "unfinished now"]


def test_logs_follow_goes_on_in_a_log_replaced_under_it(fake_run, follow):
    env, directory = fake_run
    log = directory / "logs" / "replica_0.log"
    followed = follow(env, "--replica", "0", "-n", "1")
    # Following the old log for sure before it is replaced: with -n 0 and a slow start (a
    # loaded machine) the follower could open the new log first, at its end, and see nothing.
    followed.wait_for_line("three")
    append(log, b"last of the old log\n")
    log.rename(log.with_name("replica_0.log.1700000000"))  # as the supervisor does
    log.write_bytes(b"first of the new log\n")
    followed.wait_for_line("first of the new log")
    assert followed.finish(directory) == ["three", "last of the old log",
                                          "first of the new log"]


def test_follower_reads_a_truncated_log_from_its_start(tmp_path):
    path = tmp_path / "x.log"
    path.write_bytes(b"a\nb\n")
    follower = Follower(path)
    try:
        assert follower.start(5) == [b"a", b"b"]
        path.write_bytes(b"c\n")
        assert follower.poll() == [b"c"]
        assert follower.poll() == []
    finally:
        follower.close()
