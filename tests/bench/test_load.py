"""The load generator against a TEST STAND-IN server (support/bench_standin.py): every
request counted under its outcome, the warm-up left out, the router's replica header read,
audio seconds and tokens taken from the answers, and nothing running past its bound."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest

from omni_dp.bench.load import GRACE_S, run_point
from omni_dp.bench.stats import summarize_point
from omni_dp.bench.workload import Workload

from support.bench_standin import CHUNK_BYTES, CHUNKS, SAMPLE_RATE, TOKENS, BenchStandin


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def speech(*texts: str, kind: str = "speech-stream") -> Workload:
    return Workload(kind=kind, texts=texts)


async def point(standin: BenchStandin, workload: Workload, concurrency: int = 2, **kw):
    options = {"duration_s": 0.4, "warmup_s": 0.0, "timeout_s": 2.0, **kw}
    return await run_point(standin.url, workload, concurrency, **options)


def test_streamed_pcm_is_ok_with_its_audio_seconds_first_audio_and_replica():
    async def main():
        async with BenchStandin() as standin:
            return await point(standin, speech("ok"))

    results, window = run(main())
    assert results and {r.outcome for r in results} == {"ok"}
    seconds = CHUNK_BYTES * CHUNKS / (SAMPLE_RATE * 2)  # bytes / (rate × 2): the header's rate
    for r in results:
        assert r.status == 200 and r.replica == "r7"
        assert r.audio_s == pytest.approx(seconds)
        assert r.ttfb_s is not None and 0 < r.ttfb_s < r.latency_s
    assert window == pytest.approx(0.4)


def test_a_wav_answer_gives_its_seconds_from_its_header():
    async def main():
        async with BenchStandin() as standin:
            return await point(standin, speech("ok", kind="speech"), concurrency=1)

    results, _ = run(main())
    assert results and all(r.outcome == "ok" for r in results)
    assert results[0].audio_s == pytest.approx(CHUNK_BYTES * CHUNKS / (SAMPLE_RATE * 2))


def test_an_answer_without_audio_is_ok_and_counted_as_empty_not_as_a_failure():
    async def main():
        async with BenchStandin() as standin:
            return await point(standin, speech("silence", "ok"), concurrency=1)

    results, window = run(main())
    assert {r.outcome for r in results} == {"ok"}
    silent = [r for r in results if r.audio_s == 0]
    assert silent and all(r.ttfb_s is None for r in silent)
    summary = summarize_point(results, window, 1, 0)
    assert summary.failures == {} and summary.empty == len(silent)
    assert summary.rtf_p50 is not None  # over the answers that had audio


def test_a_503_is_counted_with_its_status():
    async def main():
        async with BenchStandin() as standin:
            return await point(standin, speech("busy"))

    results, _ = run(main())
    assert results and {(r.outcome, r.status) for r in results} == {("http", 503)}
    assert all(r.audio_s == 0 and r.ttfb_s is None for r in results)


def test_a_hung_request_is_a_timeout_and_the_point_stays_within_its_bound():
    async def main():
        async with BenchStandin() as standin:
            started = time.monotonic()
            out = await point(standin, speech("hang"), duration_s=0.2, timeout_s=0.5)
            return out, time.monotonic() - started

    (results, _), took = run(main())
    # One request per client: each started in the window and hung until its timeout.
    assert [(r.outcome, r.status) for r in results] == [("timeout", None)] * 2
    assert all(r.latency_s == pytest.approx(0.5, abs=0.2) for r in results)
    assert took < 0.2 + 0.5 + GRACE_S


def test_a_connection_dropped_mid_stream_or_before_an_answer_is_an_error():
    async def main():
        async with BenchStandin() as standin:
            cut = await point(standin, speech("drop"))
            reset = await point(standin, speech("reset"))
            return cut[0], reset[0]

    cut, reset = run(main())
    assert cut and all(r.outcome == "error" and r.status == 200 for r in cut)
    assert all(r.audio_s == 0 and r.ttfb_s is not None for r in cut)  # audio came, then the cut
    assert reset and all(r.outcome == "error" and r.status is None for r in reset)


def test_every_request_of_a_mixed_window_is_counted_under_its_outcome():
    """No warm-up: every request the stand-in received is one result, of the right kind."""
    async def main():
        async with BenchStandin() as standin:
            results, _ = await point(standin, speech("ok", "busy", "hang", "drop", "reset"),
                                     concurrency=4, duration_s=0.6, timeout_s=0.3)
            return results, Counter(text for _, text in standin.hits)

    results, sent = run(main())
    expected = {"ok": ("ok", 200), "busy": ("http", 503), "hang": ("timeout", None),
                "drop": ("error", 200), "reset": ("error", None)}
    counted = Counter((r.outcome, r.status) for r in results)
    wanted = Counter()
    for text, n in sent.items():
        wanted[expected[text]] += n
    assert counted == wanted
    assert len(results) == sum(sent.values()) and len(sent) >= 3


def test_requests_started_in_the_warm_up_are_not_counted():
    seen_at_start: list[int] = []

    async def main():
        async with BenchStandin(delay_s=0.03) as standin:  # ~0.1 s a request
            def on_window(event: str) -> None:
                if event == "start":
                    seen_at_start.append(len(standin.hits))

            results, window = await point(standin, speech("ok"), concurrency=1,
                                          duration_s=0.45, warmup_s=0.45, on_window=on_window)
            return results, window, len(standin.hits)

    results, window, total = run(main())
    warmup = seen_at_start[0]
    assert warmup >= 2 and results
    # What the stand-in got after the warm-up is what was counted (one request may straddle
    # the boundary on a loaded machine).
    assert abs((total - warmup) - len(results)) <= 1
    assert len(results) < total
    assert window == pytest.approx(0.45)  # the planned window: rates are per its length


def test_completions_count_the_usage_tokens_and_an_error_event_fails_the_request():
    async def main():
        async with BenchStandin() as standin:
            ok = await point(standin, Workload(kind="completions", texts=("hi",)))
            bad = await point(standin, Workload(kind="completions", texts=("error",)))
            return ok[0], bad[0]

    ok, bad = run(main())
    assert ok and all(r.outcome == "ok" and r.tokens == TOKENS for r in ok)
    assert all(r.ttfb_s is not None and r.ttfb_s < r.latency_s for r in ok)
    assert bad and all(r.outcome == "error" and r.tokens == 0 for r in bad)


def test_a_refused_connection_is_an_error_not_an_exception():
    from support.ports import free_port

    results, _ = run(run_point(f"http://127.0.0.1:{free_port()}", speech("ok"), 2,
                               duration_s=0.2, warmup_s=0.0, timeout_s=1.0))
    assert results and {(r.outcome, r.status) for r in results} == {("error", None)}
