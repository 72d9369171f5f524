"""`omni-dp status` and `omni-dp list`: a run's state as recorded, re-checked live.

The JSON shape is the contract in docs/contracts.md; fields may be added, none renamed.
"""

from __future__ import annotations

from omni_dp import runfile
from omni_dp.blocking_http import http_json
from omni_dp.launcher.planning.facts import invoked_as
from omni_dp.launcher.planning.share_group import LEADER, attachment_basis, followers, share_role
from omni_dp.launcher.record.state import RunState
from omni_dp.mps.daemon import DaemonRecord
from omni_dp.procs import is_alive
from omni_dp.rundir import runs_dir, state_dir
from omni_dp.runfile import (
    GpuRecord,
    ReplicaRecord,
    ReplicaState,
    RunPhase,
    RunRecord,
    find_run_dir,
    stored_runs,
)
from omni_dp.sizes import format_size
from omni_dp.tables import Grid, markdown


def pick(run_id: str | None, command: str) -> RunState:
    """The named run, or the only live one (the only readable one at all, if none is live);
    RunNotFound, or another RunFileError saying what exists."""
    if run_id is not None:
        return RunState.load(find_run_dir(run_id))
    readable = [run for run in stored_runs() if run.record is not None]
    live = [run for run in readable if run.live]
    chosen = runfile.pick_run(live or readable, what="run",
                              none=f"no runs under {runs_dir(state_dir())}",
                              example=f"{invoked_as()} {command}")
    assert chosen.record is not None and chosen.token is not None
    return RunState(chosen.directory, chosen.record, chosen.token)


def scrape_runs(run_id: str | None) -> list[RunRecord]:
    """The runs `status --prometheus-sd` lists: the named one (RunNotFound if it is not
    there, another RunFileError if it cannot be read), else every live run on this host, in
    name order (none: an empty list, whose file tells Prometheus that nothing is left to
    scrape)."""
    if run_id is not None:
        return [RunState.load(find_run_dir(run_id)).record]
    return [run.record for run in stored_runs() if run.live and run.record is not None]


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
        # As before runs spanned GPUs: the first GPU's daemon; `attached` stays run-wide.
        "mps": _mps(record.daemons[0], record.replicas) if record.daemons else None,
        # what every replica process was capped at (null: uncapped); each daemon's `limits`
        # are what it read back
        "mps_caps": {"thread_percentage": record.plan.mps_thread_percentage,
                     "memory_limit_bytes": record.plan.mps_memory_limit},
        "gpus": [_gpu_row(record, g) for g in record.gpus],
        "share": _share(record),
        "replicas": [_replica_row(r, probe, share_role(record.plan.share_weights, r.index))
                     for r in record.replicas],
    }


def _mps(daemon: DaemonRecord, replicas: tuple[ReplicaRecord, ...]) -> dict:
    """A daemon as recorded, re-checked, and whether these replicas are proven its clients."""
    return {"daemon_pid": daemon.identity.pid, "daemon_alive": is_alive(daemon.identity),
            "attached": _attached(replicas), "limits": daemon.limits.to_json()}


def _gpu_row(record: RunRecord, gpu: GpuRecord) -> dict:
    """One GPU of the run: which replicas run on it, and its own daemon (null without one)."""
    daemon = record.daemon(gpu.slot)
    on_it = record.replicas_on(gpu.slot)
    return {"slot": gpu.slot, "index": gpu.index, "label": gpu.label, "name": gpu.name,
            "numa_node": gpu.numa_node, "replicas": [r.index for r in on_it],
            "mps": _mps(daemon, on_it) if daemon else None}


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
        return "unsupervised"  # its supervisor died: `supervise` takes it over, `down` cleans it
    return record.state.value


def _attached(replicas: tuple[ReplicaRecord, ...]) -> bool | None:
    """Every one of these replicas proven an MPS client; None until every one was checked."""
    flags = [r.mps_attached for r in replicas]
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
        "index": r.index, "gpu": r.gpu, "url": r.url, "pid": r.pid, "alive": alive,
        "port": r.port, "cpus": r.cpus, "state": r.state.value, "health": health,
        "kv_tokens": r.kv_tokens, "mps_attached": r.mps_attached,
        "share_role": role, "memory_bytes": r.memory_bytes,
        "restarts": len(r.restarts), "last_error": r.last_error,
    }


def format_status(s: dict, command: str = "omni-dp", fmt: str = "table") -> str:
    """The status as text (`table`: fixed-width, never wrapped) or `markdown`."""
    gpus = s.get("gpus") or []
    head = [f"run {s['run_id']}: {s['state']}   ({s['directory']})",
            f"  supervisor  pid {s['supervisor']['pid']} "
            f"{'alive' if s['supervisor']['alive'] else 'NOT running'}",
            f"  router      {s['router']['url']}  pid {s['router']['pid']}  "
            f"ready={s['router']['ready']}"]
    if s["mps"] and len(gpus) <= 1:
        head.append(f"  mps daemon  {_daemon_text(s['mps'])}")
    share = s.get("share")
    if share:
        head.append("  share       " + share_line(share, s["replicas"], s["gpu"]))
    tail = []
    if s["state"] == "abandoned":
        tail.append(f"nothing owns this run: its `launch` is gone and no supervisor took it "
                    f"over (killed during bring-up?); `{command} down {s['run_id']}` stops "
                    "what it started")
    elif s["state"] == "unsupervised":
        tail.append(f"its supervisor is gone: nothing restarts a replica that fails; "
                    f"`{command} supervise {s['run_id']}` supervises it again; "
                    f"`{command} down {s['run_id']}` stops it")
    if fmt == "markdown":
        return _markdown_status(s, head, tail)
    tables = [replica_table(s["replicas"])] if len(gpus) <= 1 else gpu_tables(gpus,
                                                                                s["replicas"])
    return "\n".join(head + tables + tail)


def _markdown_status(s: dict, head: list[str], tail: list[str]) -> str:
    """The heading lines as a list, the replicas as one table (with a GPU column over
    several GPUs), the notes after it."""
    gpus = s.get("gpus") or []
    bullets = [f"- {line.strip()}" for line in head[1:]]
    bullets += [f"- {gpu_heading(g).strip()}" for g in gpus] if len(gpus) > 1 else []
    several = len(gpus) > 1
    grid = Grid("", (("gpu",) if several else ()) + _TABLE_HEADER,
                [((str(r.get("gpu", 0)),) if several else ()) + _table_row(r)
                 for r in s["replicas"]])
    return "\n".join([f"**{head[0]}**", "", *bullets, "", markdown(grid),
                      *(["", *tail] if tail else [])])


def _daemon_text(mps: dict) -> str:
    limits = mps.get("limits") or {}
    caps = [f"{limits['thread_percentage']:g}% SMs"] if limits.get(
        "thread_percentage") is not None else []
    if limits.get("memory_limit_bytes") is not None:
        caps.append(f"{format_size(limits['memory_limit_bytes'])} pinned")
    return (f"pid {mps['daemon_pid']} {'alive' if mps['daemon_alive'] else 'NOT running'}  "
            f"attached={mps['attached']}"
            + (f"  caps per client: {', '.join(caps)}" if caps else ""))


def gpu_heading(gpu: dict) -> str:
    """`GPU 1 (NVIDIA H200)  GPU-…  NUMA node 1  mps daemon pid 42 alive  attached=True`."""
    record = GpuRecord(gpu["slot"], gpu["label"], gpu["index"], gpu.get("numa_node"),
                       gpu.get("name"))
    parts = [record.title] + ([gpu["label"]] if gpu["index"] is not None else [])
    if gpu.get("numa_node") is not None:
        parts.append(f"NUMA node {gpu['numa_node']}")
    if gpu.get("mps"):
        parts.append(f"mps daemon {_daemon_text(gpu['mps'])}")
    return "  " + "  ".join(parts)


def gpu_tables(gpus: list[dict], replicas: list[dict]) -> list[str]:
    """A run over several GPUs: each GPU's heading line, then the table of its replicas."""
    lines = []
    for gpu in gpus:
        rows = [r for r in replicas if r.get("gpu", 0) == gpu["slot"]]
        lines.append(gpu_heading(gpu))
        lines.append(replica_table(rows, indent="    ", aligned_with=replicas) if rows
                     else "    (no replica on this GPU)")
    return lines


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


_TABLE_HEADER = ("replica", "pid", "cpus", "port", "health", "kv_tokens", "mps", "share",
                 "memory", "restarts", "last_error")


def _table_row(r: dict) -> tuple[str, ...]:
    return (str(r["index"]), str(r["pid"]), r["cpus"] or "-", str(r["port"]), r["health"],
            str(r["kv_tokens"]), {None: "-", True: "attached", False: "NO"}[r["mps_attached"]],
            r.get("share_role") or "-",
            format_size(r["memory_bytes"]) if r.get("memory_bytes") is not None else "-",
            str(r["restarts"]), r["last_error"] or "")


def replica_table(replicas: list[dict], *, indent: str = "  ",
                  aligned_with: list[dict] | None = None) -> str:
    """The replicas' rows under one header; `aligned_with` (every replica of the run) sizes the
    columns, so that the tables of several GPUs line up."""
    rows = [_TABLE_HEADER] + [_table_row(r) for r in replicas]
    sizing = [_TABLE_HEADER] + [_table_row(r) for r in (aligned_with or replicas)]
    widths = [max(len(row[c]) for row in sizing + rows) for c in range(len(_TABLE_HEADER) - 1)]
    return "\n".join(indent + "  ".join(cell.ljust(w) for cell, w in zip(row, widths,
                                                                          strict=False))
                     + "  " + row[-1] for row in rows)
