"""Streams that survive their replica: an answer the replica says can be resumed
(X-Omni-DP-Resumable: bytes) is continued by another replica from the byte the client has,
and the client reads one continuous answer; everything else ends cut, as before.

The stand-in replicas here speak the resume contract of docs/contracts.md; the last test does
it with real `omni-dp serve` processes and a kill -9."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import signal

import aiohttp
import pytest
from aiohttp import web

from omni_dp.engine.audio import sse_audio_delta, sse_audio_done, sse_error

from support.http_client import client
from support.router import (
    Backend,
    backends,
    make_config,
    read_all,
    routes,
    run,
    sample,
    scrape,
    serve,
    total,
)

ANSWER_BYTES = 80_000  # over the 64 KiB the router reads whole before it answers
CHUNK = 1000


def answer(seed: int) -> bytes:
    """What a stand-in replica answers for `seed`: a function of it alone, as the built-in
    engine's wav and pcm are."""
    return bytes((seed * 31 + i * 7 + i // 251) % 256 for i in range(ANSWER_BYTES))


def resumable(die_after: int | None = None, *, sse: bool = False, error_event: bool = False,
              honour_offset: bool = True, whole: bool = False, pace_s: float = 0.002):
    """A stand-in replica. It streams `answer(seed)` in CHUNK pieces from the byte asked
    (X-Omni-DP-Resume-From), with the seed asked (X-Omni-DP-Seed, else 77). `die_after`:
    after that many answer bytes it dies (half an SSE event out, or an error event first);
    `honour_offset` False: an old replica that ignores the resume headers; `whole`: one
    buffered body of known length (stream: false); `pace_s` between chunks."""

    async def handler(backend: Backend, request: web.Request, seen) -> web.StreamResponse:
        seed = int(request.headers.get("X-Omni-DP-Seed", "77"))
        offset = int(request.headers.get("X-Omni-DP-Resume-From", "0")) if honour_offset else 0
        headers = {"Content-Type": "text/event-stream" if sse else "audio/pcm",
                   "X-Seed": str(seed), "X-Omni-DP-Resumable": "bytes"}
        if honour_offset and "X-Omni-DP-Resume-From" in request.headers:
            headers["X-Omni-DP-Resumed-From"] = str(offset)
        response = web.StreamResponse(headers=headers)
        data = answer(seed)
        if whole:
            response.content_length = len(data) - offset
        await response.prepare(request)
        for start in range(offset - offset % CHUNK, len(data), CHUNK):
            piece = data[max(start, offset):start + CHUNK]
            if die_after is not None and start >= die_after:
                if error_event:
                    await response.write(sse_error("engine failed: a stage process died"))
                elif sse:
                    await response.write(sse_audio_delta(piece)[:25])  # half an event
                await asyncio.sleep(0.02)
                request.transport.abort()  # as a kill -9 leaves it
                return response
            await response.write(sse_audio_delta(piece) if sse else piece)
            await asyncio.sleep(pace_s)
        if sse:
            await response.write(sse_audio_done({"audio_seconds": 1.0}))
        await response.write_eof()
        return response

    return handler


def events_of(body: bytes) -> list[dict]:
    assert body.endswith(b"\n\n"), body[-40:]
    return [json.loads(block[len("data: "):]) for block in body.decode().split("\n\n")
            if block.strip()]


def sse_audio(events: list[dict]) -> bytes:
    return b"".join(base64.b64decode(e["audio"]) for e in events
                    if e["type"] == "speech.audio.delta")


async def through_router(first, second, **options):
    """One request through a router over two stand-ins (the first is picked first)."""
    a, b = Backend("a", first), Backend("b", second)
    async with backends(a, b), \
            serve(make_config([f"a={a.url}", f"b={b.url}"], policy="round_robin",
                              **options)) as served, client() as session:
        result = await read_all(session, served.url + "/v1/audio/speech",
                                headers={"X-Request-ID": "r"})
        await served.wait_idle()
        return (*result, [s.headers for s in b.seen], await scrape(session, served.url))


@pytest.mark.parametrize("whole", [False, True], ids=["chunked", "content-length"])
def test_a_raw_stream_cut_mid_body_is_finished_by_another_replica(caplog, whole):
    caplog.set_level(logging.INFO, logger="omni_dp.router.access")
    status, headers, body, broken, b_headers, metrics = run(through_router(
        resumable(die_after=7 * CHUNK, whole=whole), resumable(whole=whole)))
    assert status == 200
    assert broken is None
    assert body == answer(77)  # one continuous answer, byte for byte
    (resume,) = b_headers
    assert resume["X-Omni-DP-Seed"] == "77"  # the seed the first answer was sampled with
    assert 0 < int(resume["X-Omni-DP-Resume-From"]) <= 7 * CHUNK
    assert headers["X-Omni-DP-Replica"] == "a"  # the head the client got, from the first
    assert sample(metrics, "omni_dp_router_resumes_total", reason="midstream") == 1
    assert total(metrics, "omni_dp_router_streams_cut_total") == 0
    route = routes(caplog)["r"]
    assert (route["tried"], route["resumes"], route["outcome"]) == (["a", "b"], ["midstream"],
                                                                    "ok")
    assert route["resumed_from"] == int(resume["X-Omni-DP-Resume-From"])
    assert route["seed"] == "77"
    assert route["bytes"] == ANSWER_BYTES


@pytest.mark.parametrize("error_event", [False, True], ids=["cut-mid-event", "error-event"])
def test_an_sse_stream_cut_is_finished_as_one_well_formed_stream(error_event):
    status, _, body, broken, b_headers, metrics = run(through_router(
        resumable(die_after=5 * CHUNK, sse=True, error_event=error_event),
        resumable(sse=True)))
    assert (status, broken) == (200, None)
    events = events_of(body)
    kinds = [e["type"] for e in events]
    assert kinds == ["speech.audio.delta"] * (len(events) - 1) + ["speech.audio.done"]
    assert sse_audio(events) == answer(77)
    # the offset counts the decoded audio of the whole events relayed
    assert b_headers[0]["X-Omni-DP-Resume-From"] == str(5 * CHUNK)
    reason = "replica_error" if error_event else "midstream"
    assert sample(metrics, "omni_dp_router_resumes_total", reason=reason) == 1


def test_a_replica_that_ignores_the_offset_is_never_spliced_in():
    """An old replica answers from byte 0 without saying it resumed: relaying it would repeat
    audio, so the stream ends cut instead."""
    status, _, body, broken, b_headers, metrics = run(through_router(
        resumable(die_after=5 * CHUNK, sse=True), resumable(sse=True, honour_offset=False)))
    assert status == 200
    assert broken is not None
    events = events_of(body)
    assert events[-1]["error"]["code"] == 502
    assert "resume" in events[-1]["error"]["message"]
    assert len(b_headers) == 1
    assert sample(metrics, "omni_dp_router_streams_cut_total", why="resume_refused") == 1


def test_resumes_0_leaves_a_cut_stream_cut():
    status, _, body, broken, b_headers, metrics = run(through_router(
        resumable(die_after=5 * CHUNK), resumable(), resumes=0))
    assert status == 200
    assert broken is not None
    assert body == answer(77)[:len(body)] and len(body) < ANSWER_BYTES
    assert b_headers == []
    assert sample(metrics, "omni_dp_router_streams_cut_total", why="resumes_spent") == 1


def test_only_one_resume_per_request():
    """The replica that resumed it dies too, and another is there: the stream ends cut."""

    async def main():
        bs = [Backend(n, resumable(die_after=d))
              for n, d in (("a", 3000), ("b", 6000), ("c", 6000), ("d", None))]
        async with backends(*bs), \
                serve(make_config([f"{b.name}={b.url}" for b in bs],
                                  policy="round_robin")) as served, client() as session:
            result = await read_all(session, served.url + "/v1/audio/speech")
            await served.wait_idle()
            return (*result, [len(b.seen) for b in bs], await scrape(session, served.url))

    status, _, body, broken, seen, metrics = run(main())
    assert status == 200
    assert broken is not None
    assert seen[0] == 1 and sum(seen[1:3]) == 1 and seen[3] == 0
    assert body == answer(77)[:len(body)]
    assert sample(metrics, "omni_dp_router_streams_cut_total", why="resumes_spent") == 1


# --- real replicas --------------------------------------------------------------------------

SPEECH_BODY = {"input": "Resume me from any byte after a kill.", "max_new_tokens": 400}


async def long_seed(session, url: str, fields: dict) -> int:
    """A seed whose answer runs its full max_new_tokens (the tiny model may stop early)."""
    for seed in range(20):
        async with session.post(url, json={**SPEECH_BODY, **fields, "seed": seed}) as resp:
            if len(await resp.read()) >= 300 * 1920:
                return seed
    raise AssertionError("no seed in 0-19 gives 300 codec tokens")


async def kill_mid_stream(session, served, pids: dict[str, int], body: dict) -> tuple:
    """Stream `body` through the router, kill -9 the replica serving it after its first
    ~20 KB; (the bytes the client read, the replica killed)."""
    async with session.post(served.url + "/v1/audio/speech", json=body) as resp:
        assert resp.status == 200
        victim = resp.headers["X-Omni-DP-Replica"]
        got = b""
        async for chunk in resp.content.iter_any():
            got += chunk
            if victim in pids and len(got) >= 20_000:
                os.kill(pids.pop(victim), signal.SIGKILL)
        return got, victim


def test_a_stream_whose_replica_is_killed_is_the_uncut_stream(start_replica):
    """kill -9 of the replica mid-stream, pcm raw then wav over SSE: the client reads exactly
    what an uncut stream of the same request and seed gives. Byte-equal: on the CPU the talker
    computes in float64 and every replica is the same build (docs/contracts.md)."""
    replicas = [start_replica("--max-total-tokens", "2048", ready=False) for _ in range(3)]
    for replica in replicas:
        replica.wait_ready()
    pids = {str(i): r.pid for i, r in enumerate(replicas)}

    async def main():
        config = make_config([f"{i}={r.url}" for i, r in enumerate(replicas)], failures=1)
        async with serve(config) as served, \
                client(timeout=aiohttp.ClientTimeout(total=60)) as session:
            results = []
            for fields in ({"response_format": "pcm"},
                           {"response_format": "wav", "stream_format": "sse"}):
                url = served.url + "/v1/audio/speech"
                seed = await long_seed(session, url, fields)
                body = {**SPEECH_BODY, **fields, "seed": seed}
                async with session.post(url, json=body) as resp:
                    uncut = await resp.read()
                got, victim = await kill_mid_stream(session, served, pids, body)
                results.append((uncut, got, victim))
            await served.wait_idle(10)
            return results, await scrape(session, served.url)

    results, metrics = asyncio.run(asyncio.wait_for(main(), 120))
    (pcm_uncut, pcm_got, first), (sse_uncut, sse_got, second) = results
    assert first != second  # each run killed the replica serving it
    assert len(pcm_uncut) >= 300 * 1920
    assert pcm_got == pcm_uncut
    # SSE: the events are cut anew where the resume began; the audio and the end are the same
    got_events, uncut_events = events_of(sse_got), events_of(sse_uncut)
    assert got_events[-1] == uncut_events[-1]
    assert {e["type"] for e in got_events[:-1]} == {"speech.audio.delta"}
    assert sse_audio(got_events) == sse_audio(uncut_events)
    assert total(metrics, "omni_dp_router_resumes_total") == 2
    assert total(metrics, "omni_dp_router_streams_cut_total") == 0


def test_a_host_router_that_dies_mid_stream_is_resumed_through_another_host():
    """Router of routers: the front resumes through host B what host A's router was relaying
    when it died; the resume headers cross both hops."""

    async def main():
        # a1 streams for 4 s: host A's router, told to stop, cuts it off after its 1 s grace
        a1 = Backend("a1", resumable(pace_s=0.05), cancellation=True)
        b1 = Backend("b1", resumable())
        async with backends(a1, b1), contextlib.AsyncExitStack() as stack:
            host_a = await stack.enter_async_context(serve(make_config([f"a1={a1.url}"])))
            async with serve(make_config([f"b1={b1.url}"])) as host_b, \
                    serve(make_config([f"A={host_a.url}", f"B={host_b.url}"],
                                      policy="round_robin")) as front, client() as session:
                async with session.post(front.url + "/v1/audio/speech", data=b"{}") as resp:
                    body = await resp.content.readexactly(3 * CHUNK)
                    await stack.aclose()  # host A's router goes, mid-stream
                    body += await resp.read()
                    headers = resp.headers
                await front.wait_idle()
                return body, headers, [s.headers for s in b1.seen], await scrape(
                    session, front.url)

    body, headers, b1_headers, metrics = run(main())
    assert headers["X-Omni-DP-Replica"] == "A"
    assert body == answer(77)
    (resume,) = b1_headers
    assert int(resume["X-Omni-DP-Resume-From"]) >= 3 * CHUNK
    assert resume["X-Omni-DP-Seed"] == "77"
    assert sample(metrics, "omni_dp_router_resumes_total", reason="midstream") == 1
