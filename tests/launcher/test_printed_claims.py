"""What launch and status print, held to the checks it comes from: the ready line's `checked:`
names exactly the gates bring-up ran and passed (no more, no fewer), and `healthy` in status's
rows (which the ready line counts as `verified`) is a 200 from the replica's /health, nothing
else. The supervisor's fakes (support/supervision.py) stand in for replicas, router and daemon;
no process is started."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from omni_dp.launcher.bringup import steps
from omni_dp.launcher.bringup.steps import BringUpFailed, bring_up
from omni_dp.launcher.views import status as status_module
from omni_dp.launcher.views.status import collect, format_status
from omni_dp.launcher.views.summary import RunSummary
from omni_dp.runfile import ReplicaState

from support.plans import run_record, stored_state
from support.supervision import FakeReplicas, FakeWorld, make_state


class ReadBack(FakeReplicas):
    """FakeReplicas whose KV gate leaves the capacity it read back on each replica's record,
    as the real gate's read does (`tokens`: 0 for a model that keeps no KV)."""

    def __init__(self, state, tokens: int) -> None:
        super().__init__(state, FakeWorld(set()))
        self.tokens = tokens

    def check_kv(self, indices):
        super().check_kv(indices)
        for i in indices:
            self.state.update_replica(i, kv_tokens=self.tokens)


def planned(state, *, mps: bool = False, share: bool = False) -> SimpleNamespace:
    """The parts of a LaunchPlan bring_up reads, for this run's record."""
    options = SimpleNamespace(mps=mps, share_weights=share, register=False)
    return SimpleNamespace(
        options=options, mps_binaries=None, mps_binary=None, gpus=state.record.gpus,
        replicas=[SimpleNamespace(index=r.index) for r in state.replicas], start="parallel",
        start_timeout=5.0, expected_kv_tokens=state.plan.expected_kv_tokens,
        router_url="http://router.test")


@pytest.fixture
def no_processes(monkeypatch):
    """start_daemon and start_router stood in for; the calls each got."""
    started: list[str] = []

    def start_daemon(state, slot, binary, server_binary=None):
        started.append(f"daemon {slot}")
        return SimpleNamespace(limits=SimpleNamespace(any=False))

    def start_router(state):
        started.append("router")
        return SimpleNamespace(pid=900, popen=None)

    monkeypatch.setattr(steps, "start_daemon", start_daemon)
    monkeypatch.setattr(steps, "start_router", start_router)
    return started


def run_up(tmp_path, *, mps=False, share=False, tokens=1024, attached=True):
    state = make_state(tmp_path, replicas=3, mps=mps, share=share)
    for i in range(3):  # planned, not yet started
        state.update_replica(i, state=ReplicaState.RESTARTING)
    replicas, said = ReadBack(state, tokens), []
    replicas.attached = attached
    up = bring_up(planned(state, mps=mps, share=share), state, replicas, said.append)
    return up, said, replicas


def ready(checks: tuple[str, ...], health: tuple[str, ...] = ("healthy",) * 3) -> str:
    return RunSummary(run_id="run-units", endpoint="http://router.test",
                      replicas=[{"health": h} for h in health], checks=checks, try_command="",
                      status_command="", teardown_command="").ready_line


def test_checked_names_every_gate_bring_up_passed_and_only_those(tmp_path, no_processes):
    """A sharing run under MPS passed four gates and says four; a plain run says two. Each
    gate is named only once it ran: the share gates of every follower, the attachment of
    every CUDA process."""
    up, said, replicas = run_up(tmp_path / "all", mps=True, share=True)
    assert up.checks == ("health", "equal KV", "weight sharing", "MPS attachment")
    assert ("share_gate", 2) in replicas.calls and ("verify_attachment", 0) in replicas.calls
    assert ready(up.checks).endswith(
        "(run run-units; checked: health, equal KV, weight sharing, MPS attachment)")
    assert "KV capacity equal: 1024 tokens on every replica (read back from each)" in said

    up, _, replicas = run_up(tmp_path / "plain")
    assert up.checks == ("health", "equal KV")
    assert not [c for c in replicas.calls if c[0] in ("share_gate", "verify_attachment")]
    assert ready(up.checks).endswith("(run run-units; checked: health, equal KV)")


def test_a_model_with_no_kv_is_said_so_and_never_checked_as_equal_kv(tmp_path, no_processes):
    """Every replica read back 0 tokens (a Piper voice): no claim of equal KV capacity."""
    up, said, _ = run_up(tmp_path, tokens=0)
    assert up.checks == ("health", "no KV cache")
    assert ("no KV cache on any replica: the model keeps none (read back from each: 0 tokens)"
            in said)
    assert not [line for line in said if line.startswith("KV capacity equal")]


def test_a_failed_attachment_claims_nothing_and_starts_no_router(tmp_path, no_processes,
                                                                  monkeypatch):
    monkeypatch.setattr(steps, "format_text", lambda report: "(the report)")
    with pytest.raises(BringUpFailed, match="MPS attachment verification FAILED"):
        run_up(tmp_path, mps=True, attached=False)
    assert no_processes == ["daemon 0"]  # no router


def test_only_a_200_from_health_is_healthy_and_only_those_are_verified(tmp_path,
                                                                         monkeypatch):
    """status's health column, which the ready line counts: 200 healthy; a 503, or no answer,
    unhealthy, saying which; a process that is gone, down."""
    answers = {"http://127.0.0.1:1": 200, "http://127.0.0.1:2": 503,
               "http://127.0.0.1:3": None}
    probed: list[str] = []

    def http_json(method, url, timeout):
        probed.append(url)
        return answers[url.removesuffix("/health")], None

    monkeypatch.setattr(status_module, "http_json", http_json)
    monkeypatch.setattr(status_module, "is_alive", lambda identity: identity.pid != 13)
    data = run_record("run-health", [{"index": i, "pid": 10 + i, "create_time": 1.0}
                                     for i in range(4)])
    report = collect(stored_state(tmp_path / "run-health", data))
    health = [r["health"] for r in report["replicas"]]
    assert health == ["healthy", "unhealthy (503)", "unhealthy (no answer)", "down"]
    assert probed == [f"http://127.0.0.1:{i}/health" for i in (1, 2, 3)]
    assert ready(("health", "equal KV"), tuple(health)).startswith(
        "ready: 1 of 4 replicas verified behind http://router.test ")
    rows = format_status(report).splitlines()[-4:]
    assert [row.split()[4] for row in rows] == ["healthy", "unhealthy", "unhealthy", "down"]
    assert "unhealthy (503)" in rows[1] and "unhealthy (no answer)" in rows[2]


def test_the_mps_column_says_attached_only_of_a_replica_proven_a_client(tmp_path, monkeypatch):
    """status's `mps` column: attached where the attachment check proved it, NO where it
    failed, `-` where no check has run (the text table and the markdown alike)."""
    monkeypatch.setattr(status_module, "is_alive", lambda identity: True)
    daemon = {"pid": 50, "create_time": 1.0, "binary": "nvidia-cuda-mps-control",
              "pipe_dir": "/run/mps/pipe", "log_dir": "/run/mps/log", "gpu_uuid": "GPU-test"}
    data = run_record("run-mps", [{"index": i, "pid": 10 + i, "create_time": 1.0,
                                   "mps_attached": proven}
                                  for i, proven in enumerate((True, False, None))], daemon)
    report = collect(stored_state(tmp_path / "run-mps", data), probe=False)
    assert report["mps"]["attached"] is None  # not every replica checked: no run-wide claim
    rows = format_status(report).splitlines()[-3:]
    assert [row.split()[6] for row in rows] == ["attached", "NO", "-"]
    markdown = format_status(report, fmt="markdown").splitlines()
    assert [line.split(" | ")[6] for line in markdown if line.startswith("| 1")] == ["NO"]
