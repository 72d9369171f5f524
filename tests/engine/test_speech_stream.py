"""The replica's WebSocket speech session (GET /v1/audio/speech/stream), on a real `omni-dp
serve` of the preset tiny (the shared `replica` fixture): text in pieces, each sentence spoken
as soon as it is complete, in order, with its span; input.done ends it; a bad message is an
error naming its field; a client gone cancels the sentence being synthesized."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time

import aiohttp

from omni_dp.engine.options import ServeOptions
from omni_dp.engine.plan import plan_serve
from omni_dp.engine.server import ReplicaServer, State, bind_socket
from omni_dp.engine.speech_stream import SentenceBuffer
from omni_dp.engine.voice.phonemes import split_sentences

from support.recognizer import require_voice
from support.speech_stream import (
    Heard,
    StandInReplica,
    pieces,
    read_until,
    send_done,
    send_text,
)
from support.wait import until

TEXT = ("The first sentence is here. Then comes a second one! Is this the third? "
        "The last has no end")
PCM = {"type": "session.config", "response_format": "pcm", "voice": "alloy"}


def ws_url(replica) -> str:
    return replica.url + "/v1/audio/speech/stream"


def run(coro, timeout: float = 90.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def test_the_sentences_are_the_splitters_however_the_text_is_cut():
    """Whatever pieces the text arrives in (mid-word, mid-space, one character at a time),
    the sentences and their spans are split_sentences() of the whole text, each given as
    soon as whitespace follows its terminator, the rest at the flush."""
    text = "  One. Two!  Three?\nA 3.5 km walk... then  four. Last one  "
    rng = random.Random(7)
    for _ in range(200):
        buffer, got, at = SentenceBuffer(), [], 0
        while at < len(text):
            size = rng.randint(1, 6)
            got += buffer.add(text[at:at + size])
            at += size
        got += buffer.flush()
        assert [s.text for s in got] == split_sentences(text)
        assert all(text[s.start:s.end] == s.text for s in got)
        assert [s.index for s in got] == list(range(len(got)))
    buffer = SentenceBuffer()
    assert buffer.add("One. Tw") and not buffer.add("o.") and buffer.add(" ")


def test_pieces_in_sentences_out_in_order_as_each_completes(replica):
    """The first sentence is spoken before the rest of the text is sent (it arrives as an
    LLM writes it, mid-word pieces); every sentence in order, its text and span the input's;
    input.done flushes the last (no terminator) and ends the session with a normal close."""
    first_end = TEXT.index("! ") + 2  # the second sentence completes once its space is in

    async def main():
        heard = Heard()
        async with aiohttp.ClientSession() as session, session.ws_connect(ws_url(replica)) as ws:
            await ws.send_str(json.dumps({**PCM, "stream_audio": True}))
            for piece in pieces(TEXT[:first_end], 5):
                await send_text(ws, piece)
            # Two sentences are complete: both are spoken with no more text and no done.
            await read_until(ws, heard, "audio.start")
            while len(heard.of("audio.done")) < 2:
                await read_until(ws, heard, "audio.done")
            before_done = list(heard.events)
            for piece in pieces(TEXT[first_end:], 3):
                await send_text(ws, piece)
            await ws.send_str(json.dumps({"type": "input.done"}))
            await read_until(ws, heard, None)
        return heard, before_done

    heard, before_done = run(main())
    expected = split_sentences(TEXT)
    assert len(expected) == 4
    assert [e["sentence_text"] for e in before_done if e["type"] == "audio.start"] == \
        expected[:2]
    starts = heard.of("audio.start")
    assert [e["sentence_text"] for e in starts] == expected
    assert [e["sentence_index"] for e in starts] == [0, 1, 2, 3]
    for event in starts:
        assert TEXT[event["text_start"]:event["text_end"]] == event["sentence_text"]
        assert event["format"] == "pcm" and event["sample_rate"] > 0
    dones = heard.of("audio.done")
    assert [e["sentence_index"] for e in dones] == [0, 1, 2, 3]
    for done in dones:
        index = done["sentence_index"]
        assert done["error"] is False
        assert done["total_bytes"] == len(heard.audio[index]) > 0
        assert done["total_bytes"] % 2 == 0
    assert heard.events[-1] == {"type": "session.done", "total_sentences": 4}
    assert heard.close_code == 1000
    assert not heard.of("error")


def test_a_bad_message_is_an_error_naming_its_field_and_the_session_goes_on(replica):
    """Malformed messages are answered with an error naming the field and dropped; the
    session still speaks what it was given. A bad session.config ends the session (1008)
    naming the field, as POST's 400 does; a plain GET is told to upgrade (426)."""

    async def main():
        heard, configs = Heard(), {}
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(ws_url(replica)) as ws:
                await ws.send_str(json.dumps(PCM))
                for bad in ("{not json", json.dumps({"type": "input.text", "text": 5}),
                            json.dumps({"type": "input.txt", "text": "x"}),
                            json.dumps({"type": "input.text", "text": "x", "lang": "en"})):
                    await ws.send_str(bad)
                    await read_until(ws, heard, "error")
                await send_text(ws, "Still spoken.")
                await ws.send_str(json.dumps({"type": "input.done"}))
                await ws.send_str(json.dumps({"type": "input.text", "text": "late"}))
                await read_until(ws, heard, None)
            for name, config in (("voice", {"voice": "nobody"}),
                                 ("response_format", {"response_format": "ogg"}),
                                 ("input", {"input": "text goes in input.text"}),
                                 ("type", None)):
                got = Heard()
                async with session.ws_connect(ws_url(replica)) as ws:
                    first = ({"type": "session.config", **config} if config is not None
                             else {"type": "input.text", "text": "no config first"})
                    await ws.send_str(json.dumps(first))
                    await read_until(ws, got, None)
                configs[name] = got
            async with session.get(ws_url(replica)) as resp:
                plain = resp.status, await resp.json()
        return heard, configs, plain

    heard, configs, plain = run(main())
    errors = heard.of("error")
    assert [e["field"] for e in errors[:4]] == ["message", "text", "type", "lang"]
    assert "input.done" in errors[4]["message"] and errors[4]["field"] == "type"
    assert [e["sentence_text"] for e in heard.of("audio.start")] == ["Still spoken."]
    assert heard.of("session.done") == [{"type": "session.done", "total_sentences": 1}]
    assert heard.close_code == 1000
    for name, got in configs.items():
        (error,) = got.of("error")
        assert error["field"] == name, (name, error)
        assert got.close_code == 1008, name
        assert not got.of("audio.start")
    assert "unknown voice 'nobody'" in configs["voice"].of("error")[0]["message"]
    assert plain[0] == 426 and "WebSocket" in plain[1]["error"]["message"]


def test_a_client_gone_mid_sentence_leaves_nothing_running(replica):
    """The client hangs up while a long sentence is being synthesized (its audio goes out
    whole at the sentence's end, so only the hang-up can stop it): the replica aborts it at
    once, its KV pages freed and no more tokens sampled, well before the sentence (over 4 s
    of synthesis here) would have been done."""
    long_sentence = "This sentence is long enough to keep the talker busy for a while " * 12

    def running() -> float:
        return replica.metric("omni_dp_requests_running")

    def idle() -> bool:
        return running() == 0 and replica.metric("omni_dp_kv_pages_used") == 0

    async def main():
        heard = Heard()
        async with aiohttp.ClientSession() as session:
            ws = await session.ws_connect(ws_url(replica))
            await ws.send_str(json.dumps(PCM))
            await send_text(ws, long_sentence.strip() + ". ")
            await read_until(ws, heard, "audio.start")
            deadline = time.monotonic() + 10
            while running() == 0:  # it is being synthesized
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            await ws.close()
            gone = time.monotonic()
            while not idle():
                # 3 s: well inside the sentence's 4 s and more of synthesis, with room for a
                # machine whose other cores run other tests' replicas
                assert time.monotonic() - gone < 3.0, "the sentence was not cancelled"
                await asyncio.sleep(0.05)
            tokens = replica.metric("omni_dp_generated_tokens_total")
            await asyncio.sleep(0.5)
            return tokens, replica.metric("omni_dp_generated_tokens_total"), heard

    tokens, later, heard = run(main())
    assert later == tokens  # nothing sampled for it after it was cancelled
    assert not heard.of("audio.done")


def test_the_voice_speaks_a_session_sentence_by_sentence():
    """The trained voice (joe) behind the same route, its server in this process (the graph
    loads in a fraction of a second): two sentences in pieces, each spoken as it completes."""
    require_voice()
    text = "Good morning to you. The voice speaks as the text comes in."

    async def main():
        server = ReplicaServer(plan_serve(ServeOptions(model="joe", device="cpu", threads=1)))
        sock = bind_socket("127.0.0.1", 0)
        running = asyncio.create_task(server.run(sock))
        heard = Heard()
        try:
            while server.state == State.STARTING and not running.done():
                await asyncio.sleep(0.05)
            assert server.state == State.READY, server.state
            url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1/audio/speech/stream"
            async with aiohttp.ClientSession() as session, session.ws_connect(url) as ws:
                await ws.send_str(json.dumps({"type": "session.config",
                                              "response_format": "pcm"}))
                for piece in pieces(text[:21], 4):
                    await send_text(ws, piece)
                await read_until(ws, heard, "audio.done")  # before the rest is sent
                for piece in pieces(text[21:], 4):
                    await send_text(ws, piece)
                await ws.send_str(json.dumps({"type": "input.done"}))
                await read_until(ws, heard, None)
        finally:
            server._on_signal(signal.SIGTERM)
            await asyncio.wait_for(running, 30)
        return heard

    heard = run(main(), timeout=60)
    assert [e["sentence_text"] for e in heard.of("audio.start")] == split_sentences(text)
    assert all(len(heard.audio[i]) > 2000 for i in (0, 1))
    assert heard.events[-1] == {"type": "session.done", "total_sentences": 2}
    assert heard.close_code == 1000


def test_the_timeouts_and_the_bounds_close_the_session():
    """On a stand-in replica (this module's session code over a pipeline the test holds),
    with timeouts of 0.3 s and --max-input-chars 100: no session.config in time, and no
    message in time before input.done, are 1008, the error naming `type`; after input.done the
    client may be silent as long as the speaking takes. A frame over 128 KiB is 1009; so are
    more than --max-input-chars with no sentence end and more than 16 × it waiting to be
    spoken, the error naming `text`. The engine failing as input.done arrives is 1011 (the
    reader, waiting with no timeout after input.done, is ended by the close). Nothing is left
    running after any of them."""

    async def main():
        got = {}
        async with StandInReplica(max_input_chars=100, config_timeout_s=0.3,
                                  idle_timeout_s=0.3) as replica:
            gate = replica.pipeline.gate

            async def session(name: str, *messages) -> None:
                heard = got[name] = Heard()
                async with aiohttp.ClientSession() as http, \
                        http.ws_connect(replica.url + "/v1/audio/speech/stream") as ws:
                    for message in messages:
                        if callable(message):
                            await message(ws, heard)
                        else:
                            await ws.send_str(json.dumps(message))
                    started = time.monotonic()
                    await read_until(ws, heard, None, timeout=3)
                    heard.events.append({"type": "waited", "s": time.monotonic() - started})
                await until(replica.idle, 2.0, f"{name}: the stand-in's sessions ended")

            async def outlast_idle(ws, heard):  # input.done, then a sentence held past 0.3 s
                gate.clear()
                await send_text(ws, "Held past the idle timeout. ")
                await send_done(ws)
                await read_until(ws, heard, "audio.start")
                await asyncio.sleep(0.6)
                gate.set()

            async def over_16x(ws, heard):  # the first sentence held: the rest wait
                gate.clear()
                for _ in range(18):
                    await send_text(ws, "x" * 95 + ". ")
                await read_until(ws, heard, None, timeout=3)
                gate.set()

            def send_raw(raw: str):  # a frame, not a message: taken, it would be an error
                async def send(ws, heard):
                    await ws.send_str(raw)
                return send

            await session("config")
            await session("idle", PCM, {"type": "input.text", "text": "Hi. "})
            await session("after_done", PCM, outlast_idle)
            await session("frame", PCM, send_raw("x" * (128 * 1024 + 1)))
            await session("sentence", PCM, {"type": "input.text", "text": "b" * 101})
            await session("buffered", PCM, over_16x)
            replica.pipeline.fail = True  # the engine fails as input.done arrives
            await session("failed", {**PCM, "stream_audio": True},
                          {"type": "input.text", "text": "One. Two. "}, {"type": "input.done"})
        return got

    got = run(main(), timeout=30)
    for name in ("config", "idle"):
        (error,) = got[name].of("error")
        assert got[name].close_code == 1008, name
        assert error["field"] == "type" and "no message for 0.3 s" in error["message"], error
        assert got[name].events[-1]["s"] < 1.0, got[name].events  # the timeout, not later
    assert [e["sentence_index"] for e in got["idle"].of("audio.done")] == [0]
    after_done = got["after_done"]
    assert after_done.close_code == 1000 and not after_done.of("error")
    assert after_done.of("session.done") == [{"type": "session.done", "total_sentences": 1}]
    assert got["frame"].close_code == 1009 and not got["frame"].events[:-1]
    (error,) = got["failed"].of("error")
    assert got["failed"].close_code == 1011 and "engine failed" in error["message"]
    for name, words in (("sentence", "101 characters with no sentence end"),
                        ("buffered", "the bound is 1600 (16 × --max-input-chars)")):
        (error,) = got[name].of("error")
        assert got[name].close_code == 1009, name
        assert error["field"] == "text" and words in error["message"], error


def test_only_the_sessions_first_sentence_opens_the_answer():
    """A long first sentence is spoken in clause-sized pieces (time to first audio); a later
    one, complete before it is asked for while the one before it plays, is asked whole."""

    async def main():
        async with StandInReplica() as replica, aiohttp.ClientSession() as http, \
                http.ws_connect(replica.url + "/v1/audio/speech/stream") as ws:
            await ws.send_str(json.dumps(PCM))
            await send_text(ws, "One, two, three. Four, five, six. Seven.")
            await send_done(ws)
            await read_until(ws, Heard(), None, timeout=10)
            return [(ask.input, ask.opens_answer) for ask in replica.pipeline.asks]

    assert run(main()) == [("One, two, three.", True), ("Four, five, six.", False),
                           ("Seven.", False)]
