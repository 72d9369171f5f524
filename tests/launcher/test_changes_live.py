"""Day-two changes on a live run under load, one launch for all of them: a rolling restart, a
model update, a scale 2 → 3 → 1, a second change refused while one runs, bad input refused with
nothing changed — and not one request failed through the router meanwhile.

The figures (time per replica, failed requests per 1,000 under heavier load) are
bench/day_two.py's; here the behaviour is asserted."""

from __future__ import annotations

import http.client
import json
import subprocess
import threading
import time
import urllib.request

import pytest

from support.launcher import OMNI_DP, Run, describe
from support.wait import wait_for

TEXTS = ("Rolling restarts keep the run up.", "Scaling adds a replica.", "Nothing is lost.")


class Load:
    """Clients sending speech requests through the router until stopped (loopback, bounded by
    the test's own duration); every answer that is not a whole 200 is a failure (a cut
    stream raises; the untrained tiny model answers some seeds with no audio at all: ok)."""

    def __init__(self, url: str, clients: int = 2) -> None:
        self.url = url
        self.sent = 0
        self.failures: list[str] = []
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True)
                        for i in range(clients)]

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(60)

    def _client(self, i: int) -> None:
        n = 0
        while not self.stopping.is_set():
            body = {"input": TEXTS[(i + n) % len(TEXTS)], "response_format": "pcm",
                    "stream": n % 2 == 0, "seed": n}
            request = urllib.request.Request(self.url + "/v1/audio/speech",
                                             json.dumps(body).encode(),
                                             {"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=60) as answer:
                    answer.read()
                    if answer.status != 200:
                        self.failures.append(f"status {answer.status}")
            except (OSError, http.client.HTTPException) as exc:  # refused, reset, cut
                self.failures.append(repr(exc))
            self.sent += 1
            n += 1


def change(run: Run, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return run.cli(*args, timeout=timeout)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_restart_update_and_scale_under_load_lose_no_request(tmp_path):
    run = Run(tmp_path, replicas=3)  # three ports kept free: the scale adds one
    run.replicas = 2
    with run:
        run.launch("--cpu-blocks", "none", "--check-interval", "0.5", "--drain-timeout", "10",
                   "--", "--model", "tiny")
        with Load(run.router_url) as load:
            wait_for("traffic", lambda: load.sent >= 4, timeout=60)

            restarted = change(run, "restart", run.run_id, "--json")
            assert restarted.returncode == 0, describe(restarted)
            outcome = json.loads(restarted.stdout)
            assert outcome["ok"] and [s["replica"] for s in outcome["steps"]] == [0, 1]
            assert "replica 0: out of the router" in restarted.stderr
            pids = [r["pid"] for r in run.run_json()["replicas"]]

            updated = change(run, "restart", run.run_id, "--", "--model", "tiny",
                             "--max-running-requests", "16")
            assert updated.returncode == 0, describe(updated)
            record = run.run_json()
            assert record["plan"]["engine_args"] == ["--model", "tiny",
                                                     "--max-running-requests", "16"]
            assert all(r["argv"][-2:] == ["--max-running-requests", "16"]
                       for r in record["replicas"])
            assert not {r["pid"] for r in record["replicas"]} & set(pids)

            # a scale to 3, and while it runs a second change is refused
            scaling = subprocess.Popen([*OMNI_DP, "scale", run.run_id, "--replicas", "3"],
                                       env=run.env, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True)
            wait_for("the scale to run", lambda: _running(run), timeout=60)
            second = change(run, "restart", run.run_id)
            assert second.returncode == 2 and "is still running" in second.stderr, \
                describe(second)
            _, err = scaling.communicate(timeout=240)
            assert scaling.returncode == 0, err
            status = run.status()
            assert [r["index"] for r in status["replicas"]] == [0, 1, 2]
            assert all(r["health"] == "healthy" for r in status["replicas"]), status
            targets = run.cli("status", run.run_id, "--prometheus-sd", "-")
            assert f"127.0.0.1:{run.base_port + 2}" in targets.stdout  # discovery follows

            down_to_one = change(run, "scale", run.run_id, "-n", "1")
            assert down_to_one.returncode == 0, describe(down_to_one)
            assert [r["index"] for r in run.run_json()["replicas"]] == [0]
            workers = json.loads(urllib.request.urlopen(run.router_url + "/workers",
                                                        timeout=10).read())["workers"]
            assert [w["id"] for w in workers] == ["0"]
            time.sleep(1)  # a little traffic on the one left
        assert load.sent >= 20 and load.failures == [], load.failures

        # refused with nothing changed: exit 2 and run.json as it was
        before = (run.run_dir / "run.json").read_text()
        for args, words in ((("restart", run.run_id), "only replica"),
                            (("scale", run.run_id, "-n", "0"), "at least 1"),
                            (("restart", run.run_id, "--replica", "4"), "--replica 4"),
                            (("restart", run.run_id, "--", "--model", "nope"), "nope")):
            refused = change(run, *args)
            assert refused.returncode == 2 and words in refused.stderr, describe(refused)
            assert "Traceback" not in refused.stderr
        assert (run.run_dir / "run.json").read_text() == before
        assert run.down().returncode == 0


def _running(run: Run) -> bool:
    try:
        return json.loads((run.run_dir / "change.json").read_text())["state"] == "running"
    except (OSError, ValueError, KeyError):
        return False
