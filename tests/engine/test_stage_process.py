"""One stage process on its own, with this test as its front: it says Ready, serves, and on a
message it cannot read says StageFailed and exits 3 (the front turns that into an unhealthy
replica); on Stop it exits 0. Real process, real sockets."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import zmq

from omni_dp.engine import messages
from omni_dp.engine.links import Inbox, Outbox, endpoint, socket_dir
from omni_dp.engine.stage_launch import StageLaunch

pytestmark = pytest.mark.slow


@pytest.fixture
def stage():
    directory = socket_dir()
    front = Inbox(endpoint(directory, "main"))
    spec = StageLaunch(
        process="vocoder", stages=("vocoder",), device="cpu", dtype="float64", threads=1,
        model="tiny", weight_seed=0, page_size=16, num_pages=8, max_running_requests=4,
        max_input_chars=100, inbox=endpoint(directory, "vocoder"),
        front=endpoint(directory, "main"), vocoders=(), log_level="info", log_format="text")
    child = subprocess.Popen([sys.executable, "-m", "omni_dp.engine.stage_process",
                              spec.argv_word(), str(os.getpid())],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        ready = front.recv(60)
        assert ready == messages.Ready("vocoder", child.pid), child.poll()
        yield spec, front, child
    finally:
        if child.poll() is None:
            child.kill()
        child.communicate(10)
        front.close()
        shutil.rmtree(directory, ignore_errors=True)


def test_a_message_it_cannot_read_is_stage_failed_and_exit_3(stage):
    spec, front, child = stage
    context = zmq.Context.instance()
    sock = context.socket(zmq.PUSH)
    sock.connect(spec.inbox)
    sock.send_multipart([b"\xc1 not msgpack"])  # what no other process of ours sends
    try:
        failed = front.recv(30)
        assert isinstance(failed, messages.StageFailed) and failed.process == "vocoder"
        assert "serving failed" in failed.reason
        assert child.wait(30) == 3
    finally:
        sock.close(linger=0)


def test_stop_ends_it_with_exit_0(stage):
    spec, _, child = stage
    outbox = Outbox()
    try:
        outbox.send(spec.inbox, messages.Stop())
        assert child.wait(30) == 0
    finally:
        outbox.close_all()


def test_a_failure_reason_with_undecodable_bytes_still_reaches_the_front(tmp_path):
    """A reason quoting a path read from disk may hold lone surrogates: escaped, it is sent
    (unescaped, encoding it raised before any socket existed, and the process never exited)."""
    from omni_dp.engine.stage_process import sendable, tell_front
    from omni_dp.engine.wire import WireError

    reason = "cannot read /models/caf\udce9/config.json"
    directory = socket_dir()
    front = Inbox(endpoint(directory, "main"))
    try:
        with pytest.raises(WireError):
            tell_front(front.endpoint, messages.StageFailed("v", reason))
        tell_front(front.endpoint, messages.StageFailed("v", sendable(reason)))
        assert front.recv(10) == messages.StageFailed("v", "cannot read /models/caf\\udce9/"
                                                           "config.json")
    finally:
        front.close()
        shutil.rmtree(directory, ignore_errors=True)


def test_a_group_stopped_before_it_spawned_stops_cleanly():
    """A front whose start-up failed (or was signalled) before its stage processes started
    still stops its group: no error, its inbox closed and its socket directory gone."""
    import torch

    from omni_dp.engine.options import ServeOptions
    from omni_dp.engine.placement_plan import plan_placement
    from omni_dp.engine.stage_group import StageGroup

    problems: list[str] = []
    placement = plan_placement(ServeOptions(placement_overrides=(("vocoder.process", "v"),)),
                               torch.device("cpu"), problems)
    assert placement is not None, problems
    group = StageGroup(placement, {"threads": 1}, on_message=print, on_fatal=print,
                       log_level="info", log_format="text")
    assert group.directory.exists()
    group.stop()
    assert not group.directory.exists()


def test_the_socket_directories_of_dead_fronts_are_swept_and_no_other(tmp_path):
    from omni_dp.engine.stage_group import OWNER_FILE, SOCKET_DIR_PREFIX, sweep_stale_socket_dirs
    from omni_dp.procs import identify

    gone = subprocess.Popen(["true"])
    gone.wait()  # reaped: its pid names no process now
    dead, live, unowned, other = (tmp_path / f"{SOCKET_DIR_PREFIX}{n}" for n in "abcd")
    for path in (dead, live, unowned):
        path.mkdir(mode=0o700)
    (dead / OWNER_FILE).write_text(json.dumps({"pid": gone.pid, "create_time": 1.0}))
    (live / OWNER_FILE).write_text(json.dumps(identify(os.getpid()).to_json()))
    other.write_text("a file, not a directory of ours")
    assert sweep_stale_socket_dirs(tmp_path) == [dead]
    assert not dead.exists() and live.exists() and unowned.exists() and other.exists()
