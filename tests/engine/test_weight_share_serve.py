"""Shared weights across real `omni-dp serve` processes on the CPU: the same audio from a
leader, its follower and a replica of its own; what /get_server_info says; a follower stops
(exit 4) when its leader is killed, and refuses (exit 3) to start without a manifest; and what
sharing saves in memory (USS/PSS), measured."""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest

from omni_dp.procs import start_of
from omni_dp.sharefile import MANIFEST_FILE, read_manifest

from support.http_client import get, post_json
from support.wait import wait_for

SPEECH = "/v1/audio/speech"
CPU = ("--device", "cpu", "--max-total-tokens", "1280")  # room for one long request


def sharing(role: str, share_dir) -> tuple[str, ...]:
    return (*CPU, "--share-weights", role, "--share-dir", str(share_dir))


def test_leader_follower_and_own_replica_agree_and_the_follower_stops_with_its_leader(
        start_replica, tmp_path):
    share = tmp_path / "share"
    leader = start_replica(*sharing("leader", share), ready=False)
    plain = start_replica(*CPU, ready=False)  # starts alongside the leader
    leader.wait_ready()
    follower = start_replica(*sharing("follower", share))
    plain.wait_ready()

    body = {"input": "One copy of the weights.", "seed": 11, "response_format": "pcm",
            "stream": False, "max_new_tokens": 24}
    answers = [post_json(r.url + SPEECH, body) for r in (leader, follower, plain)]
    assert [status for status, _, _ in answers] == [200, 200, 200]
    audio = {pcm for _, _, pcm in answers}
    assert len(audio) == 1 and len(audio.pop()) > 0  # byte-identical, and not empty

    manifest = read_manifest(share)
    leader_identity = {"pid": leader.pid,
                       "create_time": start_of(leader.pid)}
    expected = {"share_dir": str(share), "policy": "omni-dp-tts/1",
                "shared_bytes": manifest.shared_bytes, "private_bytes": manifest.private_bytes,
                "tensors_shared": len(manifest.shared), "leader": leader_identity}
    assert leader.info()["weight_share"] == {"role": "leader", **expected}
    assert follower.info()["weight_share"] == {"role": "follower", **expected}
    assert plain.info()["weight_share"] is None
    assert "weight share: leader published" in leader.log_text()
    assert "weight share: follower mapped" in follower.log_text()

    held = {}
    # Seed 82 speaks all 1024 tokens of this input (no early end of audio): ~5 s on this
    # machine, so the request is still running when the follower stops. Should the weights
    # change, it may end early and this test fails with a 200, never passes wrongly.
    long_body = {"input": "Cut me off.", "seed": 82, "stream": False, "max_new_tokens": 1024}
    worker = threading.Thread(target=lambda: held.update(
        answer=post_json(follower.url + SPEECH, long_body)))
    worker.start()
    wait_for("a request running on the follower",
             lambda: follower.metric("omni_dp_requests_running") == 1, 30, 0.02)
    killed = time.monotonic()
    os.kill(leader.pid, signal.SIGKILL)
    assert follower.proc.wait(10) == 4
    stopped = time.monotonic() - killed
    print(f"leader kill -9 -> follower exit 4: {stopped * 1000:.0f} ms")
    # Seen at once (a pidfd), then a stop without a drain, cut short 0.5 s after the exit is
    # seen at the latest (measured: 35-170 ms; the pidfd itself: ~1 ms, test_weight_share).
    assert stopped < 1
    worker.join(30)
    status, _, answer = held["answer"]
    # Cut off, never a success: on the CPU the clean stop answers the request in flight with
    # a 503 saying why before the process exits.
    assert status == 503, (status, answer[:200])
    assert b"the leader of this replica's shared weights is gone; retry on another replica" \
        in answer
    assert (f"weight share: the leader (pid {leader.pid}) is gone; this follower stops "
            "serving") in follower.log_text()
    assert get(plain.url + "/health")[0] == 200  # a replica of its own is not affected


def test_a_follower_without_a_manifest_exits_3_saying_why(start_replica, tmp_path):
    share = tmp_path / "share"
    share.mkdir(mode=0o700)
    follower = start_replica(*sharing("follower", share), ready=False)
    assert follower.proc.wait(60) == 3
    assert (f"weight share: the weight-share manifest {share / MANIFEST_FILE} does not exist"
            in follower.log_text())


def _memory(pid: int) -> tuple[int, int]:
    info = psutil.Process(pid).memory_full_info()
    return info.uss, info.pss


@pytest.mark.slow
def test_followers_hold_almost_nothing_of_their_own(start_replica, tmp_path):
    """The `small` preset in float32 (292 MiB shared): a leader, two followers, and one
    replica with weights of its own for comparison, all up at once, each having computed.

    Per process, memory is its own pages (USS) plus its part of the pages it maps with others
    (PSS splits each among its mappers). A replica of its own holds the S shared bytes in its
    USS on top of its runtime (torch alone is some 170 MiB of USS, more than a quarter of S
    here, so no absolute bound on a follower's USS would hold); a follower holds the same
    runtime, KV pool and private tensors, but none of the S bytes. So:

    - a follower's USS exceeds (own USS − S) by less than 10 % of S: the part of the shared
      bytes it holds privately (measured: about 1 %);
    - summed over the group, PSS counts each page once: the segment once (S + the private
      bytes, split between its three mappers), each runtime once, the libraries as the
      replica of its own counts them (all map them at the same time). Three replicas of
      their own would be 3 × PSS_own; the group saves 2 S of that: ΣPSS < 3 × PSS_own − 2 S,
      plus 10 % of S for allocator noise.
    """
    share = tmp_path / "share"
    args = ("--model", "small", "--dtype", "float32")
    leader = start_replica(*sharing("leader", share), *args, ready=False)
    own = start_replica(*CPU, *args, ready=False)
    leader.wait_ready()
    followers = [start_replica(*sharing("follower", share), *args, ready=False)
                 for _ in range(2)]
    for replica in (own, *followers):
        replica.wait_ready()
    shared = read_manifest(share).shared_bytes
    body = {"input": "Touch every layer.", "seed": 3, "response_format": "pcm",
            "stream": False, "max_new_tokens": 4}
    for replica in (leader, *followers, own):
        assert post_json(replica.url + SPEECH, body)[0] == 200

    group = [_memory(r.pid) for r in (leader, *followers)]
    own_uss, own_pss = _memory(own.pid)
    mib = 2**20
    report = (f"shared {shared / mib:.0f} MiB; leader, followers USS "
              f"{[round(u / mib) for u, _ in group]} MiB, PSS "
              f"{[round(p / mib) for _, p in group]} MiB; own USS {own_uss / mib:.0f}, "
              f"PSS {own_pss / mib:.0f} MiB")
    print(report)
    for uss, _ in group[1:]:
        assert uss - (own_uss - shared) < 0.1 * shared, report
    assert sum(p for _, p in group) < 3 * own_pss - 2 * shared + 0.1 * shared, report
