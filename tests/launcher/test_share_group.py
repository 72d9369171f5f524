"""--share-weights on the launcher's side, without processes: the start and stop waves, the
leader's manifest and a follower's attachment checked (ReplicaControl.share_gate), stopping
followers before their leader (restarts and teardown), the memory measured, and what
`status` shows of it."""

from __future__ import annotations

import json
import os
import subprocess
from types import SimpleNamespace

import pytest

from omni_dp import gpus
from omni_dp.files import make_private_dir
from omni_dp.launcher import teardown as teardown_mod
from omni_dp.launcher.bringup import replicas as replicas_module
from omni_dp.launcher.bringup.replicas import ReplicaControl, replica_memory
from omni_dp.launcher.engines.replica_api import GateFailed
from omni_dp.launcher.planning.share_group import followers, start_waves, stop_waves
from omni_dp.launcher.record.state import RunState
from omni_dp.launcher.views import status as status_module
from omni_dp.launcher.views.status import collect, format_status
from omni_dp.mps.attach import DeclaredProcess
from omni_dp.procs import ProcessIdentity, identify
from omni_dp.runfile import (
    RUN_TRANSITIONS,
    ReplicaState,
    RunPhase,
    RunRecord,
    SupervisorRecord,
    can_transition,
)
from omni_dp.sharefile import (
    SEGMENT_FILE,
    Buffer,
    ModelIdentity,
    ShareManifest,
    TensorEntry,
    write_manifest,
)

from support.plans import run_record

LEADER_ID = ProcessIdentity(1000, 1700000000.5)
SEGMENT_MAPPED = replicas_module.segment_mapped_problem  # the real check (the fixture fakes it)


def sharing_state(tmp_path, *, share: bool = True, replicas: int = 3) -> RunState:
    data = run_record("run-share", [
        {"index": i, "pid": 1000 + i, "create_time": LEADER_ID.create_time + i,
         "pgid": 1000 + i} for i in range(replicas)], gpu="cpu")
    data["plan"]["share_weights"] = share
    directory = tmp_path / "run-share"
    (directory / "logs").mkdir(parents=True)
    state = RunState(directory, RunRecord.from_json(data), "token")
    state.save()
    return state


def manifest(leader: ProcessIdentity = LEADER_ID, **changes) -> ShareManifest:
    tensors = (TensorEntry("talker.embed.weight", "float32", (64, 4), 0, 0, 1024),
               TensorEntry("talker.layers.0.w", "float32", (8,), 0, 1024, 32))
    base = dict(architecture="omni-dp-tts", policy="omni-dp-tts/1",
                model=ModelIdentity("preset tiny, seed 0", "ab" * 32), dtype="float32",
                device="cpu", run_id="run-share", leader=leader,
                buffers=(Buffer("segment", 4096, file=SEGMENT_FILE, sha256="0" * 64),),
                shared=tensors[:1], private=tensors[1:], created_at=1700000001.25)
    return ShareManifest(**{**base, **changes})


def publish(state: RunState, m: ShareManifest) -> None:
    directory = state.directory / "share"
    make_private_dir(directory)
    write_manifest(directory, m)


# --- the waves ----------------------------------------------------------------------------------


def test_the_leader_starts_alone_before_its_followers_and_stops_after_them(tmp_path):
    record = sharing_state(tmp_path).record
    assert start_waves(record, [2, 0, 1]) == [[0], [1, 2]]
    assert stop_waves(record, [0, 1, 2]) == [[1, 2], [0]]
    assert start_waves(record, [2]) == [[2]] and start_waves(record, [0]) == [[0]]
    assert start_waves(record, []) == []
    plain = sharing_state(tmp_path / "plain", share=False).record
    assert start_waves(plain, [1, 0, 2]) == [[0, 1, 2]] == stop_waves(plain, [0, 1, 2])


def test_replica_set_stops_followers_before_their_leader(tmp_path, monkeypatch):
    state = sharing_state(tmp_path)
    waves = []
    monkeypatch.setattr(replicas_module, "stop_replicas",
                        lambda state, indices, timeout_s, reap: waves.append(indices) or [])
    ReplicaControl(state).stop([0, 1, 2], 1.0)
    assert waves == [[1, 2], [0]]


def test_teardown_stops_the_followers_groups_before_the_leaders(tmp_path, monkeypatch):
    state = sharing_state(tmp_path)
    stopped = []
    monkeypatch.setattr(teardown_mod, "live_processes", lambda group, token: [group.leader])
    monkeypatch.setattr(teardown_mod, "is_alive", lambda identity: True)
    monkeypatch.setattr(teardown_mod, "unproven_orphans", lambda group: [])
    monkeypatch.setattr(teardown_mod, "stop_groups", lambda groups, *a, **k: stopped.append(
        [g.leader.pid for g in groups]) or [])
    result = teardown_mod.TeardownResult()
    teardown_mod._stop_replicas(state, 1.0, result, lambda line: None, [])
    assert stopped == [[1001, 1002], [1000]] and result.clean


# --- the share gate ------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def mapped(monkeypatch):
    """These runs' replicas are records without processes: their mappings are taken as seen
    (the check itself is tested below, on real mappings of this process)."""
    monkeypatch.setattr(replicas_module, "segment_mapped_problem", lambda pid, segment: None)


def test_the_leaders_manifest_becomes_the_runs_share_record(tmp_path):
    state = sharing_state(tmp_path)
    publish(state, manifest())
    ReplicaControl(state).share_gate(0)
    share = state.record.share
    # no follower is proven attached to it yet: each is added by its own gate
    assert (share.leader, share.followers, share.policy) == (0, (), "omni-dp-tts/1")
    assert (share.shared_bytes, share.private_bytes, share.tensors) == (1024, 32, 1)
    assert share.directory == str(state.directory / "share") and share.leader_pid == 1000
    [event] = [e for e in state.events() if e["event"] == "share_published"]
    assert (event["replica"], event["bytes"], event["tensors"]) == (0, 1024, 1)


@pytest.mark.parametrize(("published", "why"), [
    (None, "does not exist"),
    (manifest(ProcessIdentity(999, 1.0)), "published by pid 999 (created 1.0), not by the "
                                          "leader now running (pid 1000"),
    (manifest(run_id="another"), "the manifest is of run 'another', not of 'run-share'"),
    (manifest(device="GPU-x"), "the manifest's weights are on GPU-x, the run's on cpu"),
])
def test_a_manifest_that_is_not_this_leaders_fails_its_gate(tmp_path, published, why):
    state = sharing_state(tmp_path)
    if published is not None:
        publish(state, published)
    with pytest.raises(GateFailed) as caught:
        ReplicaControl(state).share_gate(0)
    assert str(caught.value).startswith("replica 0 (the weight-share leader): ")
    assert why in str(caught.value) and state.record.share is None


def test_a_manifest_others_can_read_fails_its_gate(tmp_path):
    state = sharing_state(tmp_path)
    publish(state, manifest())
    os.chmod(state.directory / "share" / "weights.json", 0o644)
    with pytest.raises(GateFailed, match="has mode 644"):
        ReplicaControl(state).share_gate(0)


def attached(state: RunState, **changes) -> dict:
    share = {"role": "follower", "share_dir": str(state.directory / "share"),
             "policy": "omni-dp-tts/1", "shared_bytes": 1024, "private_bytes": 32,
             "tensors_shared": 1, "leader": LEADER_ID.to_json()}
    return {"max_total_num_tokens": 1024, "processes": [], "weight_share": {**share, **changes}}


@pytest.mark.parametrize(("changes", "why"), [
    ({}, None),
    ({"role": "leader"}, "it reports the role 'leader', not 'follower'"),
    ({"share_dir": "/elsewhere"}, "it reads the share directory '/elsewhere', not the run's"),
    ({"leader": {"pid": 1000, "create_time": 5.0}}, "not to replica 0 (pid 1000, created"),
    ({"leader": None}, "it is attached to the leader None"),
])
def test_a_follower_must_be_attached_to_this_leader_through_this_share_dir(tmp_path,
                                                                           monkeypatch, changes,
                                                                           why):
    state = sharing_state(tmp_path)
    publish(state, manifest())
    ReplicaControl(state).share_gate(0)
    monkeypatch.setattr(replicas_module, "server_info", lambda url: attached(state, **changes))
    if why is None:
        ReplicaControl(state).share_gate(2)
        [event] = [e for e in state.events() if e["event"] == "share_attached"]
        assert (event["replica"], event["leader_pid"]) == (2, 1000)
        return
    with pytest.raises(GateFailed) as caught:
        ReplicaControl(state).share_gate(2)
    assert str(caught.value).startswith("replica 2 (a weight-share follower): ")
    assert why in str(caught.value)


def test_a_follower_that_does_not_share_fails_and_a_plain_run_has_no_share_gate(tmp_path,
                                                                                monkeypatch):
    state = sharing_state(tmp_path)
    monkeypatch.setattr(replicas_module, "server_info",
                        lambda url: {"max_total_num_tokens": 1, "processes": [],
                                     "weight_share": None})
    with pytest.raises(GateFailed, match="reports weight_share None: it is not sharing"):
        ReplicaControl(state).share_gate(1)
    plain = sharing_state(tmp_path / "plain", share=False)
    ReplicaControl(plain).share_gate(0)  # reads nothing
    ReplicaControl(plain).share_gate(1)


# --- memory ----------------------------------------------------------------------------------


def test_a_replicas_memory_is_measured_never_guessed():
    me = identify(os.getpid())
    mine = (DeclaredProcess(me.pid, "main", "cpu", me.create_time),)
    gone = (DeclaredProcess(me.pid, "main", "cpu", me.create_time - 100),)
    uss = replica_memory(mine, "cpu", None)
    assert uss is not None and 1024**2 < uss < 64 * 1024**3
    assert replica_memory(gone, "cpu", None) is None and replica_memory((), "cpu", None) is None
    assert replica_memory(mine, "cuda", {me.pid: 3 << 30, 1: 5}) == 3 << 30
    assert replica_memory(mine, "cuda", {1: 5}) is None  # NVML does not list it
    assert replica_memory(mine, "cuda", None) is None  # NVML cannot say


def test_a_replica_with_a_cuda_process_nvml_has_no_figure_for_has_no_memory_figure():
    """Under MPS NVML may give one client's figure and withhold another's: the replica's sum
    would be a part passed off as the whole."""
    child = subprocess.Popen(["sleep", "60"])
    try:
        me, other = identify(os.getpid()), identify(child.pid)
        assert me is not None and other is not None
        talker = DeclaredProcess(me.pid, "talker", "cuda:0", me.create_time)
        vocoder = DeclaredProcess(other.pid, "vocoder", "cuda:0", other.create_time)
        front = DeclaredProcess(other.pid, "main", "cpu", other.create_time)
        assert replica_memory((talker, vocoder), "cuda", {me.pid: 3 << 30}) is None
        assert replica_memory((talker, vocoder), "cuda",
                              {me.pid: 3 << 30, other.pid: 1 << 30}) == 4 << 30
        assert replica_memory((talker, front), "cuda", {me.pid: 3 << 30}) == 3 << 30
    finally:
        child.kill()
        child.wait()


def test_nvml_gives_each_processes_used_memory_where_it_has_a_figure():
    class Error(Exception):
        pass

    process = SimpleNamespace
    nvml = SimpleNamespace(
        NVMLError=Error, nvmlInit=lambda: None, nvmlShutdown=lambda: None,
        nvmlDeviceGetHandleByUUID=lambda uuid: "h",
        nvmlDeviceGetComputeRunningProcesses=lambda h: [process(pid=1, usedGpuMemory=10),
                                                        process(pid=2, usedGpuMemory=None)],
        nvmlDeviceGetMPSComputeRunningProcesses=lambda h: [process(pid=3, usedGpuMemory=7),
                                                           process(pid=1, usedGpuMemory=4)])
    assert gpus.nvml_gpu_memory("GPU-x", nvml) == ({1: 10, 3: 7}, None)

    def refused(h):
        raise Error("Not Supported")

    nvml.nvmlDeviceGetComputeRunningProcesses = refused
    used, why = gpus.nvml_gpu_memory("GPU-x", nvml)
    assert used is None and "Not Supported" in why


# --- status --------------------------------------------------------------------------------------


def test_status_shows_who_shares_the_bytes_shared_once_and_each_replicas_memory(
        tmp_path, monkeypatch):
    monkeypatch.setattr(status_module, "is_alive", lambda identity: True)  # a live run
    state = sharing_state(tmp_path)
    for step in (ReplicaState.RESTARTING, ReplicaState.STARTING):
        state.update_replica(0, state=step)
    report = collect(state, probe=False)
    assert report["share"] == {"published": False, "leader": 0, "leader_state": "starting",
                               "followers": []}
    assert ("share       replica 0 leads: not published (the leader is starting); no "
            "follower attached") in format_status(report)
    state.update_replica(0, state=ReplicaState.HEALTHY)
    publish(state, manifest())
    ReplicaControl(state).share_gate(0)
    monkeypatch.setattr(replicas_module, "server_info", lambda url: attached(state))
    for i in (1, 2):
        ReplicaControl(state).share_gate(i)
    state.update_replica(1, memory_bytes=3 * 1024**2)
    report = json.loads(json.dumps(collect(state, probe=False)))  # as --json prints it
    assert report["share"]["published"] is True and report["share"]["shared_bytes"] == 1024
    assert [r["share_role"] for r in report["replicas"]] == ["leader", "follower", "follower"]
    assert [r["memory_bytes"] for r in report["replicas"]] == [None, 3 * 1024**2, None]
    text = format_status(report)
    assert ("share       replica 0 leads, replica(s) 1, 2 follow: 1.00 KiB of weights held "
            "once (1 tensors, policy omni-dp-tts/1; 32 B private per replica)") in text
    assert "3.00 MiB" in text.splitlines()[-2]  # replica 1's row
    plain = collect(sharing_state(tmp_path / "plain", share=False), probe=False)
    assert plain["share"] is None and plain["replicas"][0]["share_role"] is None


def test_a_kept_state_keeps_the_manifest_but_not_the_weights_segment(tmp_path):
    state = sharing_state(tmp_path)  # its recorded processes are long gone
    publish(state, manifest())
    segment = state.directory / "share" / "weights.bin"
    segment.write_bytes(b"\0" * 4096)
    result = teardown_mod.teardown(state, drain_timeout=1.0, keep_state=True)
    assert result.clean and not result.removed
    assert not segment.exists() and (state.directory / "share" / "weights.json").exists()
    [event] = [e for e in state.events() if e["event"] == "share_segment_removed"]
    assert event["bytes"] == 4096


# --- the proof follows who runs as what passed its gates -----------------------------------------


def test_share_followers_are_the_ones_proven_attached_and_leave_when_they_stop(tmp_path,
                                                                               monkeypatch):
    monkeypatch.setattr(status_module, "is_alive", lambda identity: True)  # a live run
    state = sharing_state(tmp_path)
    publish(state, manifest())
    replicas = ReplicaControl(state)
    replicas.share_gate(0)
    monkeypatch.setattr(replicas_module, "server_info", lambda url: attached(state))
    replicas.share_gate(2)
    assert state.record.share.followers == (2,)
    [line] = [t for t in format_status(collect(state, probe=False)).splitlines()
              if t.startswith("  share ")]
    assert "replica 0 leads, replica(s) 2 follow: " in line
    assert line.endswith("; replica(s) 1 not attached")
    replicas.share_gate(1)
    assert state.record.share.followers == (1, 2)
    monkeypatch.setattr(replicas_module, "stop_replicas", lambda *a, **k: [])
    replicas.stop([2], 1.0)  # stopped: no longer attached
    assert state.record.share.followers == (1,)
    state.update_replica(1, state=ReplicaState.DOWN)  # failed, down: neither
    assert state.record.share.followers == ()
    state.update_replica(0, state=ReplicaState.RESTARTING)  # the leader: no proof at all
    assert state.record.share is None


def test_a_follower_attached_to_another_leader_is_not_added_to_this_ones_proof(tmp_path):
    state = sharing_state(tmp_path)
    publish(state, manifest())
    ReplicaControl(state).share_gate(0)
    assert not state.add_follower(1, leader_pid=4242)
    assert state.add_follower(1, leader_pid=LEADER_ID.pid)
    assert state.record.share.followers == (1,)
    state.update(share=None)
    assert not state.add_follower(2, leader_pid=LEADER_ID.pid) and state.record.share is None


def test_the_followers_of_a_run_are_named_in_one_place(tmp_path):
    assert followers(True, [0, 1, 2]) == [1, 2] and followers(True, (2, 0)) == [2]
    assert followers(False, [0, 1, 2]) == [] and followers(True, [0]) == []
    plain = sharing_state(tmp_path, share=False)
    assert collect(plain, probe=False)["share"] is None


def test_a_replicas_lifecycle_says_which_transitions_are_allowed():
    assert can_transition(ReplicaState.FAILED, ReplicaState.RESTARTING)
    assert can_transition(ReplicaState.DOWN, ReplicaState.DOWN)  # staying as it is
    assert not can_transition(ReplicaState.STOPPED, ReplicaState.RESTARTING)
    assert not can_transition(ReplicaState.PLANNED, ReplicaState.DOWN)
    assert can_transition(RunPhase.STOPPING, RunPhase.STOPPED, RUN_TRANSITIONS)


# --- teardown ------------------------------------------------------------------------------------


def test_the_owner_is_given_a_drain_for_the_router_and_each_stop_wave(tmp_path, monkeypatch):
    state = sharing_state(tmp_path)
    owner = ProcessIdentity(4321, 1.0)
    state.update(supervisor=SupervisorRecord(owner, True))
    (state.directory / "run_token").write_text("token\n")
    bounds = []
    monkeypatch.setattr(teardown_mod, "is_alive", lambda identity: True)
    monkeypatch.setattr(teardown_mod, "signal_ours", lambda identity, sig: True)
    monkeypatch.setattr(teardown_mod, "wait_gone",
                        lambda identities, timeout: bounds.append(timeout) or [])
    teardown_mod._stop_owner(state, "supervisor", 5.0, teardown_mod.TeardownResult(),
                             lambda line: None)
    assert bounds == [3 * 5.0 + 60]  # the router, the followers, then their leader
    plain = sharing_state(tmp_path / "plain", share=False).record
    assert teardown_mod.owner_bound(plain, 5.0) == 2 * 5.0 + 60
    alone = sharing_state(tmp_path / "alone", replicas=1).record
    assert teardown_mod.owner_bound(alone, 5.0) == 2 * 5.0 + 60


def test_a_follower_is_not_called_attached_to_a_share_the_run_never_recorded(tmp_path,
                                                                              monkeypatch):
    state = sharing_state(tmp_path)  # the leader's gate never passed: no share recorded
    monkeypatch.setattr(replicas_module, "server_info", lambda url: attached(state))
    with pytest.raises(GateFailed, match="the run records no share published by the leader"):
        ReplicaControl(state).share_gate(2)
    assert not [e for e in state.events() if e["event"] == "share_attached"]


# --- the launcher's own look at a replica's mappings (CPU) ---------------------------------------


def test_a_read_only_shared_mapping_of_the_segment_is_seen_and_anything_else_is_not(tmp_path):
    """This process maps files the three ways a replica could; the check reads its real
    /proc/self/maps."""
    import mmap

    segment, other = tmp_path / "weights.bin", tmp_path / "copy.bin"
    for path in (segment, other):
        path.write_bytes(b"\1" * 8192)
    check = SEGMENT_MAPPED
    assert "no read-only shared mapping of the weight-share segment" in check(os.getpid(), segment)
    with open(other, "rb") as f:  # a copy of its own: the same bytes, not the run's file
        copy = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    assert "no read-only shared mapping of the weight-share segment" in check(os.getpid(), segment)
    with open(segment, "rb") as f:
        shared = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    assert check(os.getpid(), segment) is None
    with open(segment, "r+b") as f:
        writable = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED)
    assert "maps the weight-share segment" in check(os.getpid(), segment)
    assert "writable" in check(os.getpid(), segment)
    for m in (copy, shared, writable):
        m.close()
    assert "cannot be checked" in check(2**22 + 1, segment)  # no such process


def test_the_share_gate_on_cpu_asks_for_the_mapping_of_the_replicas_own_process(tmp_path,
                                                                                 monkeypatch):
    state = sharing_state(tmp_path)
    publish(state, manifest())
    asked = []
    monkeypatch.setattr(replicas_module, "segment_mapped_problem",
                        lambda pid, segment: asked.append((pid, segment.name)) or
                        ("it does not map the weight-share segment" if pid == 1002 else None))
    ReplicaControl(state).share_gate(0)
    monkeypatch.setattr(replicas_module, "server_info", lambda url: attached(state))
    ReplicaControl(state).share_gate(1)
    with pytest.raises(GateFailed, match=r"replica 2 .*does not map the weight-share segment"):
        ReplicaControl(state).share_gate(2)
    assert asked == [(1000, "weights.bin"), (1001, "weights.bin"), (1002, "weights.bin")]
    assert state.record.share.followers == (1,)



def test_a_mapping_is_recognised_by_its_path_where_maps_shows_another_device(tmp_path):
    """btrfs subvolumes (and overlayfs before Linux 6.8) show a device in /proc/PID/maps that
    is not stat's: the inode and the file's path then name the segment."""
    from omni_dp.launcher.planning.share_group import segment_mapping_problem

    segment = tmp_path / "weights.bin"
    line = "7f00-7f10 {perms} 00000000 00:{dev} 4242 {path}"
    ours = line.format(perms="r--s", dev="2f", path=os.path.realpath(segment))
    assert segment_mapping_problem(ours, (0, 0x2f), 4242, segment) is None  # as stat says
    assert segment_mapping_problem(ours, (0, 0x30), 4242, segment) is None  # by its path
    elsewhere = line.format(perms="r--s", dev="2f", path="/elsewhere/weights.bin")
    assert "no read-only shared mapping" in segment_mapping_problem(elsewhere, (0, 0x30), 4242,
                                                                    segment)
    deleted = ours + " (deleted)"
    assert segment_mapping_problem(deleted, (0, 0x30), 4242, segment) is None
    private = line.format(perms="r--p", dev="2f", path=os.path.realpath(segment))
    assert "no read-only shared mapping" in segment_mapping_problem(private, (0, 0x2f), 4242,
                                                                    segment)


def test_status_calls_nothing_published_by_a_leader_whose_process_is_gone(tmp_path,
                                                                           monkeypatch):
    """run.json still says healthy and published (no sweep has seen the death yet, or no
    supervisor will): status re-checks the processes, as it does every recorded one."""
    state = sharing_state(tmp_path)
    publish(state, manifest())
    ReplicaControl(state).share_gate(0)
    monkeypatch.setattr(replicas_module, "server_info", lambda url: attached(state))
    for i in (1, 2):
        ReplicaControl(state).share_gate(i)
    for i in range(3):
        state.update_replica(i, state=ReplicaState.HEALTHY)
    assert state.record.share.followers == (1, 2)
    follower_2 = state.replica(2).identity
    monkeypatch.setattr(status_module, "is_alive", lambda identity: identity != follower_2)
    report = collect(state, probe=False)
    assert report["share"]["published"] is True and report["share"]["followers"] == [1]
    assert ("attachment seen mapped read-only in their /proc/PID/maps; replica(s) 2 not "
            "attached") in format_status(report)
    monkeypatch.setattr(status_module, "is_alive", lambda identity: False)  # all gone
    report = collect(state, probe=False)
    assert report["share"] == {"published": False, "leader": 0, "leader_state": "healthy",
                               "followers": []}
    assert ("replica 0 leads: not published (the leader is gone, not yet seen by a sweep)"
            in format_status(report))

