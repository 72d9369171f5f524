"""A REAL vLLM engine as omni-dp replicas: vLLM's CPU build (scripts/setup-vllm) serving a
tiny Llama built locally (scripts/make-tiny-llama), two replicas on this machine's two cores.

scripts/test installs both and exports OMNI_DP_VLLM_PYTHON and OMNI_DP_TINY_LLAMA; under CI
(OMNI_DP_REQUIRE_VLLM=1) a missing install fails these tests instead of skipping them. The
stages of one run follow each other in one test, because each vLLM start costs about a minute:
bring-up with the pin read back from /metrics, completions through the router, kill -9 of one
API server (its EngineCore and Worker orphaned, found, stopped, the replica restarted through
the gates), then `down` leaving no process, port, socket file or cache of the run. The run is
registered with a REAL SGLang model gateway (`--register`, scripts/setup-gateway): completions
routed by the gateway reach both replicas, the restarted one is taken out and registered again
(one entry each), and `down` leaves the gateway listing none of them.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request

import psutil
import pytest

from omni_dp.gateway import SglangGateway

from support.launcher import SUPERVISION, Run, alive, describe
from support.ports import port_listening
from support.sglang_gateway import SglangGatewayProcess, smg_path
from support.vllm import installed_vllm, vllm_args
from support.wait import wait_for

LAUNCH_TIMEOUT_S = 600.0
RESTART_TIMEOUT_S = 420.0


@pytest.fixture(scope="module")
def vllm() -> tuple[str, str]:
    return installed_vllm()


def completion(url: str, model: str, prompt: str, timeout: float = 60.0) -> dict:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 8,
                       "temperature": 0}).encode()
    request = urllib.request.Request(url + "/v1/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=timeout) as response:
        assert response.status == 200
        return json.loads(response.read())


def served(url: str) -> float:
    """The completions a vLLM replica finished, from its /metrics."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics(url).splitlines()
               if line.startswith("vllm:request_success_total"))


def listed(gateway_url: str) -> dict[str, bool | None]:
    return {w.url: w.healthy for w in SglangGateway(gateway_url).workers()}


def metrics(url: str) -> str:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url + "/metrics", timeout=10) as response:
        return response.read().decode()


def test_plans_that_vllm_would_get_wrong_exit_2_before_anything_starts(tmp_path, vllm):
    python, model = vllm
    with Run(tmp_path, replicas=2) as run:
        # launch_argv pins 1024 tokens unless told; drop the pin to see it refused
        argv = [a for a in run.launch_argv(*vllm_args(python, model)) if a != "--detach"]
        at = argv.index("--max-total-tokens")
        unpinned = run.cli(*(argv[:at] + argv[at + 2:]))
        assert unpinned.returncode == 2, describe(unpinned)
        assert "--replicas 2 needs a pinned KV size" in unpinned.stderr
        rounded = run.cli(*run.launch_argv("--max-total-tokens", "1000",
                                           *vllm_args(python, model)))
        assert rounded.returncode == 2, describe(rounded)
        assert "vLLM allocates whole blocks of 32 tokens" in rounded.stderr
        assert "ask for 992 or 1024" in rounded.stderr
        assert not run.run_dir.exists()
        assert not run.state_root.exists() or not any(run.state_root.rglob("run.json"))


@pytest.mark.slow
# Its own waits are bounded (bring-up ≤ LAUNCH_TIMEOUT_S, restart ≤ RESTART_TIMEOUT_S, down
# ≤ 180 s) and say what they waited for; pytest's default 300 s would cut a slow but bounded
# restart short with nothing but a stack. ~60 s on an idle 2-core machine.
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + RESTART_TIMEOUT_S + 180)
def test_two_vllm_replicas_pinned_verified_restarted_and_torn_down(tmp_path, vllm):
    python, model = vllm
    timings: dict[str, float] = {}
    with Run(tmp_path, replicas=2) as run, \
            SglangGatewayProcess(smg_path(), tmp_path / "gateway.log") as gateway:
        gateway.wait_ready()
        # --- bring-up: both healthy, the pin read back from each replica's /metrics -------
        started = time.monotonic()
        result = run.launch(*vllm_args(python, model, *SUPERVISION, "--start-timeout", "400",
                                       "--register", gateway.url),
                            timeout=LAUNCH_TIMEOUT_S)
        timings["bring-up of two replicas (s)"] = time.monotonic() - started
        assert "KV capacity equal: 1024 tokens on every replica" in result.stdout
        assert "/v1/completions" in result.stdout  # the example request fits the engine
        record = run.run_json()
        for replica in record["replicas"]:
            assert replica["state"] == "healthy" and replica["kv_tokens"] == 1024
            names = [p["role"] for p in replica["processes"]]
            assert any("EngineCore" in n for n in names), names  # found by session
            assert all(p["create_time"] for p in replica["processes"])
            text = metrics(replica["url"])
            assert 'num_gpu_blocks="32"' in text and 'block_size="32"' in text
            env = replica["env"]
            assert env["VLLM_CPU_OMP_THREADS_BIND"] == replica["cpus"]
            assert env["TMPDIR"].startswith(str(run.run_dir))

        # --- completions through the router, both replicas serving -------------------------
        for i in range(6):
            reply = completion(run.router_url, model, f"Hello number {i}")
            assert reply["choices"][0]["text"] is not None

        # --- the gateway lists both, healthy, and routes completions to both ---------------
        urls = [r["url"] for r in record["replicas"]]
        assert listed(gateway.url) == {url: True for url in urls}, gateway.log_text()[-3000:]
        before = [served(url) for url in urls]
        for i in range(4):  # the test gateway balances round robin
            completion(gateway.url, model, f"Through the gateway {i}")
        after = [served(url) for url in urls]
        assert all(b > a for a, b in zip(before, after, strict=True)), (before, after)

        # --- kill -9 of replica 0's API server: orphans found, stopped, restarted ----------
        victim = record["replicas"][0]
        orphans = [p for p in victim["processes"] if p["pid"] != victim["pid"]]
        assert orphans, victim["processes"]
        killed_at = time.monotonic()
        os.kill(victim["pid"], signal.SIGKILL)
        wait_for("the API server to die", lambda: not alive(victim["pid"]), timeout=10,
                 interval=0.05)
        assert any(alive(p["pid"], p["create_time"]) for p in orphans), \
            "vLLM's children outlive a SIGKILLed API server (the reason for session teardown)"

        def back() -> bool:
            replica = run.run_json()["replicas"][0]
            return replica["state"] == "healthy" and replica["pid"] != victim["pid"]

        wait_for("replica 0 back through the gates", back, timeout=RESTART_TIMEOUT_S,
                 interval=1.0)
        timings["kill -9 to healthy again (s)"] = time.monotonic() - killed_at
        assert not any(alive(p["pid"], p["create_time"]) for p in orphans), \
            "the orphans of the killed API server were left running"
        [completed] = [e for e in run.events() if e["event"] == "restart_completed"]
        assert completed["replica"] == 0 and completed["in_router"] is True
        assert run.run_json()["replicas"][0]["kv_tokens"] == 1024
        completion(run.router_url, model, "Hello again")
        assert listed(gateway.url) == {url: True for url in urls}  # one entry each
        gone = [e["event"] for e in run.events() if e.get("replica") == 0
                and e["event"].startswith("gateway_")]
        assert gone[-2:] == ["gateway_deregistered", "gateway_registered"], gone
        completion(gateway.url, model, "Through the gateway again")

        # --- down: nothing of the run is left ---------------------------------------------
        pids_before = run.leftover_pids()
        assert pids_before
        down = run.down(timeout=180)
        assert down.returncode == 0, describe(down)
        assert run.leftover_pids() == []
        assert not [p for p in pids_before if psutil.pid_exists(p) and alive(p)]
        assert not any(port_listening(p) for p in run.ports)
        assert not run.run_dir.exists()  # TMPDIR (IPC sockets), VLLM_CACHE_ROOT inside it
        assert listed(gateway.url) == {}
    for what, seconds in timings.items():
        print(f"vllm live: {what}: {seconds:.1f}")
