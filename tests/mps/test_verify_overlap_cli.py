"""`omni-dp verify-mps --overlap` on hand-built run states: what it refuses and why (exit 2),
and its verdict over stand-in replicas whose GET /gpu_busy answers synthetic intervals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from omni_dp.mps.overlap_run import ON_CPU
from omni_dp.procs import identify

from support.plans import gpu_run_record, gpus_json, run_record
from support.stub_http import StubHttp

STEP_S, STEPS = 0.01, 100  # the stand-ins' synthetic steps: 100 of every 10 ms from `since`


def omni_dp(root: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "omni_dp", "verify-mps", *args],
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
                          env={**os.environ, "OMNI_DP_STATE_DIR": str(root), **(env or {})})


def write_run(root: Path, data: dict) -> None:
    run_dir = root / "runs" / data["run_id"]
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text(json.dumps(data))
    (run_dir / "run_token").write_text("token")


def on_gpu(data: dict, live_pid: int | None = None) -> dict:
    """The record as a run on CUDA without --mps; live while `live_pid` runs."""
    data["device"] = data["plan"]["device"] = "cuda"
    if live_pid is not None:
        identity = identify(live_pid)
        data["launcher"] = {"pid": identity.pid, "create_time": identity.create_time}
    return data


def busy_replica(phase: float | None) -> StubHttp:
    """A replica whose steps are busy [since + k·STEP_S + phase, … + STEP_S/2); None: it does
    not record."""
    def answer(method, path, auth, body):
        if not path.startswith("/gpu_busy"):
            return 404, b"{}"
        since = float(parse_qs(urlsplit(path).query)["since"][0])
        if phase is None:
            return 200, json.dumps({"device": "cuda:0", "recording": False,
                                    "why": "the stand-in does not record",
                                    "intervals": []}).encode()
        intervals = [[since + k * STEP_S + phase, since + k * STEP_S + phase + STEP_S / 2]
                     for k in range(STEPS)]
        return 200, json.dumps({"device": "cuda:0", "recording": True,
                                "intervals": intervals, "truncated": False}).encode()

    return StubHttp(answer)


@pytest.fixture
def stubs():
    made: list[StubHttp] = []

    def make(stub: StubHttp) -> StubHttp:
        made.append(stub)
        return stub

    yield make
    for stub in made:
        stub.close()


@pytest.fixture
def router(stubs) -> StubHttp:
    return stubs(StubHttp(lambda method, path, auth, body: (200, b"\0\0" * 480)))


def gpu_run(root: Path, live_pid: int, router: StubHttp, replicas: list[StubHttp],
            gpus: list[int] | None = None, **plan) -> None:
    rows = [{"index": k, "url": stub.url, "gpu": (gpus or [0] * len(replicas))[k]}
            for k, stub in enumerate(replicas)]
    data = on_gpu(gpu_run_record("run-o", rows, gpus_json(max(gpus or [0]) + 1)), live_pid)
    data["plan"]["router"]["url"] = router.url
    data["plan"].update(plan)
    write_run(root, data)


def test_a_cpu_run_cannot_be_checked_and_says_why(tmp_path):
    write_run(tmp_path, run_record("run-cpu", [{"index": 0}, {"index": 1}]))
    result = omni_dp(tmp_path, "run-cpu", "--overlap")
    assert result.returncode == 2, result.stderr
    assert ON_CPU in result.stderr
    result = omni_dp(tmp_path, "run-cpu", "--overlap", "--json")
    assert result.returncode == 2
    assert json.loads(result.stdout) == {"result": "CANNOT_CHECK", "reason": ON_CPU}


def test_another_engine_cannot_be_checked(tmp_path):
    data = on_gpu(run_record("run-vllm", [{"index": 0}, {"index": 1}]))
    data["plan"]["engine"] = "vllm"
    write_run(tmp_path, data)
    result = omni_dp(tmp_path, "run-vllm", "--overlap")
    assert result.returncode == 2
    assert "runs the vllm engine: only the built-in engine times its GPU steps" in result.stderr


def test_a_run_that_is_not_live_is_not_loaded(tmp_path):
    write_run(tmp_path, on_gpu(run_record("run-gone", [{"index": 0}, {"index": 1}])))
    result = omni_dp(tmp_path, "run-gone", "--overlap")
    assert result.returncode == 2 and "is not live" in result.stderr


def test_a_replica_that_does_not_record_is_named_before_any_load(tmp_path, spawn, stubs,
                                                                 router):
    replicas = [stubs(busy_replica(0.0)), stubs(busy_replica(None))]
    gpu_run(tmp_path, spawn(), router, replicas)
    result = omni_dp(tmp_path, "--overlap")  # the only live run
    assert result.returncode == 2, result.stdout + result.stderr
    assert "replica 1 does not time its GPU steps: the stand-in does not record" in result.stderr
    assert router.seen == []  # refused before the load


def test_a_router_with_a_key_needs_it(tmp_path, spawn, stubs, router):
    replicas = [stubs(busy_replica(0.0)), stubs(busy_replica(0.0))]
    gpu_run(tmp_path, spawn(), router, replicas, api_key_set=True)
    env = {k: v for k, v in os.environ.items() if k != "OMNI_DP_API_KEY"}
    result = subprocess.run([sys.executable, "-m", "omni_dp", "verify-mps", "--overlap"],
                            capture_output=True, text=True, timeout=60,
                            env={**env, "OMNI_DP_STATE_DIR": str(tmp_path)})
    assert result.returncode == 2 and "set OMNI_DP_API_KEY" in result.stderr
    keyed = omni_dp(tmp_path, "--overlap", "--duration", "0.5", "--concurrency", "2",
                    env={"OMNI_DP_API_KEY": "k3y"})
    assert keyed.returncode == 0, keyed.stdout + keyed.stderr
    assert {auth for method, _, auth, _ in router.seen if method == "POST"} == {"Bearer k3y"}


@pytest.mark.parametrize(("phases", "code", "verdict"), [
    ((0.0, 0.0), 0, "PASS"),  # busy at the same time: MPS
    ((0.0, STEP_S / 2), 1, "FAIL"),  # one, then the other: time slicing
])
def test_the_verdict_over_the_replicas_intervals(tmp_path, spawn, stubs, router, phases, code,
                                                 verdict):
    replicas = [stubs(busy_replica(p)) for p in phases]
    gpu_run(tmp_path, spawn(), router, replicas)
    result = omni_dp(tmp_path, "run-o", "--overlap", "--duration", "0.5", "--concurrency", "2",
                     "--json")
    assert result.returncode == code, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["result"] == verdict
    [gpu] = report["gpus"]
    assert gpu["replicas"] == [0, 1] and gpu["share"] == pytest.approx(
        1.0 if verdict == "PASS" else 0.0, abs=1e-3)  # epoch seconds: float rounding
    assert report["load"]["ok"] > 0 and report["load"]["failed"] == 0
    assert all(method == "POST" and path == "/v1/audio/speech"
               for method, path, _, _ in router.seen)
    text = omni_dp(tmp_path, "run-o", "--overlap", "--duration", "0.5", "--concurrency", "2")
    assert text.returncode == code
    assert f"RESULT: {verdict}" in text.stdout and "replica 1: busy 0.500 s" in text.stdout


def test_each_gpu_is_judged_on_its_own_replicas(tmp_path, spawn, stubs, router):
    """GPU 0's replicas run at once, GPU 1's take turns: the run fails on GPU 1 alone, though
    replicas of different GPUs overlap."""
    phases = (0.0, 0.0, 0.0, STEP_S / 2)
    replicas = [stubs(busy_replica(p)) for p in phases]
    gpu_run(tmp_path, spawn(), router, replicas, gpus=[0, 0, 1, 1])
    result = omni_dp(tmp_path, "run-o", "--overlap", "--duration", "0.5", "--concurrency", "2",
                     "--json")
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert [(g["index"], g["replicas"], g["result"]) for g in report["gpus"]] == [
        (0, [0, 1], "PASS"), (1, [2, 3], "FAIL")]
    only = omni_dp(tmp_path, "run-o", "--overlap", "--gpu", "0", "--duration", "0.5",
                   "--concurrency", "2", "--json")
    assert only.returncode == 0 and [g["index"] for g in json.loads(only.stdout)["gpus"]] == [0]


def test_overlap_options_go_with_overlap(tmp_path):
    result = omni_dp(tmp_path, "run-x", "--duration", "3", "--min-share", "0.5")
    assert result.returncode == 2
    assert "--duration, --min-share: only with --overlap" in result.stderr
