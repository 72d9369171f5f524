"""End to end: `omni-dp launch --share-weights` with three real CPU replicas of the tiny preset
behind a real router — the share proven in run.json and status, a SIGKILLed follower restarted
alone while requests keep being served, a SIGKILLed leader restarted with its whole group
(leader first, the share published again), and `down` leaving no process, no share directory,
no run directory.

One run, every wait bounded; the `runs` fixture (tests/launcher/conftest.py) always downs it and
SIGKILLs by pid whatever of it survived.
"""

from __future__ import annotations

import os
import stat
import threading
import time

import psutil
import pytest

from support.http_client import is_wav, post_json, speech
from support.launcher import SUPERVISION, Run, describe, kill_replica, token_pids
from support.wait import wait_for

pytestmark = pytest.mark.slow

GROUP_RESTART_TIMEOUT_S = 90.0
LOAD_REQUESTS = 20  # at most, sent one after another while a killed follower comes back


def pids(run: Run) -> list[int]:
    return [r["pid"] for r in run.run_json()["replicas"]]


def all_back(run: Run, old: list[int], changed: set[int]):
    """The status once the replicas in `changed` run as new processes, every replica healthy
    and the share published by the leader now running; None before."""
    status = run.status()
    replicas = status["replicas"]
    new = [r["pid"] for r in replicas]
    ok = (all(r["health"] == "healthy" and r["state"] == "healthy" for r in replicas)
          and {i for i in range(len(old)) if new[i] != old[i]} == changed
          and status["share"] and status["share"]["published"]
          and status["share"]["leader_pid"] == new[0])
    return status if ok else None


def restarts_since(run: Run, since: float) -> list[dict]:
    return [e for e in run.events() if e["event"] == "restart_started" and e["ts"] >= since]


def test_a_sharing_run_restarts_a_follower_alone_and_a_dead_leader_with_its_group(runs):
    run = runs(3)
    began = time.monotonic()
    run.launch("--share-weights", "--gpu", "none", "--cpu-blocks", "none", *SUPERVISION)
    bring_up = time.monotonic() - began

    # The proof: who shares, the bytes shared once, each replica's measured private memory.
    status = run.status()
    share = status["share"]
    assert share["published"] and (share["leader"], share["followers"]) == (0, [1, 2])
    assert share["shared_bytes"] > 1_000_000 and share["tensors"] > 0 and share["policy"]
    assert share["directory"] == str(run.run_dir / "share")
    assert [r["share_role"] for r in status["replicas"]] == ["leader", "follower", "follower"]
    assert all(isinstance(r["memory_bytes"], int) and r["memory_bytes"] > 0
               for r in status["replicas"])
    data = run.run_json()
    assert data["plan"]["share_weights"] is True and data["share"]["leader_pid"] == pids(run)[0]
    assert stat.S_IMODE(os.stat(run.run_dir / "share").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(run.run_dir / "share" / "weights.json").st_mode) == 0o600
    text = run.cli("status", run.run_id)
    assert "replica 0 leads, replica(s) 1, 2 follow" in text.stdout, describe(text)

    # A follower killed under load: restarted alone; the leader and the other follower
    # untouched, and every request meanwhile served (the router routes around the dead one).
    before = pids(run)
    killed_at, started = time.time(), time.monotonic()
    kill_replica(run, 2)
    served: list[tuple[int, bool]] = []
    is_back = threading.Event()

    def load() -> None:  # short requests, one after another, until the follower is back
        while not is_back.is_set() and len(served) < LOAD_REQUESTS:
            code, _, body = post_json(run.router_url + "/v1/audio/speech",
                                      {"input": "Load.", "max_new_tokens": 8}, timeout=30)
            served.append((code, is_wav(body)))

    loader = threading.Thread(target=load, name="load", daemon=True)
    loader.start()
    try:
        wait_for("follower 2 back", lambda: all_back(run, before, {2}), timeout=60,
                 interval=0.3)
    finally:
        is_back.set()
        loader.join(35)
    follower_restart = time.monotonic() - started
    assert len(served) >= 3 and served == [(200, True)] * len(served), served
    [restart] = restarts_since(run, killed_at)
    assert restart["replica"] == 2 and "group" not in restart
    assert pids(run)[:2] == before[:2]
    assert any(e["event"] == "router_enabled" and e["replica"] == 2 and e["ts"] >= killed_at
               for e in run.events())

    # The leader killed: its followers lose its weights (and exit 4); the group is restarted
    # once, leader first, and the new leader publishes the share again.
    before = pids(run)
    killed_at, started = time.time(), time.monotonic()
    kill_replica(run, 0)
    status = wait_for("the group back", lambda: all_back(run, before, {0, 1, 2}),
                      timeout=GROUP_RESTART_TIMEOUT_S, interval=0.3)
    group_restart = time.monotonic() - started
    [restart] = restarts_since(run, killed_at)
    assert (restart["replica"], restart["group"]) == (0, [0, 1, 2])
    events = [e for e in run.events() if e["ts"] >= killed_at]
    published = [e for e in events if e["event"] == "share_published"]
    attached = [e["replica"] for e in events if e["event"] == "share_attached"]
    assert len(published) == 1 and published[0]["pid"] == status["replicas"][0]["pid"]
    assert sorted(attached) == [1, 2]
    started_at = {e["replica"]: e["ts"] for e in events if e["event"] == "replica_started"}
    assert started_at[0] < published[0]["ts"] < min(started_at[1], started_at[2])
    # only the replica that failed is charged: the leader once, follower 2 for its own death
    assert [r["restarts"] for r in status["replicas"]] == [1, 0, 1]
    assert status["share"]["followers"] == [1, 2]  # both proven attached to the new leader
    code, _, body = speech(run.router_url)
    assert code == 200 and is_wav(body), body[:300]
    print(f"\nbring-up {bring_up:.1f} s, follower restart {follower_restart:.1f} s "
          f"({len(served)} requests served meanwhile), leader group restart "
          f"{group_restart:.1f} s")

    token = run.token
    down = run.down()
    assert down.returncode == 0, describe(down)
    assert token and token_pids(token) == []
    left = run.leftover_pids()
    assert left == [], [(p, psutil.Process(p).cmdline()) for p in left]
    assert not (run.run_dir / "share").exists() and not run.run_dir.exists()
