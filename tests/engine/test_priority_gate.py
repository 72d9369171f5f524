"""A voice's sentences by priority class (engine/priority_gate.py): with its one worker busy,
an interactive request's sentence is spoken before the bulk sentences queued before it, and a
sentence cancelled while it waits leaves the queue. The voice's graph is the lookahead tests'
stand-in (`_speak_here` on the worker thread, sentences held until released)."""

from __future__ import annotations

import asyncio

import pytest
from test_voice_lookahead import Worker, pipeline_of, until, voice_plan_of  # noqa: F401

from omni_dp.contract import Priority
from omni_dp.engine.priority_gate import PriorityGate
from omni_dp.engine.voice.preprocess import VoicePrompt, VoiceSpeech


def speech_named(first_id: int, count: int = 1) -> VoiceSpeech:
    """`count` sentences whose ids start with first_id, first_id + 1, … (the worker's name
    for each)."""
    sentences = [[first_id + i, 0, 4, 0, 2] for i in range(count)]
    return VoiceSpeech(VoicePrompt("text", 0, [i for s in sentences for i in s]), sentences,
                       1.0, None)


def test_an_interactive_sentence_is_spoken_before_queued_bulk_ones(voice_plan_of):  # noqa: F811
    worker = Worker(held=(10,))  # the first bulk request's sentence holds the one worker
    pipeline = pipeline_of(voice_plan_of(threads=1), lookahead=0, threads=1, worker=worker)

    async def scenario() -> None:
        pipeline.start()

        async def speak(speech: VoiceSpeech, priority: Priority) -> None:
            async for _ in pipeline.synthesize(speech, priority):
                pass

        asks = [asyncio.create_task(speak(speech_named(10), Priority.BULK))]
        await until(lambda: worker.started == [10])
        for first_id in (20, 30):
            asks.append(asyncio.create_task(speak(speech_named(first_id), Priority.BULK)))
        await until(lambda: pipeline.stats().queue_depth["bulk"] == 2)
        asks.append(asyncio.create_task(speak(speech_named(40), Priority.INTERACTIVE)))
        await until(lambda: pipeline.stats().queue_depth["interactive"] == 1)
        worker.release()
        await asyncio.gather(*asks)

    try:
        asyncio.run(asyncio.wait_for(scenario(), 30))
    finally:
        pipeline.stop()
    # The interactive sentence first once the worker is free, then bulk's in arrival order.
    assert worker.started == [10, 40, 20, 30]
    stats = pipeline.stats()
    assert sum(stats.queue_wait_counts["interactive"]) == 1
    assert sum(stats.queue_wait_counts["bulk"]) == 3
    assert stats.queue_depth == {"interactive": 0, "default": 0, "bulk": 0}


def test_a_sentence_cancelled_while_it_waits_leaves_the_queue():
    async def scenario() -> None:
        gate = PriorityGate(slots=1, share_every=4)
        await gate.acquire(Priority.BULK)  # the one slot
        waiting = asyncio.create_task(gate.acquire(Priority.BULK))
        await asyncio.sleep(0)
        assert gate.depth()["bulk"] == 1
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert gate.depth()["bulk"] == 0
        gate.release()
        assert gate.free == 1
        await gate.acquire(Priority.INTERACTIVE)  # at once: nothing waits

    asyncio.run(asyncio.wait_for(scenario(), 10))
