"""The WebSocket speech session through the router, with real `omni-dp serve` replicas of the
preset tiny: a kill -9 of the serving replica mid-sentence moves the session to the other one
from the sentence that was cut; the client gets every sentence once whole, the cut one marked
`resent`, and the text complete. With no replica left, an error and close 1013."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import aiohttp

from omni_dp.engine.voice.phonemes import split_sentences

from support.router import make_config, sample, scrape, serve
from support.speech_stream import Heard, pieces, read_until, send_text

LONG = "This sentence is long enough to keep the talker busy for a while, "
TEXT = ("Hello there. " + LONG * 5 + "and then it ends. A third one follows it! "
        "Is the fourth a question? The fifth ends the session without a stop")


async def kill_mid_sentence(ws, heard: Heard, served, pids: dict[str, int],
                            sentence: int) -> str:
    """Read until sentence `sentence` has begun and sent audio, then kill -9 its replica."""
    while True:
        event = await read_until(ws, heard, "audio.start")
        if event["sentence_index"] == sentence:
            break
    msg = await ws.receive(timeout=30)
    assert msg.type == aiohttp.WSMsgType.BINARY, msg  # part of its audio reached the client
    heard.take(msg)
    (victim,) = [rid for rid, count in served.in_flight().items() if count == 1]
    os.kill(pids.pop(victim), signal.SIGKILL)
    return victim


def test_a_session_whose_replica_is_killed_goes_on_on_the_other(start_replica):
    replicas = [start_replica(ready=False) for _ in range(2)]
    for replica in replicas:
        replica.wait_ready()
    pids = {str(i): r.pid for i, r in enumerate(replicas)}
    cut_at = TEXT.index("A third")  # sent after the kill: text arriving during the move

    async def main():
        config = make_config([f"{i}={r.url}" for i, r in enumerate(replicas)], failures=1)
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
            # The survivor is killed too, mid-session: nowhere to go, said so.
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
    assert "no other replica" in error["message"]
    assert last.close_code == 1013
    assert not last.of("session.done")
