"""The run-state format (omni_dp/runfile.py): a run.json the launcher writes reads back into
typed records and writes out byte for byte; state changes follow the lifecycle maps; a file
that does not parse is a RunFileError naming it; "live" has one meaning."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import replace

import pytest

from omni_dp.launcher.record.state import RunState
from omni_dp.mps.attach import DeclaredProcess
from omni_dp.mps.daemon import DaemonLimits, DaemonRecord
from omni_dp.procs import ProcessIdentity, identify
from omni_dp.runfile import (
    REPLICA_TRANSITIONS,
    RUN_TRANSITIONS,
    IllegalTransition,
    ReplicaState,
    RouterRecord,
    RunFileError,
    RunPhase,
    RunRecord,
    ShareRecord,
    StoredRun,
    SupervisorRecord,
    find_run_dir,
    pick_run,
    read_run,
    run_is_live,
    stored_runs,
)

from support.plans import gpu_run_record, gpus_json, run_record, two_replica_plan

_P, _R = RunPhase, ReplicaState


def _text(state: RunState) -> str:
    return (state.directory / "run.json").read_text()


def _round_trip(text: str) -> str:
    """run.json text → RunRecord → run.json text, as RunState.save writes it."""
    return json.dumps(RunRecord.from_json(json.loads(text)).to_json(), indent=1) + "\n"


@pytest.fixture
def dead_identity() -> ProcessIdentity:
    """The identity of a process that ran and is gone (reaped)."""
    process = subprocess.Popen(["sleep", "60"], stdin=subprocess.DEVNULL)
    identity = identify(process.pid)
    process.kill()
    process.wait(10)
    assert identity is not None
    return identity


@pytest.fixture
def sleeper():
    process = subprocess.Popen(["sleep", "120"], stdin=subprocess.DEVNULL,
                               start_new_session=True)
    yield process
    process.kill()
    process.wait(10)


def _filled(state: RunState, alive: ProcessIdentity, dead: ProcessIdentity) -> None:
    """Every record of the run set, the way bring-up and the supervisor set them."""
    state.set_daemon(DaemonRecord(dead, "/bin/nvidia-cuda-mps-control",
                                  str(state.directory / "mps" / "pipe"),
                                  str(state.directory / "mps" / "log"), "GPU-test",
                                  "/bin/nvidia-cuda-mps-server", gpu=0,
                                  limits=DaemonLimits(40.0, 2 * 1024**3)))
    state.update_replica(0, identity=alive, pgid=alive.pid, state=_R.STARTING)
    state.update_replica(0, state=_R.HEALTHY, kv_tokens=1024, mps_attached=True,
                         processes=(DeclaredProcess(alive.pid, "main", "cuda:0"),
                                    DeclaredProcess(alive.pid + 1, "vocoder", "cpu")))
    state.update_replica(1, identity=dead, pgid=dead.pid, state=_R.STARTING,
                         restarts=(1700000000.25, 1700000100.5), last_error="killed by SIGKILL")
    state.update(router=RouterRecord(dead, dead.pid, state.plan.router.url,
                                     state.plan.router.argv, "router.log"))
    state.update(supervisor=SupervisorRecord(dead, detached=True))
    state.update(supervisor=replace(state.record.supervisor, supervising_since=1700000200.5))
    state.set_phase(_P.RUNNING)


# --- the format: a real run.json, byte for byte ----------------------------------------------


def test_a_new_run_json_keeps_its_layout_and_round_trips_byte_for_byte(tmp_path):
    plan = two_replica_plan(tmp_path)
    state = RunState.create(plan)
    text = _text(state)
    assert _round_trip(text) == text
    data = json.loads(text)
    assert list(data) == ["schema", "run_id", "created_at", "state", "gpu", "device", "plan",
                          "launcher", "supervisor", "router", "mps", "share", "gpus", "gateway",
                          "replicas"]
    assert data["schema"] == 2
    assert list(data["replicas"][0]) == [
        "index", "port", "url", "cpus", "argv", "env", "log", "pid", "create_time", "pgid",
        "processes", "state", "kv_tokens", "mps_attached", "memory_bytes", "restarts",
        "last_error", "gpu"]
    # The plan is what LaunchPlan.to_json() says, to the byte.
    assert json.dumps(data["plan"], indent=1) == json.dumps(plan.to_json(), indent=1)
    assert data["state"] == "starting" and data["replicas"][0]["state"] == "planned"
    assert data["supervisor"] is None and data["router"] is None and data["mps"] is None
    assert data["share"] is None and data["plan"]["share_weights"] is False


def test_a_run_json_with_every_record_set_round_trips_byte_for_byte(tmp_path, dead_identity):
    state = RunState.create(two_replica_plan(tmp_path))
    _filled(state, identify(os.getpid()), dead_identity)
    text = _text(state)
    assert _round_trip(text) == text
    data = json.loads(text)
    assert list(data["router"]) == ["pid", "create_time", "pgid", "url", "argv", "log"]
    assert list(data["supervisor"]) == ["pid", "create_time", "detached", "supervising_since"]
    assert list(data["mps"]) == ["daemons"]
    assert list(data["mps"]["daemons"][0]) == ["pid", "create_time", "binary", "pipe_dir",
                                               "log_dir", "gpu_uuid", "server_binary", "gpu",
                                               "limits"]
    assert data["mps"]["daemons"][0]["limits"] == {"thread_percentage": 40.0,
                                                   "memory_limit_bytes": 2 * 1024**3}
    assert data["replicas"][0]["processes"][1] == {"pid": os.getpid() + 1, "role": "vocoder",
                                                   "device": "cpu"}
    again = RunState.load(state.directory)
    assert again.record == state.record
    assert again.replica(1).restarts == (1700000000.25, 1700000100.5)
    assert again.record.supervisor.supervising_since == 1700000200.5


def test_a_sharing_run_json_round_trips_and_one_written_before_sharing_still_reads(tmp_path):
    state = RunState.create(two_replica_plan(tmp_path, share_weights=True))
    share = ShareRecord(leader=0, followers=(1,), directory=str(state.directory / "share"),
                        policy="omni-dp-tts/1", shared_bytes=27_000_000, private_bytes=4096,
                        tensors=31, leader_pid=4242, published_at=1700000300.5)
    state.update(share=share)
    state.update_replica(1, memory_bytes=123_456_789)
    text = _text(state)
    assert _round_trip(text) == text
    data = json.loads(text)
    assert list(data["share"]) == ["leader", "followers", "directory", "policy",
                                   "shared_bytes", "private_bytes", "tensors", "leader_pid",
                                   "published_at"]
    again = RunState.load(state.directory).record
    assert again.share == share and again.plan.share_weights is True
    assert [r.memory_bytes for r in again.replicas] == [None, 123_456_789]
    # A run.json of an omni-dp before sharing: none of the three keys.
    del data["share"], data["plan"]["share_weights"]
    for replica in data["replicas"]:
        del replica["memory_bytes"]
    old = RunRecord.from_json(data)
    assert old.share is None and old.plan.share_weights is False
    assert [r.memory_bytes for r in old.replicas] == [None, None]


# --- runs over several GPUs: schema 2, and schema 1 still read -------------------------------


def _daemon_json(gpu: int | None, pid: int = 4242) -> dict:
    """A daemon as run.json holds it; schema 1's has no "gpu"."""
    return {"pid": pid + (gpu or 0), "create_time": 1700000000.5, "binary": "/bin/mps-control",
            "pipe_dir": f"/run/x/mps/gpu{gpu}/pipe", "log_dir": f"/run/x/mps/gpu{gpu}/log",
            "gpu_uuid": f"GPU-{gpu}", "server_binary": None,
            **({} if gpu is None else {"gpu": gpu})}


def test_a_schema_1_run_json_reads_as_one_gpu_with_its_daemon_and_is_written_as_schema_2():
    old = run_record("run-old", [{"index": 0}, {"index": 1}], _daemon_json(None), "GPU-test")
    assert old["schema"] == 1 and "gpus" not in old and "gpu" not in old["replicas"][0]
    record = RunRecord.from_json(old)
    assert [(g.slot, g.label) for g in record.gpus] == [(0, "GPU-test")]
    [daemon] = record.daemons
    assert daemon.gpu == 0 and daemon.identity.pid == 4242 and record.daemon(0) == daemon
    assert [r.gpu for r in record.replicas] == [0, 0]
    assert record.replicas_on(0) == record.replicas and record.gpu_key(0) is None
    written = record.to_json()
    assert written["schema"] == 2 and written["mps"] == {"daemons": [daemon.to_json()]}
    assert written["gpus"] == [record.gpus[0].to_json()]
    assert [r["gpu"] for r in written["replicas"]] == [0, 0]
    assert RunRecord.from_json(written) == record


def test_a_schema_2_run_json_over_two_gpus_round_trips(tmp_path):
    data = gpu_run_record("run-gpus", [{"index": i, "gpu": i // 2} for i in range(4)],
                          gpus_json(2), [_daemon_json(k) for k in (0, 1)])
    record = RunRecord.from_json(data)
    assert [(d.gpu, d.identity.pid) for d in record.daemons] == [(0, 4242), (1, 4243)]
    assert [r.index for r in record.replicas_on(1)] == [2, 3]
    assert record.gpu_record(1).title == "GPU 1 (NVIDIA H200)" and record.gpu_key(1) == 1
    text = json.dumps(record.to_json(), indent=1) + "\n"
    assert _round_trip(text) == text
    assert RunRecord.from_json(json.loads(text)) == record
    # through a run directory as well: read_run reads it back as it was written
    (tmp_path / "run.json").write_text(text)
    (tmp_path / "run_token").write_text("t\n")
    assert read_run(tmp_path)[0] == record


# --- the lifecycles: every transition of both maps -------------------------------------------

# The lifecycle as designed, written out: a change to either map must change this table too.
RUN_ALLOWED = {
    _P.STARTING: {_P.RUNNING, _P.STOPPING, _P.FAILED},
    _P.RUNNING: {_P.DEGRADED, _P.STOPPING, _P.FAILED},
    _P.DEGRADED: {_P.RUNNING, _P.STOPPING, _P.FAILED},
    _P.STOPPING: {_P.STOPPED, _P.FAILED},
    _P.STOPPED: set(),
    _P.FAILED: set(),
}
REPLICA_ALLOWED = {
    _R.PLANNED: {_R.STARTING, _R.STOPPED},
    _R.STARTING: {_R.HEALTHY, _R.FAILED, _R.DOWN, _R.RESTARTING, _R.STOPPED},
    _R.HEALTHY: {_R.UNHEALTHY, _R.RESTARTING, _R.DOWN, _R.STOPPED},
    _R.UNHEALTHY: {_R.HEALTHY, _R.RESTARTING, _R.DOWN, _R.STOPPED},
    _R.DOWN: {_R.HEALTHY, _R.UNHEALTHY, _R.RESTARTING, _R.STOPPED},
    _R.RESTARTING: {_R.STARTING, _R.FAILED, _R.DOWN, _R.STOPPED},
    _R.FAILED: {_R.RESTARTING, _R.STOPPED},
    _R.STOPPED: {_R.STARTING, _R.FAILED, _R.DOWN},
}


def test_the_maps_are_the_design():
    assert {k: set(v) for k, v in RUN_TRANSITIONS.items()} == RUN_ALLOWED
    assert {k: set(v) for k, v in REPLICA_TRANSITIONS.items()} == REPLICA_ALLOWED


@pytest.fixture(scope="module")
def base_record(tmp_path_factory) -> RunRecord:
    return RunState.create(two_replica_plan(tmp_path_factory.mktemp("runfile"))).record


@pytest.mark.parametrize(("old", "new"), [(a, b) for a in _P for b in _P])
def test_every_run_transition(base_record, old, new):
    record = replace(base_record, state=old)
    if new == old or new in RUN_ALLOWED[old]:
        assert record.with_phase(new).state is new
    else:
        with pytest.raises(IllegalTransition, match=f"{old.value} -> {new.value}"):
            record.with_phase(new)


@pytest.mark.parametrize(("old", "new"), [(a, b) for a in _R for b in _R])
def test_every_replica_transition(base_record, old, new):
    record = replace(base_record, replicas=(replace(base_record.replicas[0], state=old),
                                            *base_record.replicas[1:]))
    if new == old or new in REPLICA_ALLOWED[old]:
        changed = record.with_replica(0, state=new, last_error="x")
        assert changed.replicas[0].state is new and changed.replicas[0].last_error == "x"
        assert changed.replicas[1] == record.replicas[1]
    else:
        with pytest.raises(IllegalTransition, match=f"{old.value} -> {new.value}"):
            record.with_replica(0, state=new)


def test_a_forbidden_change_through_the_run_state_writes_nothing(tmp_path):
    state = RunState.create(two_replica_plan(tmp_path))
    state.set_phase(_P.STOPPING)
    state.set_phase(_P.STOPPED)
    before = _text(state)
    with pytest.raises(IllegalTransition, match="stopped -> running"):
        state.set_phase(_P.RUNNING)
    with pytest.raises(IllegalTransition, match="planned -> healthy"):
        state.update_replica(1, state=_R.HEALTHY, kv_tokens=1024)
    assert _text(state) == before
    assert state.record.state is _P.STOPPED and state.replica(1).kv_tokens is None
    with pytest.raises(AssertionError):  # the phase goes through set_phase only
        state.update(state=_P.RUNNING)


def test_a_write_of_a_plain_string_or_dict_is_refused_before_anything_changes(tmp_path):
    """States are enums and records are records: "healthy" or a dict is a bug where it is
    written, not a run.json that cannot be saved (or read back) later."""
    state = RunState.create(two_replica_plan(tmp_path))
    before, record = _text(state), state.record
    with pytest.raises(TypeError, match="state must be ReplicaState, got 'starting'"):
        state.update_replica(0, state="starting")
    with pytest.raises(TypeError, match="state must be RunPhase, got 'running'"):
        state.set_phase("running")
    with pytest.raises(TypeError, match="router must be RouterRecord or None"):
        state.update(router={"pid": 1, "create_time": 2.0, "url": "http://x"})
    with pytest.raises(TypeError, match="processes must be DeclaredProcess"):
        state.update_replica(0, processes=({"pid": 1, "role": "main", "device": "cpu"},))
    with pytest.raises(TypeError, match="'created_at' is not a field that changes"):
        state.update(created_at=1.0)
    assert _text(state) == before and state.record == record


# --- malformed run.json: a RunFileError naming the file --------------------------------------


def _delete(*path):
    def edit(data):
        for key in path[:-1]:
            data = data[key]
        del data[path[-1]]
    return edit


def _set(value, *path):
    def edit(data):
        for key in path[:-1]:
            data = data[key]
        data[path[-1]] = value
    return edit


@pytest.mark.parametrize(("edit", "why"), [
    (_delete("replicas"), "the top level has no 'replicas'"),
    (_delete("replicas", 1, "port"), "replicas[1] has no 'port'"),
    (_delete("plan", "router"), "plan has no 'router'"),
    (_delete("plan", "supervision", "drain_timeout"), "plan.supervision has no 'drain_timeout'"),
    (_set("8000", "replicas", 0, "port"), "replicas[0].port is a string, not an integer"),
    (_set(True, "replicas", 0, "port"), "replicas[0].port is a boolean, not an integer"),
    (_set("yesterday", "created_at"), "created_at is a string, not a number"),
    (_set({"pid": "1", "create_time": 2.0}, "launcher"), "launcher.pid is a string"),
    (_set("sleeping", "state"), "state is 'sleeping', not one of starting, running"),
    (_set("fine", "replicas", 0, "state"), "replicas[0].state is 'fine', not one of planned"),
    (_set({"0": "x"}, "replicas"), "replicas is an object, not a list"),
    (_set([1, "a"], "replicas", 0, "argv"), "replicas[0].argv[0] is an integer, not a string"),
    (_set({"A": 1}, "replicas", 0, "env"), "a value of replicas[0].env is an integer, not a "
                                           "string"),
    (_set([{"pid": 1, "role": "main"}], "replicas", 0, "processes"),
     "replicas[0].processes[0] has no 'device'"),
    # schema 1's one daemon is read as slot 0's of schema 2
    (_set({"daemon": {"pid": 1}}, "mps"), "mps.daemons[0] has no 'create_time'"),
    (_set({"daemons": [{"pid": 1}]}, "mps"), "mps.daemons[0] has no 'create_time'"),
    (_set([], "router"), "router is a list, not an object"),
    (_set("5", "plan", "supervision", "health_failures"),
     "plan.supervision.health_failures is a string, not an integer"),
    (_set({"leader": 0}, "share"), "share has no 'followers'"),
    (_set("1GiB", "replicas", 1, "memory_bytes"),
     "replicas[1].memory_bytes is a string, not an integer"),
])
def test_a_malformed_run_json_is_a_run_file_error_naming_the_file_and_field(tmp_path, edit,
                                                                           why):
    state = RunState.create(two_replica_plan(tmp_path))
    data = json.loads(_text(state))
    edit(data)
    (state.directory / "run.json").write_text(json.dumps(data))
    with pytest.raises(RunFileError) as caught:
        read_run(state.directory)
    assert str(caught.value).startswith(f"{state.directory / 'run.json'} is malformed: ")
    assert why in str(caught.value)
    with pytest.raises(RunFileError):
        RunState.load(state.directory)
    [stored] = stored_runs(tmp_path / "state")
    assert stored.record is None and stored.live is False and why in stored.error


@pytest.mark.parametrize(("content", "why"), [
    (json.dumps({"schema": 99}), "has schema 99; this omni-dp reads schemas 1, 2"),
    (json.dumps({"run_id": "x"}), "has schema None; this omni-dp reads schemas 1, 2"),
    (json.dumps([1, 2]), "has schema None"),
    ("{not json", "is not JSON"),
    ("", "is not JSON"),
])
def test_a_run_json_of_another_schema_or_not_json_names_the_file(tmp_path, content, why):
    state = RunState.create(two_replica_plan(tmp_path))
    (state.directory / "run.json").write_text(content)
    with pytest.raises(RunFileError, match=r"schema|JSON") as caught:
        read_run(state.directory)
    assert str(state.directory / "run.json") in str(caught.value) and why in str(caught.value)


def test_a_run_directory_without_its_token_or_run_json_says_which_is_missing(tmp_path):
    state = RunState.create(two_replica_plan(tmp_path))
    (state.directory / "run_token").unlink()
    with pytest.raises(RunFileError, match=r"run_token is missing: is .* a run directory"):
        read_run(state.directory)
    (state.directory / "run.json").unlink()
    with pytest.raises(RunFileError, match=r"run\.json is missing"):
        read_run(state.directory)


# --- "live": any recorded process alive as itself (pid + create time) ------------------------


def test_a_run_whose_only_live_process_is_its_router_is_live(tmp_path, sleeper,
                                                              dead_identity):
    state = RunState.create(two_replica_plan(tmp_path))
    state.update(launcher=None)  # this test process: it would make any run live
    assert not run_is_live(state.record)  # nothing started yet
    router = identify(sleeper.pid)
    state.update(router=RouterRecord(router, router.pid, state.plan.router.url,
                                     state.plan.router.argv, "router.log"),
                 supervisor=SupervisorRecord(dead_identity, detached=True))
    for i in (0, 1):
        state.update_replica(i, identity=dead_identity, state=_R.STARTING)
    assert run_is_live(state.record)
    [stored] = stored_runs(tmp_path / "state")
    assert stored.live and stored.run_id == state.run_id and stored.token == state.token


def test_a_run_whose_recorded_processes_are_dead_or_recycled_is_not_live(tmp_path,
                                                                         dead_identity):
    me = identify(os.getpid())
    recycled = ProcessIdentity(me.pid, me.create_time + 1.0)  # our pid, another process's time
    state = RunState.create(two_replica_plan(tmp_path))
    assert run_is_live(state.record)  # the launcher (this process) runs
    state.update(launcher=recycled,
                 router=RouterRecord(dead_identity, dead_identity.pid, state.plan.router.url,
                                     state.plan.router.argv, "router.log"),
                 supervisor=SupervisorRecord(recycled, detached=True))
    state.set_daemon(DaemonRecord(dead_identity, "b", "p", "l", None))
    state.update_replica(0, identity=recycled, state=_R.STARTING)
    state.update_replica(1, identity=dead_identity, state=_R.STARTING)
    assert not run_is_live(state.record)
    [stored] = stored_runs(tmp_path / "state")
    assert stored.record is not None and not stored.live


# --- finding and picking runs ------------------------------------------------------------------


def test_find_run_dir_refuses_malformed_and_unknown_ids(tmp_path):
    state = RunState.create(two_replica_plan(tmp_path))
    root = tmp_path / "state"
    assert find_run_dir(state.run_id, root) == state.directory
    with pytest.raises(RunFileError, match=r"'\.\./etc' is not a run id"):
        find_run_dir("../etc", root)
    with pytest.raises(RunFileError, match=r"no run 'other' under .*runs \(runs: run-test\)"):
        find_run_dir("other", root)


def test_pick_run_names_the_runs_when_there_are_none_or_several(tmp_path):
    runs = [StoredRun(tmp_path / name, None, None) for name in ("run-a", "run-b")]
    assert pick_run(runs[:1], what="run", example="omni-dp status") is runs[0]
    with pytest.raises(RunFileError, match=r"^no live run with an MPS daemon$"):
        pick_run([], what="live run with an MPS daemon", example="x")
    with pytest.raises(RunFileError, match=r"^nothing here$"):
        pick_run([], what="run", none="nothing here", example="x")
    with pytest.raises(RunFileError) as caught:
        pick_run(runs, what="live run with an MPS daemon", plural="live runs",
                 example="omni-dp verify-mps")
    assert str(caught.value) == ("2 live runs (run-a, run-b): name one, e.g. omni-dp verify-mps "
                                 "run-a")
    with pytest.raises(RunFileError, match=r"^2 runs \(run-a, run-b\)"):
        pick_run(runs, what="run", example="omni-dp status")


def test_stored_runs_of_a_missing_state_dir_is_empty(tmp_path):
    assert stored_runs(tmp_path / "nothing") == []
