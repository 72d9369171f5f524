"""The launched run as the soak (bench/soak.py) sees it: its record (run.json, as `omni-dp status
--json` reads it), its processes, whether it is whole — the shape it was launched with — and
its resources. Reads only; the nemesis (soak_nemesis.py) is what acts.

Whole means, all at once: run.json names a live supervisor that is supervising, a live router
and exactly the shape's replicas, each `healthy` and alive; the router is ready and its replica
table (GET /workers) is the shape's, every one routable and enabled; its /metrics holds no
series of a replica outside the shape; the run directory holds the run's files and nothing
else (an external engine's TMPDIR in it no more entries than when first seen); and no
stage-socket directory of a dead replica is left in the run's TMPDIR.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import psutil

from omni_dp.procs import ProcessIdentity, is_alive

# Files a run directory may hold beyond run.json, run_token, events.jsonl and logs/: the last
# day-two change's outcome; an external engine's working directories (engines/replica_<i>/:
# its TMPDIR and caches); the log of a replica a scale-down removed (history, one per index).
ALLOWED = ("change.json", "engines")
STAGE_DIR_PREFIX = "omni-dp-stages-"  # engine/stage_group.py's socket directories
LABEL = re.compile(r'replica="([^"]*)"')


@dataclass
class Sample:
    t: float
    role: str  # router | supervisor | replica N
    pids: tuple[int, ...]
    rss: int
    fds: int
    threads: int


def identity(entry: dict | None) -> ProcessIdentity | None:
    if not entry or entry.get("pid") is None:
        return None
    return ProcessIdentity(entry["pid"], entry.get("create_time") or 0.0)


def alive(entry: dict | None) -> bool:
    ident = identity(entry)
    return ident is not None and is_alive(ident)


class RunView:
    def __init__(self, directory: Path, tmp: Path, url: str, headers: dict) -> None:
        self.directory = directory
        self.tmp = tmp
        self.url = url
        self.headers = headers
        self.engine_tmp: dict[str, int] = {}  # entries of each engines/*/tmp when first seen

    def record(self) -> dict:
        """run.json as it is now (written atomically by its one writer)."""
        for _ in range(5):
            try:
                return json.loads((self.directory / "run.json").read_text())
            except (OSError, ValueError):
                time.sleep(0.05)
        return {}

    # --- processes ----------------------------------------------------------------------
    def replica_pids(self) -> dict[int, int]:
        return {r["index"]: r["pid"] for r in self.record().get("replicas", []) if alive(r)}

    def stage_pids(self, index: int) -> list[int]:
        """The replica's processes other than its main one (its stage processes, or an
        external engine's EngineCore and workers)."""
        record = next((r for r in self.record().get("replicas", []) if r["index"] == index), None)
        if record is None or not alive(record):
            return []
        listed = [p["pid"] for p in record.get("processes") or [] if p.get("role") != "main"]
        if listed:
            return listed
        try:
            return [c.pid for c in psutil.Process(record["pid"]).children(recursive=True)]
        except psutil.Error:
            return []

    def roles(self) -> dict[str, list[int]]:
        """Each role's live processes: the supervisor; the router with its workers; each
        replica with every process under it."""
        record = self.record()
        tops = {"supervisor": record.get("supervisor"), "router": record.get("router")}
        tops.update((f"replica {r['index']}", r) for r in record.get("replicas", []))
        found = {}
        for role, entry in tops.items():
            if not alive(entry):
                continue
            try:
                top = psutil.Process(entry["pid"])
                kids = [] if role == "supervisor" else top.children(recursive=True)
                found[role] = [top.pid, *(k.pid for k in kids)]
            except psutil.Error:
                continue
        return found

    def sample(self, t: float) -> list[Sample]:
        samples = []
        for role, pids in self.roles().items():
            rss = fds = threads = 0
            for pid in pids:
                try:
                    proc = psutil.Process(pid)
                    with proc.oneshot():
                        rss += proc.memory_info().rss
                        fds += proc.num_fds()
                        threads += proc.num_threads()
                except psutil.Error:
                    continue
            samples.append(Sample(round(t, 2), role, tuple(pids), rss, fds, threads))
        return samples

    # --- whole ----------------------------------------------------------------------------
    async def problems(self, session: aiohttp.ClientSession, shape: set[str]) -> list[str]:
        """What keeps the run from being whole in `shape` (replica ids); [] when whole."""
        found = self.record_problems(shape)
        try:
            found += await self.router_problems(session, shape)
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
            found.append(f"router: {type(exc).__name__} {exc}"[:200])
        found += self.file_problems(shape)
        return found

    def record_problems(self, shape: set[str]) -> list[str]:
        record, found = self.record(), []
        supervisor = record.get("supervisor")
        if not alive(supervisor):
            found.append("no live supervisor")
        elif not supervisor.get("supervising_since"):
            found.append("the supervisor is not supervising yet")
        if not alive(record.get("router")):
            found.append("no live router")
        replicas = {str(r["index"]): r for r in record.get("replicas", [])}
        if set(replicas) != shape:
            found.append(f"run.json replicas {sorted(replicas)}, not {sorted(shape)}")
        for rid, r in sorted(replicas.items()):
            if r.get("state") != "healthy" or not alive(r):
                found.append(f"replica {rid} {r.get('state')}"
                             + ("" if alive(r) else ", its process gone"))
        return found

    async def router_problems(self, session: aiohttp.ClientSession, shape: set[str]) -> list[str]:
        timeout = aiohttp.ClientTimeout(total=5)
        async with session.get(self.url + "/workers", headers=self.headers,
                               timeout=timeout) as resp:
            table = await resp.json()
        found = []
        listed = {w["id"]: w for w in table["workers"]}
        if set(listed) != shape:
            found.append(f"router's table {sorted(listed)}, not {sorted(shape)}")
        found += [f"router: replica {rid} " + ("disabled" if w["disabled"] else "not routable")
                  for rid, w in sorted(listed.items()) if not w["routable"]]
        if not table.get("ready"):
            found.append("router not ready")
        async with session.get(self.url + "/metrics", timeout=timeout) as resp:
            text = await resp.text()
        labelled = {m for line in text.splitlines() if not line.startswith("#")
                    for m in LABEL.findall(line)}
        if labelled - shape:
            found.append(f"router /metrics has series of replica(s) {sorted(labelled - shape)}")
        return found

    def file_problems(self, shape: set[str]) -> list[str]:
        found = []
        want = {"run.json", "run_token", "events.jsonl", "logs"}
        try:
            have = {p.name for p in self.directory.iterdir()}
            logs = {p.name for p in (self.directory / "logs").iterdir()}
        except OSError as exc:
            return [f"run directory: {exc}"]
        if want - have:
            found.append(f"run directory lacks {sorted(want - have)}")
        if have - want - set(ALLOWED):
            found.append(f"run directory holds {sorted(have - want - set(ALLOWED))}")
        needed = {"router.log", "supervisor.log", *(f"replica_{i}.log" for i in shape)}
        extra = {n for n in logs - needed if not re.fullmatch(r"replica_\d+\.log", n)}
        if needed - logs or extra:
            found.append(f"logs/: lacks {sorted(needed - logs)}, holds {sorted(extra)}")
        for tmp in sorted(self.directory.glob("engines/replica_*/tmp")):
            with contextlib.suppress(OSError):
                count = len(list(tmp.iterdir()))
                first = self.engine_tmp.setdefault(tmp.parent.name, count)
                if count > first:
                    found.append(f"engines/{tmp.parent.name}/tmp holds {count} entries, "
                                 f"{first} when first seen (an earlier process's?)")
        for stage_dir in self.tmp.glob(STAGE_DIR_PREFIX + "*"):
            try:
                owner = json.loads((stage_dir / "owner.json").read_text())
            except (OSError, ValueError):
                continue  # being made or removed
            if not is_alive(ProcessIdentity(owner["pid"], owner["create_time"])):
                found.append(f"stage sockets of a dead replica left: {stage_dir.name}")
        return found


def supervising(directory: Path, pid: int) -> bool:
    record = json.loads((directory / "run.json").read_text())
    supervisor = record.get("supervisor") or {}
    return supervisor.get("pid") == pid and bool(supervisor.get("supervising_since"))


def ports_taken(ports: list[int]) -> list[int]:
    """The ports something still listens on or holds bound (a closed connection's TIME_WAIT
    does not count: SO_REUSEADDR, as a server binding it would)."""
    import socket

    taken = []
    for port in ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                taken.append(port)
    return taken


def files_left(directory: Path, ignore: tuple[str, ...]) -> list[str]:
    """What is under `directory`, but names in `ignore` (libraries' own files)."""
    if not directory.is_dir():
        return []
    return sorted(str(p.relative_to(directory)) for p in directory.iterdir()
                  if not any(p.name.startswith(name) for name in ignore))


__all__ = ["RunView", "Sample", "files_left", "ports_taken", "supervising"]
