"""`omni-dp status` and `omni-dp list`: a run's state as recorded, re-checked live.

The JSON shape is the contract in docs/contracts.md; fields may be added, none renamed.
"""

from __future__ import annotations

from pathlib import Path

from omni_dp.launcher.facts import any_recorded_alive, invoked_as
from omni_dp.launcher.gates import http_json
from omni_dp.launcher.state import RunState, StateError, identity_of
from omni_dp.procs import is_alive
from omni_dp.rundir import run_dir, runs_dir, state_dir


class NoSuchRun(Exception):
    """No run matches; the message lists what exists."""


def run_dirs(root: Path | None = None) -> list[Path]:
    runs = runs_dir(root or state_dir())
    return sorted(p for p in runs.iterdir() if p.is_dir()) if runs.is_dir() else []


def pick(run_id: str | None, command: str) -> RunState:
    """The named run, or the only live one (the only one at all, if none is live)."""
    from omni_dp.rundir import RUN_ID

    dirs = run_dirs()
    if run_id is not None:
        if not RUN_ID.match(run_id):
            raise NoSuchRun(f"{run_id!r} is not a run id")
        directory = run_dir(state_dir(), run_id)
        if not directory.is_dir():
            known = ", ".join(d.name for d in dirs) or "none"
            raise NoSuchRun(f"no run {run_id!r} under {state_dir() / 'runs'} (runs: {known})")
        return RunState.load(directory)
    states = []
    for directory in dirs:
        try:
            states.append(RunState.load(directory))
        except StateError:
            continue
    live = [s for s in states if run_is_live(s)]
    candidates = live or states
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        raise NoSuchRun(f"no runs under {state_dir() / 'runs'}")
    names = ", ".join(s.run_id for s in candidates)
    raise NoSuchRun(f"{len(candidates)} runs ({names}): name one, e.g. {invoked_as()} "
                    f"{command} {candidates[0].run_id}")


def run_is_live(state: RunState) -> bool:
    return any_recorded_alive(state.data)


def collect(state: RunState, *, probe: bool = True) -> dict:
    data = state.data
    supervisor = identity_of(data.get("supervisor"))
    router = data.get("router")
    router_identity = identity_of(router)
    router_ready = None
    if router and probe and router_identity and is_alive(router_identity):
        router_ready = http_json("GET", router["url"] + "/ready", timeout=2.0)[0] == 200
    mps = data.get("mps")
    replicas = []
    for r in state.replicas:
        identity = identity_of(r)
        alive = identity is not None and is_alive(identity)
        health = "down"
        if alive:
            health = "starting" if r["state"] == "starting" else "unknown"
            if probe:
                status, _ = http_json("GET", r["url"] + "/health", timeout=2.0)
                health = "healthy" if status == 200 else f"unhealthy ({status or 'no answer'})"
        replicas.append({
            "index": r["index"], "pid": r["pid"], "alive": alive, "port": r["port"],
            "cpus": r["cpus"], "state": r["state"], "health": health,
            "kv_tokens": r["kv_tokens"], "mps_attached": r["mps_attached"],
            "restarts": len(r["restarts"]), "last_error": r["last_error"],
        })
    live = run_is_live(state)
    run_state = data["state"]
    launcher = identity_of(data.get("launcher"))
    owned = any(p is not None and is_alive(p) for p in (supervisor, launcher))
    if not live and run_state != "failed":
        run_state = "stopped"
    elif live and run_state == "starting" and not owned:
        run_state = "abandoned"  # its launch died during bring-up: no one will finish it
    elif live and run_state in ("running", "degraded") and not (supervisor
                                                                 and is_alive(supervisor)):
        run_state = "unsupervised"  # its supervisor died: `omni-dp down` still cleans it
    attached = None
    if mps:
        flags = [r["mps_attached"] for r in replicas]
        attached = None if any(f is None for f in flags) else all(flags)
    return {
        "run_id": state.run_id,
        "state": run_state,
        "directory": str(state.directory),
        "gpu": data["gpu"],
        "supervisor": {"pid": supervisor.pid if supervisor else None,
                       "alive": bool(supervisor and is_alive(supervisor)),
                       "detached": (data.get("supervisor") or {}).get("detached")},
        "router": {"pid": router_identity.pid if router_identity else None,
                   "url": data["plan"]["router"]["url"], "ready": router_ready},
        "mps": {"daemon_pid": mps["daemon"]["pid"],
                "daemon_alive": is_alive(identity_of(mps["daemon"])),
                "attached": attached} if mps else None,
        "replicas": replicas,
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
    lines.append(replica_table(s["replicas"]))
    if s["state"] == "abandoned":
        lines.append(f"nothing owns this run: its `launch` is gone and no supervisor took it "
                     f"over (killed during bring-up?); `{command} down {s['run_id']}` stops "
                     "what it started")
    elif s["state"] == "unsupervised":
        lines.append(f"its supervisor is gone: nothing restarts a replica that fails; "
                     f"`{command} down {s['run_id']}` stops the run")
    return "\n".join(lines)


def replica_table(replicas: list[dict]) -> str:
    header = ("replica", "pid", "cpus", "port", "health", "kv_tokens", "mps", "restarts",
              "last_error")
    rows = [header] + [
        (str(r["index"]), str(r["pid"]), r["cpus"] or "-", str(r["port"]), r["health"],
         str(r["kv_tokens"]), {None: "-", True: "attached", False: "NO"}[r["mps_attached"]],
         str(r["restarts"]), r["last_error"] or "")
        for r in replicas
    ]
    widths = [max(len(row[c]) for row in rows) for c in range(len(header) - 1)]
    return "\n".join("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False))
                     + "  " + row[-1] for row in rows)
