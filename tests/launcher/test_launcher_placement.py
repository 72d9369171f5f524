"""`omni-dp launch` with a placement: the dotted options pass through to every replica, each
replica's stage processes are recorded (pid and create time) and counted as MPS clients by
their device, a stage process killed with -9 gets its replica restarted, and `down` leaves
none of them behind."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from omni_dp.launcher.engines.base import EngineSizing
from omni_dp.launcher.planning.facts import _cuda_processes
from omni_dp.launcher.planning.options import LaunchOptions

from support.http_client import is_wav, speech
from support.launcher import SUPERVISION
from support.wait import wait_for

PLACEMENT = ("--", "--vocoder.process", "vocoder")


def running(pid: int) -> bool:
    """Alive and not a zombie (an exited child not yet reaped still has its /proc entry)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_mps_counts_the_cuda_processes_the_placement_starts():
    sizing = EngineSizing(weights_bytes=1, kv_cache_bytes=1, kv_tokens=16, overhead_bytes=1,
                          device="cuda:0", processes=(("main", "cpu"), ("talker", "cuda:0"),
                                                      ("vocoder", "cuda:0")))
    assert _cuda_processes(LaunchOptions(replicas=3), sizing) == 6
    assert _cuda_processes(LaunchOptions(replicas=3), None) == 3  # the engine's estimate


@pytest.mark.slow
def test_a_placed_run_records_restarts_and_downs_every_stage_process(runs):
    run = runs(1)
    run.launch("--gpu", "none", "--cpu-blocks", "none", *SUPERVISION, *PLACEMENT)
    replica = run.run_json()["replicas"][0]
    roles = {p["role"]: p["pid"] for p in replica["processes"]}
    assert set(roles) == {"main", "vocoder"} and roles["main"] == replica["pid"]
    status, _, body = speech(run.router_url, "Placed.")
    assert status == 200 and is_wav(body)

    os.kill(roles["vocoder"], signal.SIGKILL)
    killed = time.time()

    def restarted():
        record = run.run_json()["replicas"][0]
        new = {p["role"]: p["pid"] for p in record["processes"]}
        return (record["pid"] != replica["pid"] and set(new) == {"main", "vocoder"}
                and run.status()["replicas"][0]["health"] == "healthy") and new

    again = wait_for("the replica restarted with its stage process", restarted, 90, 0.5)
    assert any(e["event"] == "restart_started" and e["ts"] >= killed - 1 for e in run.events())
    assert speech(run.router_url, "Placed again.")[0] == 200

    result = run.down()
    assert result.returncode == 0, result.stderr
    gone = set(roles.values()) | set(again.values())
    wait_for("no process of the run left", lambda: not run.leftover_pids(), 15)
    wait_for("every stage process gone", lambda: not [p for p in gone if running(p)], 10)
