"""The vllm-omni adapter's live-process parts, which on the real engine need CUDA, against a
STAND-IN replica (tests/support/vllm_omni_standin.py: one API process and a child per stage of
the deploy file, each logging vLLM's KV line): the argv the plan builds starts it, the stage
workers are found in the replica's session, the KV read back from its log is the pin's, and
the launcher's group stop leaves none of them. vllm-omni's own contract is checked in
test_engine_vllm_omni_contract.py; this is not vllm-omni."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_engine_vllm_omni import DEPLOY, PER_TOKEN, request, write_model

from omni_dp.blocking_http import http_text
from omni_dp.launcher.engines.base import ReplicaLaunch
from omni_dp.launcher.engines.model_dir import read_model
from omni_dp.launcher.engines.readback import start_banner
from omni_dp.launcher.engines.vllm_omni import VllmOmniEngine
from omni_dp.launcher.processes.groups import (
    ReplicaGroup,
    find_replica_processes,
    session_processes,
    stop_groups,
)
from omni_dp.procs import identify, is_alive

from support.ports import free_port
from support.vllm_omni_standin import install_shim

SUPPORT = Path(__file__).resolve().parents[2] / "support"
pytestmark = [pytest.mark.timeout(120)]


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while http_text(url + "/health", timeout=1.0)[0] != 200:
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, "the stand-in never became healthy"
        time.sleep(0.1)


def test_a_replica_started_by_the_plans_argv_is_found_read_back_and_stopped_whole(tmp_path):
    model, _ = read_model(str(write_model(tmp_path)))
    deploy = tmp_path / "qwen3_tts.yaml"
    deploy.write_text(DEPLOY)
    engine = VllmOmniEngine()
    pin, problems = engine.plan_kv(request(model, deploy))
    assert problems == []
    port = free_port()
    launch = ReplicaLaunch(port=port, device="cuda", threads=None, kv_cache_bytes=None,
                           max_total_tokens=8192, python=sys.executable, kv_args=pin.args,
                           work_dir=tmp_path / "replica-0")
    argv = engine.argv(launch, (str(model.path), "--deploy-config", str(deploy)))
    log = tmp_path / "replica-0.log"
    log.write_text(start_banner(0, "text") + "\n")
    shim = install_shim(tmp_path / "shim")
    env = {**os.environ, **engine.environment(launch), "PYTHONPATH": f"{shim}:{SUPPORT}",
           "STANDIN_KV_BYTES_PER_TOKEN": str(PER_TOKEN)}
    (tmp_path / "replica-0" / "tmp").mkdir(parents=True)
    with log.open("a") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                cwd=tmp_path / "replica-0", start_new_session=True)
    leader, found = None, []
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, log)
        leader = identify(proc.pid)
        assert leader is not None
        deadline = time.monotonic() + 10
        while len(session_processes(leader)) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        found = find_replica_processes(leader)
        assert len(found) == 3, found  # the API process and one worker per stage
        while log.read_text().count("GPU KV cache size") < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        # stage 0 pinned to 8192 tokens' bytes, stage 1 unpinned (the stand-in's 2048)
        assert engine.read_capacity(f"http://127.0.0.1:{port}", log) == 8192 + 2048
    finally:
        survivors = stop_groups([ReplicaGroup(leader)], None, 5.0) if leader else []
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
    assert survivors == []
    assert found and not any(is_alive(p.identity) for p in found)
