"""`omni-dp launch --register URL` against the REAL SGLang model gateway (sglang-router 0.3.2,
installed by scripts/setup-gateway), with real built-in replicas: registered once they passed
their gates, re-registered after a kill -9 and restart without a leftover entry, removed by
`down` — also after the supervisor itself was killed. (The built-in engine serves speech, which
the gateway does not proxy; routed completions through the gateway are asserted with real vLLM
replicas in test_engine_vllm_live.py.)
"""

from __future__ import annotations

import os
import signal

import pytest

from omni_dp.gateway import SglangGateway

from support.launcher import SUPERVISION, Run, alive, describe
from support.sglang_gateway import SglangGatewayProcess, smg_path
from support.wait import wait_for

pytestmark = pytest.mark.slow


@pytest.fixture
def gateway(tmp_path):
    with SglangGatewayProcess(smg_path(), tmp_path / "gateway.log") as process:
        yield process.wait_ready()


def listed(gateway) -> dict[str, bool | None]:
    return {w.url: w.healthy for w in SglangGateway(gateway.url).workers()}


def test_replicas_registered_after_their_gates_re_registered_after_a_restart_removed_by_down(
        tmp_path, gateway):
    """And `omni-dp scale` 2 → 3 → 1: the gateway lists a new replica once it passed its
    gates, and no removed one."""
    run = Run(tmp_path, replicas=3)  # ports for three: the scale adds one
    run.replicas = 2
    with run:
        # unpinned: three replicas need three cores to pin, and this machine may have two
        result = run.launch("--max-total-tokens", "1024", "--register", gateway.url,
                            "--cpu-blocks", "none", *SUPERVISION)
        assert result.returncode == 0, describe(result)
        urls = [r["url"] for r in run.run_json()["replicas"]]
        assert listed(gateway) == {url: True for url in urls}, gateway.log_text()[-2000:]
        for url in urls:
            assert f"({url}) with the SGLang model gateway at {gateway.url}: listed healthy" \
                in result.stdout
        record = run.run_json()["gateway"]
        assert record["url"] == gateway.url
        assert sorted(e["target"] for e in record["entries"]) == sorted(urls)
        assert all(e["worker_id"] for e in record["entries"])
        assert "does not proxy /v1/audio/speech" in result.stdout  # said, not hidden

        # kill -9 of replica 1: out of the gateway while it restarts, back after its gates
        victim = run.run_json()["replicas"][1]
        os.kill(victim["pid"], signal.SIGKILL)

        def back() -> bool:
            replica = run.run_json()["replicas"][1]
            return replica["state"] == "healthy" and replica["pid"] != victim["pid"] \
                and any(e["event"] == "restart_completed" for e in run.events())

        wait_for("replica 1 back through its gates", back, timeout=120, interval=0.2)
        events = [(e["event"], e.get("replica")) for e in run.events()
                  if e["event"].startswith("gateway_")]
        assert events[-2:] == [("gateway_deregistered", 1), ("gateway_registered", 1)], events
        assert listed(gateway) == {url: True for url in urls}  # one entry each, no leftover

        up = run.cli("scale", run.run_id, "--replicas", "3", timeout=240)
        assert up.returncode == 0, describe(up)
        three = [r["url"] for r in run.run_json()["replicas"]]
        assert three[:2] == urls and listed(gateway) == {url: True for url in three}
        down_to_one = run.cli("scale", run.run_id, "--replicas", "1", timeout=240)
        assert down_to_one.returncode == 0, describe(down_to_one)
        assert listed(gateway) == {urls[0]: True}
        assert [e["target"] for e in run.run_json()["gateway"]["entries"]] == [urls[0]]

        # kill -9 of the supervisor: `down` still removes the run's entries, from run.json
        supervisor = run.run_json()["supervisor"]["pid"]
        os.kill(supervisor, signal.SIGKILL)
        wait_for("the supervisor to die", lambda: not alive(supervisor), 10, interval=0.05)
        down = run.down()
        assert down.returncode == 0, describe(down)
        assert listed(gateway) == {}
        assert not run.run_dir.exists()


def test_an_unreachable_gateway_is_refused_before_anything_starts(tmp_path):
    with Run(tmp_path, replicas=1) as run:
        result = run.launch("--register", "http://127.0.0.1:9", check=False)
        assert result.returncode == 2, describe(result)
        assert "--register http://127.0.0.1:9:" in result.stderr
        assert not run.run_dir.exists()
