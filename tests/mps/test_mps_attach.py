"""Attachment proof with a scripted front end and real processes carrying run tokens."""

from __future__ import annotations

import json
import os

import pytest

from omni_dp.mps.attach import (
    DeclaredProcess,
    ReplicaProcesses,
    verify_attachment,
    write_artifacts,
)
from omni_dp.mps.control import MpsControl
from omni_dp.procs import identify

TOKEN = "token-of-this-run"


@pytest.fixture
def run(standin, spawn, tmp_path):
    """Two replicas: replica 0 has a CUDA talker and a CPU preprocess process, replica 1 one
    CUDA process. Each process carries the run token and its replica index."""
    r0_talker = spawn({"OMNI_DP_RUN_TOKEN": TOKEN, "OMNI_DP_REPLICA": "0"})
    r0_pre = spawn({"OMNI_DP_RUN_TOKEN": TOKEN, "OMNI_DP_REPLICA": "0"})
    r1_main = spawn({"OMNI_DP_RUN_TOKEN": TOKEN, "OMNI_DP_REPLICA": "1"})
    replicas = [
        ReplicaProcesses(0, (DeclaredProcess(r0_talker, "talker", "cuda:0"),
                             DeclaredProcess(r0_pre, "preprocess", "cpu"))),
        ReplicaProcesses(1, (DeclaredProcess(r1_main, "main", "cuda:0"),)),
    ]
    control = MpsControl(str(standin.binary), str(tmp_path / "p"), str(tmp_path / "l"))
    return {"replicas": replicas, "control": control, "talker": r0_talker, "pre": r0_pre,
            "r1": r1_main}


def clients(standin, *pids, servers=(900,)):
    replies = {"get_server_list": "\n".join(map(str, servers))}
    for server in servers:
        replies[f"get_client_list {server}"] = "\n".join(map(str, pids))
    standin.set(replies)


def test_pass_when_every_cuda_process_is_a_client(standin, run):
    clients(standin, run["talker"], run["r1"])
    report = verify_attachment(run["replicas"], TOKEN, run["control"])
    assert report.passed, report
    assert [m.replica for m in report.clients] == [0, 1]
    assert [m.role for m in report.clients] == ["talker", "main"]
    assert report.nvml.startswith("not checked")


def test_one_missing_cuda_process_of_a_multi_process_replica_fails(standin, spawn, run):
    # replica 0 gets a second CUDA process (e.g. its vocoder) that never reached the daemon
    vocoder = spawn({"OMNI_DP_RUN_TOKEN": TOKEN, "OMNI_DP_REPLICA": "0"})
    replicas = [ReplicaProcesses(0, (*run["replicas"][0].processes,
                                     DeclaredProcess(vocoder, "vocoder", "cuda:0"))),
                run["replicas"][1]]
    clients(standin, run["talker"], run["r1"])
    report = verify_attachment(replicas, TOKEN, run["control"])
    assert not report.passed
    verdict0, verdict1 = report.replicas
    assert not verdict0.passed and verdict1.passed
    assert "vocoder" in verdict0.problems[0] and str(vocoder) in verdict0.problems[0]


def test_cpu_process_need_not_be_a_client(standin, run):
    clients(standin, run["talker"], run["r1"])
    assert verify_attachment(run["replicas"], TOKEN, run["control"]).replicas[0].passed


@pytest.mark.parametrize("env", [{}, {"OMNI_DP_RUN_TOKEN": "another-run", "OMNI_DP_REPLICA": "0"},
                                 {"OMNI_DP_RUN_TOKEN": TOKEN}])
def test_a_client_of_no_replica_is_unmatched_and_fails(standin, spawn, run, env):
    stranger = spawn(env)
    clients(standin, run["talker"], run["r1"], stranger)
    report = verify_attachment(run["replicas"], TOKEN, run["control"])
    assert not report.passed
    unmatched = [m for m in report.clients if m.replica is None]
    assert [m.pid for m in unmatched] == [stranger]
    assert "belong to no replica" in report.problems[0]


def test_a_client_claiming_another_replicas_process_is_unmatched(standin, spawn, run):
    liar = spawn({"OMNI_DP_RUN_TOKEN": TOKEN, "OMNI_DP_REPLICA": "1"})
    replicas = [ReplicaProcesses(0, (DeclaredProcess(liar, "talker", "cuda:0"),))]
    clients(standin, liar)
    report = verify_attachment(replicas, TOKEN, run["control"])
    assert not report.passed
    assert report.clients[0].replica is None


def test_zero_servers_fails(standin, run):
    standin.set({"get_server_list": ""})
    report = verify_attachment(run["replicas"], TOKEN, run["control"])
    assert not report.passed
    assert "found 0" in report.problems[0]
    assert all(not v.passed for v in report.replicas)


def test_two_servers_fail_even_if_every_process_is_a_client(standin, run):
    clients(standin, run["talker"], run["r1"], servers=(900, 901))
    report = verify_attachment(run["replicas"], TOKEN, run["control"])
    assert not report.passed
    assert "exactly one MPS server, found 2" in report.problems[0]


def test_unreachable_daemon_fails_with_the_reason(standin, run):
    standin.set(unreachable=True)
    report = verify_attachment(run["replicas"], TOKEN, run["control"])
    assert not report.passed
    assert "Cannot find MPS control daemon" in report.problems[0]


def test_malformed_client_list_fails(standin, run):
    standin.set({"get_server_list": "900", "get_client_list 900": f"{run['talker']}\nbogus"})
    report = verify_attachment(run["replicas"], TOKEN, run["control"])
    assert not report.passed
    assert "bogus" in report.problems[0]


def test_nvml_cross_check_catches_a_gpu_process_outside_mps(standin, run):
    clients(standin, run["talker"], run["r1"])
    # NVML sees the CPU-declared preprocess process on the GPU: it is not a client
    report = verify_attachment(run["replicas"], TOKEN, run["control"],
                               gpu_pids=lambda: ({run["talker"], run["pre"]}, None))
    assert not report.passed
    assert "uses the GPU (NVML)" in report.replicas[0].problems[0]
    assert report.nvml == "checked"


def test_nvml_unavailable_is_said_in_the_report(standin, run):
    clients(standin, run["talker"], run["r1"])
    report = verify_attachment(run["replicas"], TOKEN, run["control"],
                               gpu_pids=lambda: (None, "NVML unavailable (no driver)"))
    assert report.passed
    assert report.nvml == "not checked: NVML unavailable (no driver)"


def test_artifacts_are_written_and_agree(standin, run, tmp_path):
    clients(standin, run["talker"], run["r1"])
    report = verify_attachment(run["replicas"], TOKEN, run["control"])
    write_artifacts(report, tmp_path)
    text = (tmp_path / "mps_attach.txt").read_text()
    data = json.loads((tmp_path / "mps_attach.json").read_text())
    assert text.splitlines()[0] == "mps_server 900"
    assert f"  client {run['talker']} -> replica 0 (talker)" in text
    assert text.rstrip().endswith("RESULT: PASS")
    assert data["result"] == "PASS"
    assert [c["pid"] for c in data["clients"]] == [run["talker"], run["r1"]]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".mps_attach")]  # no temp left

    standin.set({"get_server_list": ""})
    write_artifacts(verify_attachment(run["replicas"], TOKEN, run["control"]), tmp_path)
    assert (tmp_path / "mps_attach.txt").read_text().rstrip().endswith("RESULT: FAIL")


# --- clients whose environment no longer shows the token (renamed engine children) ----------


def _found_in_session(pid: int, role: str, **changes) -> DeclaredProcess:
    """As the launcher records a process it found in the replica's session."""
    identity = identify(pid)
    assert identity is not None
    return DeclaredProcess(pid, role, "cuda:0", changes.get("create_time",
                                                            identity.create_time))


def test_a_client_without_the_token_is_the_replicas_by_its_session_record(standin, spawn, run):
    worker = spawn({})  # its environ shows no run token (as vLLM's Worker after setproctitle)
    replicas = [ReplicaProcesses(0, (_found_in_session(worker, "VLLM::Worker"),)),
                run["replicas"][1]]
    clients(standin, worker, run["r1"])
    report = verify_attachment(replicas, TOKEN, run["control"])
    assert report.passed, report
    assert (report.clients[0].replica, report.clients[0].why) == (
        0, "found in the replica's session")


def test_a_session_record_whose_create_time_differs_proves_nothing(standin, spawn, run):
    """A recycled pid: the recorded process is gone, the client is someone else's."""
    stranger = spawn({})
    recorded = _found_in_session(stranger, "VLLM::Worker",
                                 create_time=identify(stranger).create_time - 100.0)
    replicas = [ReplicaProcesses(0, (recorded,)), run["replicas"][1]]
    clients(standin, stranger, run["r1"])
    report = verify_attachment(replicas, TOKEN, run["control"])
    assert not report.passed
    assert report.clients[0].replica is None
    assert "that process is gone" in report.clients[0].why
    assert not report.replicas[0].passed  # and the replica's own CUDA process is no client


def test_a_declared_pid_without_token_or_session_record_is_unmatched(standin, spawn, run):
    """An engine's own word (no create time: not found by the launcher) is not enough."""
    bare = spawn({})
    replicas = [ReplicaProcesses(0, (DeclaredProcess(bare, "worker", "cuda:0"),)),
                run["replicas"][1]]
    clients(standin, bare, run["r1"])
    report = verify_attachment(replicas, TOKEN, run["control"])
    assert not report.passed
    assert report.clients[0].replica is None
    assert report.clients[0].why == "no run token of this run"
