"""`omni-dp status` and `omni-dp list`: a run's state as recorded, re-checked live.

The JSON shape is the contract in docs/contracts.md; fields may be added, none renamed.
"""

from __future__ import annotations

from omni_dp import runfile
from omni_dp.launcher.facts import invoked_as
from omni_dp.launcher.gates import http_json
from omni_dp.launcher.share_group import LEADER, attachment_basis, followers, share_role
from omni_dp.launcher.state import RunState
from omni_dp.procs import is_alive
from omni_dp.rundir import runs_dir, state_dir
from omni_dp.runfile import (
    ReplicaRecord,
    ReplicaState,
    RunFileError,
    RunPhase,
    RunRecord,
    find_run_dir,
    stored_runs,
)
from omni_dp.sizes import format_size


class NoSuchRun(RunFileError):
    """No run matches, or the one named cannot be read; the message lists what exists."""


def pick(run_id: str | None, command: str) -> RunState:
    """The named run, or the only live one (the only readable one at all, if none is live)."""
    try:
        if run_id is not None:
            return RunState.load(find_run_dir(run_id))
        readable = [run for run in stored_runs() if run.record is not None]
        live = [run for run in readable if run.live]
        chosen = runfile.pick_run(live or readable, what="run",
                                  none=f"no runs under {runs_dir(state_dir())}",
                                  example=f"{invoked_as()} {command}")
    except RunFileError as exc:
        raise NoSuchRun(str(exc)) from None
    assert chosen.record is not None and chosen.token is not None
    return RunState(chosen.directory, chosen.record, chosen.token)


def collect(state: RunState, *, probe: bool = True) -> dict:
    """`omni-dp status --json` of this run: its record, every recorded process re-checked."""
    record = state.record
    supervisor = record.supervisor
    supervisor_alive = supervisor is not None and is_alive(supervisor.identity)
    router = record.router
    router_ready = None
    if router and probe and is_alive(router.identity):
        router_ready = http_json("GET", router.url + "/ready", timeout=2.0)[0] == 200
    return {
        "run_id": state.run_id,
        "state": _shown_state(record, supervisor_alive),
        "directory": str(state.directory),
        "gpu": record.gpu,
        "supervisor": {"pid": supervisor.identity.pid if supervisor else None,
                       "alive": supervisor_alive,
                       "detached": supervisor.detached if supervisor else None},
        "router": {"pid": router.identity.pid if router else None,
                   "url": record.plan.router.url, "ready": router_ready},
        "mps": {"daemon_pid": record.mps.identity.pid,
                "daemon_alive": is_alive(record.mps.identity),
                "attached": _attached(record)} if record.mps else None,
        "share": _share(record),
        "replicas": [_replica_row(r, probe, share_role(record.plan.share_weights, r.index))
                     for r in record.replicas],
    }


def _share(record: RunRecord) -> dict | None:
    """--share-weights as proven (the leader's manifest, checked; `followers` those proven
    attached to it), or null without sharing; `published` false while the leader does not run
    as the publisher (starting, restarting, down, failed, stopped: `leader_state` says which),
    and then no follower is attached."""
    if not record.plan.share_weights:
        return None
    leader = record.replicas[LEADER]
    share = record.share
    # Re-checked like every recorded process: the record may predate a death no sweep saw yet
    # (or no supervisor will see).
    if share is None or leader.identity is None or leader.pid != share.leader_pid \
            or not is_alive(leader.identity):
        return {"published": False, "leader": LEADER, "leader_state": leader.state.value,
                "followers": []}
    alive = [i for i in share.followers
             if (f := record.replicas[i].identity) is not None and is_alive(f)]
    return {"published": True, **share.to_json(), "followers": alive}


def _shown_state(record: RunRecord, supervisor_alive: bool) -> str:
    """Derived here, never stored: what the recorded phase means given who still runs."""
    live = runfile.run_is_live(record)
    launcher_alive = record.launcher is not None and is_alive(record.launcher)
    if not live and record.state is not RunPhase.FAILED:
        return "stopped"
    if live and record.state is RunPhase.STARTING and not (supervisor_alive or launcher_alive):
        return "abandoned"  # its launch died during bring-up: no one will finish it
    if live and record.state in (RunPhase.RUNNING, RunPhase.DEGRADED) and not supervisor_alive:
        return "unsupervised"  # its supervisor died: `omni-dp down` still cleans it
    return record.state.value


def _attached(record: RunRecord) -> bool | None:
    """Every replica proven an MPS client; None until every one was checked."""
    flags = [r.mps_attached for r in record.replicas]
    return None if any(f is None for f in flags) else all(flags)


def _replica_row(r: ReplicaRecord, probe: bool, role: str | None) -> dict:
    alive = r.identity is not None and is_alive(r.identity)
    health = "down"
    if alive:
        health = "starting" if r.state is ReplicaState.STARTING else "unknown"
        if probe:
            status, _ = http_json("GET", r.url + "/health", timeout=2.0)
            health = "healthy" if status == 200 else f"unhealthy ({status or 'no answer'})"
    return {
        "index": r.index, "pid": r.pid, "alive": alive, "port": r.port,
        "cpus": r.cpus, "state": r.state.value, "health": health,
        "kv_tokens": r.kv_tokens, "mps_attached": r.mps_attached,
        "share_role": role, "memory_bytes": r.memory_bytes,
        "restarts": len(r.restarts), "last_error": r.last_error,
    }


def format_status(s: dict, command: str = "omni-dp") -> str:
    lines = [f"run {s['run_id']}: {s['state']}   ({s['directory']})",
             f"  supervisor  pid {s['supervisor']['pid']} "
             f"{'alive' if s['supervisor']['alive'] else 'NOT running'}",
             f"  router      {s['router']['url']}  pid {s['router']['pid']}  "
             f"ready={s['router']['ready']}"]
    if s["mps"]:
        lines.append(f"  mps daemon  pid {s['mps']['daemon_pid']} "
                     f"{'alive' if s['mps']['daemon_alive'] else 'NOT running'}  "
                     f"attached={s['mps']['attached']}")
    share = s.get("share")
    if share:
        lines.append("  share       " + share_line(share, s["replicas"], s["gpu"]))
    lines.append(replica_table(s["replicas"]))
    if s["state"] == "abandoned":
        lines.append(f"nothing owns this run: its `launch` is gone and no supervisor took it "
                     f"over (killed during bring-up?); `{command} down {s['run_id']}` stops "
                     "what it started")
    elif s["state"] == "unsupervised":
        lines.append(f"its supervisor is gone: nothing restarts a replica that fails; "
                     f"`{command} down {s['run_id']}` stops the run")
    return "\n".join(lines)


# What the leader is doing while its weights are not published, by its state
_NOT_PUBLISHING = {"planned": "starting", "starting": "starting", "restarting": "restarting",
                   "down": "down (the next sweep restarts it)",
                   "failed": "failed, out of its restart budget", "stopped": "stopped"}


def share_line(share: dict, replicas: list[dict], gpu: str = "cpu") -> str:
    """Who shares, from the proof: the followers proven attached, and the others not."""
    planned = followers(True, (r["index"] for r in replicas))
    attached = [i for i in planned if i in share["followers"]]
    others = [i for i in planned if i not in attached]
    if not share["published"]:
        state = share.get("leader_state")
        why = _NOT_PUBLISHING.get(state, state or "starting")
        leader_row = next((r for r in replicas if r["index"] == share["leader"]), None)
        if state in ("healthy", "unhealthy") and leader_row is not None \
                and not leader_row["alive"]:
            why = "gone, not yet seen by a sweep"
        return (f"replica {share['leader']} leads: not published (the leader is {why}); no "
                "follower attached")
    return (f"replica {share['leader']} leads, replica(s) "
            f"{', '.join(map(str, attached)) or 'none'} follow: "
            f"{format_size(share['shared_bytes'])} of weights held once "
            f"({share['tensors']} tensors, policy {share['policy']}; "
            f"{format_size(share['private_bytes'])} private per replica) in "
            f"{share['directory']}"
            + (f"; attachment {attachment_basis('cpu' if gpu == 'cpu' else 'cuda')}"
               if attached else "")
            + (f"; replica(s) {', '.join(map(str, others))} not attached" if others else ""))


def replica_table(replicas: list[dict]) -> str:
    header = ("replica", "pid", "cpus", "port", "health", "kv_tokens", "mps", "share",
              "memory", "restarts", "last_error")
    rows = [header] + [
        (str(r["index"]), str(r["pid"]), r["cpus"] or "-", str(r["port"]), r["health"],
         str(r["kv_tokens"]), {None: "-", True: "attached", False: "NO"}[r["mps_attached"]],
         r.get("share_role") or "-",
         format_size(r["memory_bytes"]) if r.get("memory_bytes") is not None else "-",
         str(r["restarts"]), r["last_error"] or "")
        for r in replicas
    ]
    widths = [max(len(row[c]) for row in rows) for c in range(len(header) - 1)]
    return "\n".join("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False))
                     + "  " + row[-1] for row in rows)
