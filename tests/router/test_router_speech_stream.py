"""The WebSocket speech session through the router. With real `omni-dp serve` replicas of the
preset tiny: a kill -9 of the serving replica mid-sentence moves the session to the other one
from the sentence that was cut; the client gets every sentence once whole, the cut one marked
`resent`, and the text complete. With no replica left, an error and close 1013; a replica
stopped (SIGSTOP) is found by the heartbeat and the session moved. With stand-in replicas (the
session code in this process over a pipeline the test holds and fails): input.done sent during
a move, moves used up (1014), the router's bounds, a client gone during a move."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time

import aiohttp

from omni_dp.engine.voice.phonemes import split_sentences

from support.router import make_config, sample, scrape, serve
from support.speech_stream import (
    Heard,
    StandInReplica,
    pieces,
    read_until,
    send_done,
    send_text,
)
from support.wait import until

LONG = "This sentence is long enough to keep the talker busy for a while, "
TEXT = ("Hello there. " + LONG * 5 + "and then it ends. A third one follows it! "
        "Is the fourth a question? The fifth ends the session without a stop")


async def kill_mid_sentence(ws, heard: Heard, served, pids: dict[str, int],
                            sentence: int, sig: int = signal.SIGKILL) -> str:
    """Read until sentence `sentence` has begun and sent audio, then kill -9 (or `sig`) its
    replica."""
    while True:
        event = await read_until(ws, heard, "audio.start")
        if event["sentence_index"] == sentence:
            break
    msg = await ws.receive(timeout=30)
    assert msg.type == aiohttp.WSMsgType.BINARY, msg  # part of its audio reached the client
    heard.take(msg)
    (victim,) = [rid for rid, count in served.in_flight().items() if count == 1]
    os.kill(pids.pop(victim), sig)
    return victim


def test_a_session_whose_replica_is_killed_goes_on_on_the_other(start_replica):
    replicas = [start_replica(ready=False) for _ in range(2)]
    for replica in replicas:
        replica.wait_ready()
    pids = {str(i): r.pid for i, r in enumerate(replicas)}
    cut_at = TEXT.index("A third")  # sent after the kill: text arriving during the move

    async def main():
        # the last session waits 1 s for a replica (--replica-wait) before it is told
        config = make_config([f"{i}={r.url}" for i, r in enumerate(replicas)], failures=1,
                             replica_wait_s=1.0)
        async with serve(config) as served, aiohttp.ClientSession() as session:
            url = served.url + "/v1/audio/speech/stream"
            heard = Heard()
            async with session.ws_connect(url) as ws:
                await ws.send_str(json.dumps({"type": "session.config", "voice": "alloy",
                                              "response_format": "pcm",
                                              "stream_audio": True}))
                for piece in pieces(TEXT[:cut_at], 7):
                    await send_text(ws, piece)
                victim = await kill_mid_sentence(ws, heard, served, pids, 1)
                for piece in pieces(TEXT[cut_at:], 7):
                    await send_text(ws, piece)
                await ws.send_str(json.dumps({"type": "input.done"}))
                await read_until(ws, heard, None, timeout=60)
            await served.wait_idle(10)
            # The survivor is killed too, mid-session: nowhere to go (none came within the
            # wait), said so.
            last = Heard()
            async with session.ws_connect(url) as ws:
                await ws.send_str(json.dumps({"type": "session.config",
                                              "response_format": "pcm",
                                              "stream_audio": True}))
                await send_text(ws, "One. " + LONG * 5 + "done. ")
                await kill_mid_sentence(ws, last, served, pids, 1)
                await read_until(ws, last, None, timeout=30)
            await served.wait_idle(10)
            return heard, victim, last, await scrape(session, served.url)

    heard, victim, last, metrics = asyncio.run(asyncio.wait_for(main(), 150))
    expected = split_sentences(TEXT)
    kept = heard.sentences()  # asserts `resent` marks exactly the sentences started again
    # Every sentence once, in order, numbered without a gap; the transcript is the text.
    assert [e["sentence_text"] for e in kept] == expected
    assert [e["sentence_index"] for e in kept] == list(range(len(expected)))
    for event in kept:
        assert TEXT[event["text_start"]:event["text_end"]] == event["sentence_text"]
    (resent,) = [e for e in heard.of("audio.start") if e.get("resent")]
    assert resent["sentence_index"] == 1
    starts = [e["sentence_index"] for e in heard.of("audio.start")]
    assert starts == [0, 1, *range(1, len(expected))]  # 1 began, was cut, began again
    dones = heard.of("audio.done")
    assert [e["sentence_index"] for e in dones] == list(range(len(expected)))
    assert all(len(heard.audio[e["sentence_index"]]) == e["total_bytes"] > 0 for e in dones)
    assert heard.events[-1] == {"type": "session.done", "total_sentences": len(expected)}
    assert heard.close_code == 1000
    assert not heard.of("error")  # the lost replica's end is the router's business
    assert sample(metrics, "omni_dp_router_resumes_total", reason="midstream") == 1
    assert sample(metrics, "omni_dp_router_upstream_errors_total", replica=victim,
                  kind="midstream") == 1
    # The second session: its replica killed, no other one left.
    (error,) = last.of("error")
    assert "no other replica" in error["message"] and "within 1 s" in error["message"]
    assert error["code"] == "replica_wait_timeout"
    assert last.close_code == 1013
    assert not last.of("session.done")


def test_a_stopped_replica_is_found_by_the_heartbeat_and_the_session_moved(start_replica):
    """The serving replica is stopped (SIGSTOP) mid-sentence: its socket stays open and says
    nothing. The router's ping goes unanswered, and within 1.5 × --stall-timeout (1 s here) the
    session moves to the other replica from the cut sentence; it ends with every sentence."""
    replicas = [start_replica(ready=False) for _ in range(2)]
    for replica in replicas:
        replica.wait_ready()
    pids = {str(i): r.pid for i, r in enumerate(replicas)}
    text = "Hello there. " + LONG * 3 + "and then it ends. The last one follows it."

    async def main():
        config = make_config([f"{i}={r.url}" for i, r in enumerate(replicas)], failures=1,
                             stall_timeout_s=1.0)
        async with serve(config) as served, aiohttp.ClientSession() as session:
            heard = Heard()
            async with session.ws_connect(served.url + "/v1/audio/speech/stream") as ws:
                await ws.send_str(json.dumps(PCM_STREAMED))
                for piece in pieces(text, 7):
                    await send_text(ws, piece)
                await send_done(ws)
                await kill_mid_sentence(ws, heard, served, pids, 1, signal.SIGSTOP)
                stopped = time.monotonic()
                while not (await read_until(ws, heard, "audio.start", timeout=10)).get("resent"):
                    pass
                moved_after = time.monotonic() - stopped
                await read_until(ws, heard, None, timeout=30)
            await served.wait_idle(10)
            metrics = await scrape(session, served.url)
        # A fresh router that found both healthy, then the first in its rotation stopped and
        # not ejected yet: the session's handshake to it is bounded by --first-byte-timeout,
        # then the other replica takes the session (without the bound it waits out
        # --request-timeout).
        (stopped_id,) = set(map(str, range(len(replicas)))) - set(pids)
        os.kill(replicas[int(stopped_id)].pid, signal.SIGCONT)
        order = [stopped_id, *pids]
        config = make_config([f"{i}={replicas[int(i)].url}" for i in order],
                             policy="round_robin", first_byte_timeout_s=0.5)
        async with serve(config) as served, aiohttp.ClientSession() as session:
            os.kill(replicas[int(stopped_id)].pid, signal.SIGSTOP)
            opened = Heard()
            async with session.ws_connect(served.url + "/v1/audio/speech/stream") as ws:
                await ws.send_str(json.dumps(PCM_STREAMED))
                await send_text(ws, "Hello there. ")
                await send_done(ws)
                await read_until(ws, opened, None, timeout=20)
            retries = await scrape(session, served.url)
        return heard, moved_after, metrics, opened, retries, stopped_id

    heard, moved_after, metrics, opened, retries, stopped_id = asyncio.run(
        asyncio.wait_for(main(), 90))
    assert opened.events[-1] == {"type": "session.done", "total_sentences": 1}, opened.events
    assert sample(retries, "omni_dp_router_upstream_errors_total", replica=stopped_id,
                  kind="connect_error") == 1
    assert moved_after < 3.0, moved_after  # 1.5 s at most to find it, then the new session
    expected = split_sentences(text)
    kept = heard.sentences()
    assert [e["sentence_text"] for e in kept] == expected
    assert [e["sentence_index"] for e in kept] == list(range(len(expected)))
    assert heard.events[-1] == {"type": "session.done", "total_sentences": len(expected)}
    assert heard.close_code == 1000
    assert sample(metrics, "omni_dp_router_resumes_total", reason="midstream") == 1


PCM_STREAMED = {"type": "session.config", "voice": "alloy", "response_format": "pcm",
                "stream_audio": True}


@contextlib.asynccontextmanager
async def stand_ins(count: int, resumes: int = 1, **kwargs):
    """`count` stand-in replicas behind a router; at the end every count is back to 0."""
    async with contextlib.AsyncExitStack() as stack:
        replicas = [await stack.enter_async_context(StandInReplica(**kwargs))
                    for _ in range(count)]
        config = make_config([f"{i}={r.url}" for i, r in enumerate(replicas)], failures=1,
                             resumes=resumes)
        served = await stack.enter_async_context(serve(config))
        async with aiohttp.ClientSession() as session:
            yield served, replicas, session
            await served.wait_idle(3)
            await until(lambda: all(r.idle() for r in replicas), 3, "stand-ins idle")


def serving(replicas: list[StandInReplica]) -> tuple[StandInReplica, StandInReplica]:
    """(the stand-in with the session, the other)."""
    (one,) = [r for r in replicas if r.sessions == 1]
    return one, next(r for r in replicas if r is not one)


def test_input_done_sent_during_a_move_follows_the_resent_text_once():
    """The replica fails mid-sentence 0 (close 1011); while the router opens the other one
    (its upgrade held), the client sends the rest of the text and input.done: the new replica
    gets the config, the text from sentence 0 on, then input.done once, and the session ends
    with every sentence, 0 marked resent. The text held has 11,000 characters outside the BMP
    (12 bytes of JSON each): the resend's pieces stay under 128 KiB all the same, and that
    sentence's audio.start (its text) and each sentence's audio (one 200 KB frame each, no
    stream_audio) are over 128 KiB: the router takes a replica's frames whatever their size."""
    emoji = "\U0001F600" * 11_000
    before = "Hello there. " + emoji + ". "
    text = before + "Third one follows. And the last has no stop"

    async def main():
        heard = Heard()
        async with stand_ins(2, max_input_chars=1 << 15, chunk_bytes=100_000) as (
                served, replicas, session):
            for replica in replicas:
                replica.pipeline.gate.clear()
            async with session.ws_connect(served.url + "/v1/audio/speech/stream") as ws:
                await ws.send_str(json.dumps({**PCM_STREAMED, "stream_audio": False}))
                for piece in pieces(before, 4000):
                    await send_text(ws, piece)
                await read_until(ws, heard, "audio.start", timeout=5)
                lost, other = serving(replicas)
                other.handshake.clear()
                lost.pipeline.fail = True
                lost.pipeline.gate.set()
                await asyncio.wait_for(other.arrived.wait(), 5)  # the move is under way
                for piece in pieces(text[len(before):], 9):
                    await send_text(ws, piece)
                await send_done(ws)
                # Answered by the router itself, after it took input.done: it is in the move.
                await ws.send_str("{not json")
                await read_until(ws, heard, "error", timeout=5)
                other.handshake.set()
                other.pipeline.gate.set()
                await read_until(ws, heard, None, timeout=5)
            return heard, await scrape(session, served.url)

    heard, metrics = asyncio.run(asyncio.wait_for(main(), 30))
    expected = split_sentences(text)
    assert len(expected) == 4
    kept = heard.sentences()
    assert [e["sentence_text"] for e in kept] == expected
    assert [e["sentence_index"] for e in kept] == [0, 1, 2, 3]
    assert all(text[e["text_start"]:e["text_end"]] == e["sentence_text"] for e in kept)
    assert [e["sentence_index"] for e in heard.of("audio.start")] == [0, 0, 1, 2, 3]
    dones = heard.of("audio.done")
    assert [e["sentence_index"] for e in dones] == [0, 1, 2, 3]
    assert all(e["total_bytes"] == len(heard.audio[e["sentence_index"]]) == 200_000
               for e in dones)
    assert heard.events[-1] == {"type": "session.done", "total_sentences": 4}
    assert heard.close_code == 1000
    assert [e["field"] for e in heard.of("error")] == ["message"]  # the router's, only
    assert sample(metrics, "omni_dp_router_resumes_total", reason="midstream") == 1


def test_a_second_loss_after_the_one_move_allowed_is_1014():
    """--resumes 1 and three replicas each failing mid-sentence: the session moves once, and
    the second loss ends it with an error and 1014 (the third replica never sees it); the
    router's own close is not counted as the client leaving."""

    async def main():
        heard = Heard()
        async with stand_ins(3, resumes=1) as (served, replicas, session):
            for replica in replicas:
                replica.pipeline.fail = True
            async with session.ws_connect(served.url + "/v1/audio/speech/stream") as ws:
                await ws.send_str(json.dumps(PCM_STREAMED))
                await send_text(ws, "One. Two. ")
                await send_done(ws)
                await read_until(ws, heard, None, timeout=5)
            opened = sum(r.arrived.is_set() for r in replicas)
            return heard, opened, await scrape(session, served.url)

    heard, opened, metrics = asyncio.run(asyncio.wait_for(main(), 20))
    assert opened == 2
    assert heard.close_code == 1014
    (error,) = heard.of("error")
    assert error["code"] == "resumes_spent" and "may move no more" in error["message"]
    assert [e.get("resent", False) for e in heard.of("audio.start")] == [False, True]
    assert not heard.of("session.done") and not heard.of("audio.done")
    assert sample(metrics, "omni_dp_router_resumes_total", reason="midstream") == 1
    assert sample(metrics, "omni_dp_router_streams_cut_total", why="resumes_spent") == 1
    assert sample(metrics, "omni_dp_router_client_disconnects_total") == 0


def test_the_routers_bounds_and_the_replicas_idle_close():
    """Through the router: more than 2^20 characters unspoken (the replica's bound set above
    it) is an error and 1009 from the router; a frame over 128 KiB is 1009; the replica's
    idle timeout reaches the client as its error and 1008. None counted as a client gone."""

    async def main():
        got = {}
        async with stand_ins(1, max_input_chars=1 << 17, idle_timeout_s=0.3) as (
                served, (replica,), session):
            url = served.url + "/v1/audio/speech/stream"
            for name, frames in (("held", [json.dumps({"type": "input.text",
                                                       "text": "Word. " * 16_666})] * 11),
                                 ("frame", ["x" * (128 * 1024 + 1)]),
                                 ("idle", [json.dumps({"type": "input.text", "text": "Hi. "})])):
                heard = got[name] = Heard()
                replica.pipeline.gate.clear()  # nothing is spoken past its first chunk
                async with session.ws_connect(url) as ws:
                    await ws.send_str(json.dumps(PCM_STREAMED))
                    for frame in frames:
                        await ws.send_str(frame)
                    if name == "idle":
                        replica.pipeline.gate.set()
                    await read_until(ws, heard, None, timeout=5)
                replica.pipeline.gate.set()
                await served.wait_idle(3)
            return got, await scrape(session, served.url)

    got, metrics = asyncio.run(asyncio.wait_for(main(), 30))
    (error,) = got["held"].of("error")
    assert got["held"].close_code == 1009
    assert error["code"] == "text_too_long" and "the router holds 1048576" in error["message"]
    assert got["frame"].close_code == 1009 and not got["frame"].of("error")
    (error,) = got["idle"].of("error")
    assert got["idle"].close_code == 1008 and error["field"] == "type", error
    assert [e["sentence_index"] for e in got["idle"].of("audio.done")] == [0]
    assert sample(metrics, "omni_dp_router_client_disconnects_total") == 0


def test_a_client_gone_during_a_move_leaves_nothing_open():
    """The client hangs up while the router opens the next replica: that replica's session is
    closed at once (not given the text to speak to no one), every count back to 0."""

    async def main():
        heard = Heard()
        async with stand_ins(2) as (served, replicas, session):
            for replica in replicas:
                replica.pipeline.gate.clear()
            async with session.ws_connect(served.url + "/v1/audio/speech/stream") as ws:
                await ws.send_str(json.dumps(PCM_STREAMED))
                await send_text(ws, "Hello there. More to come. ")
                await read_until(ws, heard, "audio.start", timeout=5)
                lost, other = serving(replicas)
                other.handshake.clear()
                lost.pipeline.fail = True
                lost.pipeline.gate.set()
                await asyncio.wait_for(other.arrived.wait(), 5)
            other.handshake.set()
            await served.wait_idle(2)
            await until(other.idle, 2, "the new replica's session closed")
            assert not other.pipeline.started.is_set()  # given nothing to speak

    asyncio.run(asyncio.wait_for(main(), 20))


def test_a_session_opened_while_no_replica_is_routable_waits_for_one():
    """The upgrade is answered once a replica is enabled (--replica-wait), not 503 at once."""

    async def main():
        heard = Heard()
        async with stand_ins(1) as (served, (replica,), session):
            served.router.set_disabled(served.replica("0"), True)  # being restarted
            url = served.url + "/v1/audio/speech/stream"
            connecting = asyncio.create_task(session.ws_connect(url))
            await until(lambda: served.router.num_waiting == 1, 3, "the session waiting")
            assert not replica.arrived.is_set()
            served.router.set_disabled(served.replica("0"), False)
            async with await asyncio.wait_for(connecting, 3) as ws:
                await ws.send_str(json.dumps(PCM_STREAMED))
                await send_text(ws, "Hello there. ")
                await send_done(ws)
                await read_until(ws, heard, None, timeout=5)
            return heard, await scrape(session, served.url)

    heard, metrics = asyncio.run(asyncio.wait_for(main(), 20))
    assert heard.events[-1] == {"type": "session.done", "total_sentences": 1}
    assert heard.close_code == 1000
    assert sample(metrics, "omni_dp_router_replica_waits_total", outcome="found") == 1


def test_a_session_whose_replica_is_lost_while_the_other_is_disabled_moves_once_it_is_back():
    """Its replica fails mid-sentence while the other one is disabled (restarting): the move
    waits for it (--replica-wait) and the session goes on there, every sentence once."""
    text = "Hello there. More to come. "

    async def main():
        heard = Heard()
        async with stand_ins(2) as (served, replicas, session):
            for replica in replicas:
                replica.pipeline.gate.clear()
            async with session.ws_connect(served.url + "/v1/audio/speech/stream") as ws:
                await ws.send_str(json.dumps(PCM_STREAMED))
                await send_text(ws, text)
                await send_done(ws)
                await read_until(ws, heard, "audio.start", timeout=5)
                lost, other = serving(replicas)
                other_id = str(replicas.index(other))
                served.router.set_disabled(served.replica(other_id), True)
                lost.pipeline.fail = True
                lost.pipeline.gate.set()
                await until(lambda: served.router.num_waiting == 1, 3, "the move waiting")
                assert not other.arrived.is_set()
                served.router.set_disabled(served.replica(other_id), False)
                other.pipeline.gate.set()
                await read_until(ws, heard, None, timeout=5)
            return heard, await scrape(session, served.url)

    heard, metrics = asyncio.run(asyncio.wait_for(main(), 20))
    assert [e["sentence_text"] for e in heard.sentences()] == split_sentences(text)
    assert heard.events[-1] == {"type": "session.done", "total_sentences": 2}
    assert heard.close_code == 1000
    assert sample(metrics, "omni_dp_router_resumes_total", reason="midstream") == 1
    assert sample(metrics, "omni_dp_router_replica_waits_total", outcome="found") == 1
