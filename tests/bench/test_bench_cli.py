"""`omni-dp bench` as a user runs it: bad input refused before anything starts (exit 2, no
traceback); configurations launched, measured and torn down on this CPU with real built-in
replicas — one that cannot launch reported as failed, not dropped; an admission bound of the
real router whose 503s are counted; the JSON and the PNG written."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import matplotlib.image
import pytest

from omni_dp.engine.options import DEFAULT_MODEL_ENV

from support.http_client import get
from support.ports import LOOPBACK, free_port
from support.replica import Replica

TINY = ("--max-total-tokens", "1024", "--", "--model", "tiny")
# 3 s a trial: a tiny request on a core another test's replicas share takes more than a second
SHORT = ("--trials", "2", "--duration", "3", "--warmup", "0.5")


def bench(*args: str, state: Path | None = None, timeout: float = 240
          ) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("OMNI_DP_") or k == DEFAULT_MODEL_ENV}  # the seeded default
    if state is not None:
        env["OMNI_DP_STATE_DIR"] = str(state)
    return subprocess.run([sys.executable, "-m", "omni_dp", "bench", *args], env=env,
                          capture_output=True, text=True, timeout=timeout, check=False,
                          stdin=subprocess.DEVNULL)


@pytest.mark.parametrize(("args", "words"), [
    ((), "give the endpoint to measure"),
    (("http://127.0.0.1:1", "--configs", "1"), "not both"),
    (("--configs", "2x"), "2x"),
    (("--configs", "1", "--", "--replicas", "3"), "--replicas"),
    (("--concurrency", "4,2", "http://127.0.0.1:1"), "rising"),
    (("--trials", "0", "http://127.0.0.1:1"), "--trials"),
    (("--texts", "/nonexistent/prompts.txt", "http://127.0.0.1:1"), "/nonexistent/prompts.txt"),
    (("--out", "/proc/omni-dp-bench", "http://127.0.0.1:1"), "--out /proc/omni-dp-bench"),
])
def test_bad_input_exits_2_naming_it_before_anything_starts(tmp_path, args, words):
    done = bench(*args, state=tmp_path / "state", timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert words in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "state").exists()


@pytest.mark.slow
def test_configurations_are_measured_torn_down_and_a_failed_one_is_kept(tmp_path):
    state, out = tmp_path / "state", tmp_path / "out"
    # 3 replicas need 3 physical cores for their CPU blocks: on this 2-core machine that
    # configuration's launch is refused (exit 2), and the report must say so
    done = bench("--configs", "1,2,3", *SHORT, "--concurrency", "1,2", "--out", str(out),
                 "--json", "--", *TINY, state=state)
    assert done.returncode == 1, done.stderr[-3000:]  # one configuration failed
    data = json.loads(done.stdout)
    by_name = {c["name"]: c for c in data["configs"]}
    assert [by_name[n]["status"] for n in ("1", "2")] == ["ok", "ok"], done.stderr[-3000:]
    assert by_name["3"]["status"] == "failed"
    assert "launch exited 2" in by_name["3"]["reason"]
    assert "3" in done.stderr and "FAILED" in done.stderr  # the table (on stderr with --json)
    for name in ("1", "2"):
        levels = by_name[name]["levels"]
        assert [lv["concurrency"] for lv in levels] == [1, 2], by_name[name]
        for level in levels:
            assert level["trials"] == 2 and level["requests"] > 0
            rps = level["requests_per_s"]
            assert rps["low"] <= rps["median"] <= rps["high"] and rps["median"] > 0
    assert set(by_name["2"]["balance"]) == {"0", "1"}, by_name["2"]  # both replicas served
    assert "2" in data["scaling"] and data["scaling"]["2"] > 0
    assert "each configuration at its own saturating concurrency" in data["premise"]
    assert json.loads((out / "bench.json").read_text()) == data
    image = matplotlib.image.imread(out / "bench.png")
    assert image.shape[0] > 200 and image.shape[1] > 400 and image.std() > 0
    runs = state / "runs"
    assert not runs.exists() or list(runs.iterdir()) == []  # every configuration downed


@pytest.mark.slow
def test_an_admission_bound_that_503s_is_counted_and_the_config_is_degraded(tmp_path):
    replica = Replica(tmp_path / "replica.log", "--model", "tiny").wait_ready()
    port = free_port()
    router = subprocess.Popen(
        [sys.executable, "-m", "omni_dp", "router", "--port", str(port), "--max-inflight", "1",
         "--replica", f"0={replica.url}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        url = f"http://{LOOPBACK}:{port}"
        deadline = time.monotonic() + 30
        while get(url + "/ready")[0] != 200:
            assert time.monotonic() < deadline and router.poll() is None, "router not ready"
            time.sleep(0.1)
        done = bench(url, "--trials", "1", "--duration", "5", "--warmup", "0.5",
                     "--concurrency", "4", "--json")
        assert done.returncode == 1, done.stderr[-3000:]
        [config] = json.loads(done.stdout)["configs"]
        assert config["status"] == "degraded"
        [level] = config["levels"]
        assert level["failures"].get("http 503", 0) > 0
        assert "http 503" in config["reason"]
        assert level["requests_per_s"]["median"] > 0  # the admitted ones were served
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(router.pid, signal.SIGTERM)
        router.wait(30)
        replica.stop()


def test_bench_json_holds_each_configuration_as_it_ends(tmp_path, monkeypatch):
    """A sweep killed during its third configuration (the device call's timeout) must still
    have the first two in bench.json: it is rewritten as each configuration ends."""
    from click.testing import CliRunner

    from omni_dp.bench.results import ConfigResult
    from omni_dp.bench.runner import BenchRunner
    from omni_dp.cli import cli

    out = tmp_path / "out"
    seen: list[dict] = []

    def measured(self, spec, replicas, mps, launch_args, state_dir):
        if (out / "bench.json").exists():
            seen.append(json.loads((out / "bench.json").read_text()))
        return ConfigResult(spec, replicas, mps, "failed", f"{spec}: not launched here")

    monkeypatch.setattr(BenchRunner, "_run_config", measured)
    done = CliRunner().invoke(cli, ["bench", "--configs", "1,2,3mps", "--out", str(out),
                                    "--", *TINY])
    assert done.exit_code == 1, done.output
    assert [[c["name"] for c in data["configs"]] for data in seen] == [["1"], ["1", "2"]]
    assert all(data["complete"] is False for data in seen)
    final = json.loads((out / "bench.json").read_text())
    assert [c["name"] for c in final["configs"]] == ["1", "2", "3mps"]
    assert final["complete"] is True
