"""`verify-mps --overlap` on a live run: a short concurrent speech load through its router,
then each replica's GPU busy intervals (GET /gpu_busy, omni_dp/engine/gpu_busy.py) and their
overlap, GPU by GPU (omni_dp/mps/overlap.py): overlap only means something within one GPU.

Refused before any load (CannotCheck, exit 2) where nothing could be measured: a run on the
CPU, an engine other than the built-in one (only it times its steps), a replica that does not
record, a router that needs a key we were not given. The load is bounded: CONCURRENCY streams
for DURATION seconds, then GRACE_S for the requests in flight, which are cancelled after it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace
from pathlib import Path

import aiohttp

from omni_dp.mps.overlap import CANNOT_CHECK, FAIL, PASS, OverlapReport, overlap_share
from omni_dp.mps.runs import CannotCheck, select_gpus
from omni_dp.rundir import runs_dir, state_dir
from omni_dp.runfile import (
    GpuRecord,
    ReplicaRecord,
    RunFileError,
    RunNotFound,
    RunRecord,
    StoredRun,
    find_run_dir,
    pick_run,
    stored_runs,
)

ON_CPU = "the replicas run on the CPU: there are no GPU kernels to overlap"
GRACE_S = 30.0  # after the load's end, for the requests in flight
FETCH_TIMEOUT_S = 10.0
RETRY_PAUSE_S = 0.05  # after a failed request, before that stream's next one
LOAD_TEXTS = (
    "Several replicas share one GPU, and each of them speaks at once.",
    "The quick brown fox jumps over the lazy dog, twice, to be sure.",
    "Overlap is measured, not assumed: every step is timed on the device.",
)


@dataclass(frozen=True)
class LoadResult:
    """What the load did: requests that streamed to the end, and those that did not."""

    ok: int
    failed: int
    first_error: str | None
    started: float  # Unix seconds
    ended: float

    def to_json(self) -> dict:
        return {"ok": self.ok, "failed": self.failed, "first_error": self.first_error,
                "started": self.started, "ended": self.ended}


@dataclass(frozen=True)
class GpuOverlap:
    gpu: GpuRecord
    replicas: tuple[int, ...]
    report: OverlapReport
    truncated: tuple[int, ...] = ()  # replicas whose recorder let intervals of the load go

    def to_json(self) -> dict:
        return {"gpu": self.gpu.slot, "index": self.gpu.index, "label": self.gpu.label,
                "name": self.gpu.name, "replicas": list(self.replicas),
                "truncated": list(self.truncated), **self.report.to_json()}


@dataclass(frozen=True)
class RunOverlap:
    """The run's verdict: FAIL if any GPU failed, else CANNOT_CHECK if any could not be
    checked, else PASS (verify-mps's rule for attachment too)."""

    run_id: str
    router: str
    concurrency: int
    duration: float
    load: LoadResult
    gpus: tuple[GpuOverlap, ...]

    @property
    def result(self) -> str:
        results = {g.report.result for g in self.gpus}
        return next((r for r in (FAIL, CANNOT_CHECK) if r in results), PASS)

    def to_json(self) -> dict:
        return {"run_id": self.run_id, "result": self.result, "router": self.router,
                "concurrency": self.concurrency, "duration_s": self.duration,
                "load": self.load.to_json(), "gpus": [g.to_json() for g in self.gpus]}


def pick_live_run(run_id: str | None, root: Path | None = None) -> StoredRun:
    """The named run, or the only live one (with or without MPS: a run without it is what
    the overlap is compared with); CannotCheck saying why there is none."""
    root = root or state_dir()
    try:
        if run_id is not None:
            return StoredRun.read(find_run_dir(run_id, root))
        return pick_run([run for run in stored_runs(root) if run.live], what="live run",
                        none=f"no live run under {runs_dir(root)}",
                        example="omni-dp verify-mps --overlap")
    except RunNotFound:
        raise  # nothing there: not a verdict of any kind (the command exits 1 on it)
    except RunFileError as exc:
        raise CannotCheck(str(exc)) from None


def overlap_targets(run: StoredRun, gpu: str | None
                    ) -> tuple[RunRecord, list[tuple[GpuRecord, tuple[ReplicaRecord, ...]]]]:
    """The run's GPUs to check and each one's replicas; CannotCheck where nothing can be."""
    record = run.record
    if record is None:
        raise CannotCheck(run.error or f"the state of run {run.run_id} cannot be read")
    if record.device == "cpu":
        raise CannotCheck(ON_CPU)
    if record.plan.engine != "builtin":
        raise CannotCheck(f"run {record.run_id} runs the {record.plan.engine} engine: only the "
                          "built-in engine times its GPU steps (GET /gpu_busy)")
    if not run.live:
        raise CannotCheck(f"run {record.run_id} is not live: nothing runs to put a load on")
    return record, [(g, record.replicas_on(g.slot)) for g in select_gpus(record, gpu)]


def router_of(record: RunRecord) -> str:
    return (record.router.url if record.router else record.plan.router.url).rstrip("/")


def check_overlap(run: StoredRun, *, gpu: str | None = None, duration: float = 5.0,
                  concurrency: int = 16, min_share: float | None = None,
                  api_key: str | None = None) -> RunOverlap:
    """Load the run, read its replicas' busy intervals, and judge each GPU's overlap."""
    record, targets = overlap_targets(run, gpu)
    if record.plan.api_key_set and not api_key:
        raise CannotCheck(f"the router of run {record.run_id} takes an API key: set "
                          "OMNI_DP_API_KEY to it")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return asyncio.run(_check(record, targets, headers, duration, concurrency, min_share))


async def _check(record: RunRecord, targets, headers: dict, duration: float,
                 concurrency: int, min_share: float | None) -> RunOverlap:
    replicas = [r for _, on_gpu in targets for r in on_gpu]
    router = router_of(record)
    async with aiohttp.ClientSession(trust_env=False) as session:
        for replica, answer in zip(replicas, await fetch_busy(session, replicas, time.time()),
                                   strict=True):
            if not answer.get("recording"):
                raise CannotCheck(f"replica {replica.index} does not time its GPU steps: "
                                  f"{answer.get('why') or 'it says no reason'}")
            if answer.get("not_timed"):  # a stage in a process of its own: not all is seen
                raise CannotCheck(f"replica {replica.index} times only its front process's "
                                  f"stages; not timed: {answer['not_timed']}")
        load = await drive_load(session, router, headers, concurrency, duration)
        if load.ok == 0:
            raise CannotCheck(f"no speech request through the router at {router} succeeded "
                              f"({load.failed} failed; the first: {load.first_error})")
        answers = dict(zip((r.index for r in replicas),
                           await fetch_busy(session, replicas, load.started), strict=True))
    gpus = []
    for gpu, on_gpu in targets:
        found = {str(r.index): intervals_of(r, answers[r.index]) for r in on_gpu}
        options = {} if min_share is None else {"min_share": min_share}
        report = overlap_share(found, window=(load.started, load.ended), **options)
        truncated = tuple(r.index for r in on_gpu if answers[r.index].get("truncated"))
        if truncated:  # their early busy time is gone: the share would read low, not judge
            report = replace(report, result=CANNOT_CHECK, reason=(
                f"replica(s) {', '.join(map(str, truncated))} kept fewer intervals than the "
                "load made (the recorder is bounded): run a shorter --duration"))
        gpus.append(GpuOverlap(gpu, tuple(r.index for r in on_gpu), report, truncated))
    return RunOverlap(record.run_id, router, concurrency, duration, load, tuple(gpus))


def intervals_of(replica: ReplicaRecord, answer: dict) -> list[tuple[float, float]]:
    try:
        return [(float(start), float(end)) for start, end in answer["intervals"]]
    except (KeyError, TypeError, ValueError):
        raise CannotCheck(f"replica {replica.index} answered GET /gpu_busy without a list of "
                          "[start, end] intervals") from None


async def fetch_busy(session: aiohttp.ClientSession, replicas: list[ReplicaRecord],
                     since: float) -> list[dict]:
    """Each replica's GET /gpu_busy?since=…, in order; CannotCheck naming one that fails."""
    async def one(replica: ReplicaRecord) -> dict:
        url = f"{replica.url.rstrip('/')}/gpu_busy"
        try:
            async with session.get(url, params={"since": repr(since)},
                                   timeout=aiohttp.ClientTimeout(total=FETCH_TIMEOUT_S)) as resp:
                if resp.status != 200:
                    raise CannotCheck(f"replica {replica.index} answered GET {url} with HTTP "
                                      f"{resp.status}: {(await resp.text())[:200]}")
                answer = await resp.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            raise CannotCheck(f"replica {replica.index}: GET {url} failed: "
                              f"{exc or type(exc).__name__}") from None
        if not isinstance(answer, dict):
            raise CannotCheck(f"replica {replica.index}: GET {url} is not a JSON object")
        return answer

    return list(await asyncio.gather(*(one(r) for r in replicas)))


async def drive_load(session: aiohttp.ClientSession, router: str, headers: dict,
                     concurrency: int, duration: float) -> LoadResult:
    """`concurrency` streams of streamed speech requests, each read to its end, for
    `duration` seconds; then GRACE_S for the requests in flight."""
    started = time.time()
    deadline = started + duration
    counts = {"ok": 0, "failed": 0}
    errors: list[str] = []

    async def stream(k: int) -> None:
        n = 0
        while time.time() < deadline:
            body = {"input": LOAD_TEXTS[(k + n) % len(LOAD_TEXTS)], "response_format": "pcm",
                    "stream": True, "seed": k * 100_003 + n}
            n += 1
            try:
                async with session.post(f"{router}/v1/audio/speech", json=body,
                                        headers=headers) as resp:
                    if resp.status != 200:
                        raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
                    async for _ in resp.content.iter_any():
                        pass
                counts["ok"] += 1
            except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError) as exc:
                counts["failed"] += 1
                errors.append(str(exc) or type(exc).__name__)
                await asyncio.sleep(RETRY_PAUSE_S)

    tasks = [asyncio.create_task(stream(k)) for k in range(concurrency)]
    _, late = await asyncio.wait(tasks, timeout=duration + GRACE_S)
    for task in late:
        task.cancel()
    await asyncio.gather(*late, return_exceptions=True)
    return LoadResult(counts["ok"], counts["failed"] + len(late), errors[0] if errors else None,
                      started, time.time())


def format_overlap(result: RunOverlap) -> str:
    """The text of `verify-mps --overlap`: the load, a block per GPU, one RESULT: line."""
    load = result.load
    lines = [f"run {result.run_id}: GPU busy overlap under {result.concurrency} concurrent "
             f"speech streams for {result.duration:g} s through {result.router} "
             f"({load.ok} requests ok, {load.failed} failed)"]
    for gpu in result.gpus:
        lines += _gpu_lines(gpu)
    lines.append(_result_line(result))
    return "\n".join(lines) + "\n"


def _gpu_lines(gpu: GpuOverlap) -> list[str]:
    report = gpu.report
    lines = [f"{gpu.gpu.title}: {report.result}   {report.reason}",
             f"    busy {report.union_s:.3f} s in all, {report.together_s:.3f} s of it with "
             f"two or more replicas at once, over {report.window_s:.3f} s"]
    for name, busy in report.busy_s.items():
        fraction = busy / report.window_s if report.window_s > 0 else 0.0
        lines.append(f"    replica {name}: busy {busy:.3f} s ({fraction:.0%})")
    if report.independent_share is not None:
        lines.append(f"    independent replicas this busy would overlap "
                     f"{report.independent_share:.0%}")
    if gpu.truncated:
        lines.append(f"    replica(s) {', '.join(map(str, gpu.truncated))} let some intervals "
                     "of the load go (their recorder is full): a shorter --duration fits")
    return lines


def _result_line(result: RunOverlap) -> str:
    verdict = result.result
    deciding = [g for g in result.gpus if g.report.result == verdict]
    why = "; ".join(f"{g.gpu.title}: {g.report.reason}" for g in deciding)
    if verdict == PASS:
        return (f"RESULT: {PASS}: on each of the {len(result.gpus)} GPU(s) checked, its "
                f"replicas' kernels ran at once ({why})")
    return f"RESULT: {verdict}: {why}"
