"""The load generator: a closed loop of `concurrency` clients, each sending its next request
as soon as its last one ended, for a warm-up and then a measured window.

Every request started in the window is counted whatever became of it (ok, an HTTP error such
as a 503, a timeout, a broken connection or stream); those started in the warm-up only load
the system. The window ends when its last request does, so its length is measured, not
assumed. Bounded: no request outlives `timeout_s`, and nothing runs past warm-up + duration +
timeout (and a short grace, after which what is left is cancelled and counted a timeout).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable

import aiohttp

from omni_dp.bench.results import RequestResult
from omni_dp.bench.workload import AnswerError, Workload

REPLICA_HEADER = "X-Omni-DP-Replica"  # the router's: which replica answered
GRACE_S = 2.0  # past the last request's own timeout, before what is left is cancelled


async def run_point(url: str, workload: Workload, concurrency: int, *, duration_s: float,
                    warmup_s: float, timeout_s: float, api_key: str | None = None,
                    first_index: int = 0,
                    on_window: Callable[[str], None] | None = None,
                    ) -> tuple[list[RequestResult], float]:
    """The results of the requests started in the window, and the window's measured length.
    `on_window("start")` is called as the warm-up ends, `on_window("end")` once the window's
    last request ended (a sampler's start and stop); request i is `workload.request(i)`,
    counting from `first_index`."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    if duration_s <= 0 or warmup_s < 0 or timeout_s <= 0:
        raise ValueError("duration and timeout must be positive, the warm-up not negative")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # Our own deadline bounds each request; aiohttp's total is only the backstop.
    connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=concurrency)
    session = aiohttp.ClientSession(
        connector=connector, trust_env=False, headers=headers,
        timeout=aiohttp.ClientTimeout(total=timeout_s + GRACE_S))
    window = _Window(time.perf_counter() + warmup_s, duration_s)
    indices = itertools.count(first_index)
    results: list[RequestResult] = []

    async def client() -> None:
        while (started := time.perf_counter()) < window.end:
            counted = started >= window.start
            path, body = workload.request(next(indices))
            try:
                result = await send(session, url.rstrip("/") + path, body, workload, timeout_s)
            except asyncio.CancelledError:  # past the grace: counted as the timeout it is
                if counted:
                    results.append(RequestResult("timeout", None,
                                                 time.perf_counter() - started, None))
                    window.ended(time.perf_counter())
                raise
            if counted:
                results.append(result)
                window.ended(time.perf_counter())

    async def mark_start() -> None:
        await asyncio.sleep(max(0.0, window.start - time.perf_counter()))
        if on_window is not None:
            on_window("start")

    async with session:
        marker = asyncio.create_task(mark_start())
        clients = [asyncio.create_task(client()) for _ in range(concurrency)]
        _, left = await asyncio.wait(clients, timeout=warmup_s + duration_s + timeout_s + GRACE_S)
        for task in left:
            task.cancel()
        await asyncio.gather(*clients, marker, return_exceptions=True)
    if on_window is not None:
        on_window("end")
    return results, window.length(time.perf_counter())


class _Window:
    """The measured window: from the warm-up's end until the last counted request ended."""

    def __init__(self, start: float, duration_s: float) -> None:
        self.start = start
        self.end = start + duration_s
        self.last = start

    def ended(self, when: float) -> None:
        self.last = max(self.last, when)

    def length(self, now: float) -> float:
        """The window's duration: requests are counted by when they started in it, so in a
        closed loop its start rate over D is the throughput; stretching it to the last one's
        end (a timeout: + 60 s) would understate every rate."""
        return min(max(now, self.start), self.end) - self.start


async def send(session: aiohttp.ClientSession, url: str, body: dict, workload: Workload,
               timeout_s: float) -> RequestResult:
    """One request, timed from send to its last byte, classified; never raises but on
    cancellation."""
    started = time.perf_counter()
    seen: dict = {"status": None, "replica": None, "first": None}

    async def exchange() -> tuple[float, int]:
        async with session.post(url, json=body) as resp:
            seen["status"] = resp.status
            seen["replica"] = resp.headers.get(REPLICA_HEADER)
            if not 200 <= resp.status < 300:
                await resp.read()
                return 0.0, 0
            reader = workload.reader(resp.headers)
            async for chunk in resp.content.iter_any():
                if reader.feed(chunk) and seen["first"] is None:
                    seen["first"] = time.perf_counter()
            return reader.finish()

    outcome, audio_s, tokens = "ok", 0.0, 0
    try:
        audio_s, tokens = await asyncio.wait_for(exchange(), timeout_s)
        if seen["status"] is not None and not 200 <= seen["status"] < 300:
            outcome = "http"
    except asyncio.TimeoutError:  # ours, or aiohttp's (a subclass)
        outcome = "timeout"
    except (aiohttp.ClientError, OSError, AnswerError):  # reset, refused, cut stream
        outcome = "error"
    except Exception:  # whatever else broke reading it: still one request, counted (a client
        outcome = "error"  # that died would silently lower the concurrency)
    ended = time.perf_counter()
    first = seen["first"]
    return RequestResult(outcome, seen["status"], ended - started,
                         None if first is None else first - started,
                         audio_s if outcome == "ok" else 0.0,
                         tokens if outcome == "ok" else 0, seen["replica"])
