"""The voice pipeline's sentence lookahead, its clause-sized first piece and the input bound,
without a voice: the pipeline's own hooks stand in for the graph (`_speak_here`, a worker
thread's call) and for its stage processes (the group a Speak is sent to; a Spoken comes back
through `_from_stages`, as the inbox's thread hands it over).

What is asserted: with a window of W a request has sentences i+1 … i+W submitted while i
streams, never more, and only its first before the first audio; its chunks come out in order
whatever order they are spoken in; two workers (or two voice processes) are busy at once on
one request, and with W = 0 never; a
hang-up or a cut-off cancels the window (a queued sentence never starts, a stage process's
answer is dropped) and leaves no task; a request still gets its turn behind a long one.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import pytest

from omni_dp.engine.options import OPENAI_MAX_INPUT_CHARS, ServeOptions
from omni_dp.engine.pipeline import RequestCutOff
from omni_dp.engine.plan import ServePlanError, plan_serve
from omni_dp.engine.preprocess import PreprocessError, SpeechAsk
from omni_dp.engine.stage_set import LeastLoaded
from omni_dp.engine.voice import plan as voice_plan
from omni_dp.engine.voice.messages import Speak, Spoken
from omni_dp.engine.voice.phonemes import MAX_PIECE_CHARS, clause_pieces, speech_pieces
from omni_dp.engine.voice.pipeline import VoicePipeline
from omni_dp.engine.voice.preprocess import VoicePreprocess, VoicePrompt, VoiceSpeech

from support.voice_dir import write_voice

ID_MAP = {"_": [0], "^": [1], "$": [2], " ": [3], "a": [4]}
# Long enough that a waiting test fails rather than hangs; never reached when it passes.
PATIENCE_S = 10.0


@pytest.fixture
def voice_plan_of(tmp_path, monkeypatch) -> Callable[..., object]:
    """plan_serve for a Piper-shaped voice directory (an empty graph: never loaded here),
    without espeak-ng or onnxruntime."""
    monkeypatch.setattr(voice_plan, "espeak_problem", lambda: None)
    monkeypatch.setattr(voice_plan, "runtime_problem", lambda device: None)
    directory = tmp_path / "voice"
    write_voice(directory, phoneme_id_map=ID_MAP)

    def planned(**options):
        return plan_serve(ServeOptions(model=str(directory), device="cpu", **options))

    return planned


def speech_of(count: int) -> VoiceSpeech:
    """A request of `count` sentences; sentence i's ids start with i (the fakes answer it)."""
    sentences = [[i, 0, 4, 0, 2] for i in range(count)]
    return VoiceSpeech(VoicePrompt("text", 0, [i for s in sentences for i in s]), sentences,
                       1.0, None)


class Worker:
    """`_speak_here` on the pipeline's worker threads: records when each sentence starts and
    ends and how many run at once; a sentence in `held` waits until released."""

    def __init__(self, seconds: float = 0.0, held: tuple[int, ...] = ()) -> None:
        self.seconds = seconds
        self.lock = threading.Lock()
        self.started: list[int] = []
        self.finished: list[int] = []
        self.running = 0
        self.most_at_once = 0
        self.gates = {index: threading.Event() for index in held}

    def __call__(self, ids: list[int], speech: VoiceSpeech) -> bytes:
        index = ids[0]
        with self.lock:
            self.started.append(index)
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
        try:
            if index in self.gates:
                assert self.gates[index].wait(PATIENCE_S)
            time.sleep(self.seconds)
            return index.to_bytes(2, "little")
        finally:
            with self.lock:
                self.running -= 1
                self.finished.append(index)

    def release(self) -> None:
        for gate in self.gates.values():
            gate.set()


def pipeline_of(plan, *, lookahead: int, threads: int, worker: Worker | None = None):
    pipeline = VoicePipeline(plan.voice, plan.placement, threads=threads,
                             max_input_chars=OPENAI_MAX_INPUT_CHARS, on_fatal=lambda why: None,
                             lookahead=lookahead)
    if worker is not None:
        pipeline._speak_here = worker
    return pipeline


class Group:
    """The stage group of a pipeline whose voice runs in two stage processes: it records each
    message the front sends (the test answers for the processes)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, Speak]] = []

    def spawn(self) -> None:
        pass

    def send(self, endpoint: str, message: Speak) -> None:
        self.sent.append((endpoint, message))


def speaks_elsewhere(pipeline: VoicePipeline) -> list[tuple[str, Speak]]:
    """Turn `pipeline` into one whose voice stage is in two stage processes; returns the list
    its Speaks are sent into."""
    group = Group()
    pipeline.speaks_here, pipeline.group = False, group
    pipeline._voices, pipeline._voice_policy = ["voice-r0", "voice-r1"], LeastLoaded(2)
    return group.sent


async def until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + PATIENCE_S
    while not condition():
        assert time.monotonic() < deadline, "waited too long"
        await asyncio.sleep(0.005)


def sentence_tasks() -> list[asyncio.Task]:
    """The window's tasks still pending on this loop (the pipeline's `_spoken` coroutines)."""
    return [task for task in asyncio.all_tasks()
            if not task.done() and task.get_coro().__qualname__.endswith("._spoken")]


# --- the window ---------------------------------------------------------------------------

@pytest.mark.parametrize(("lookahead", "at_once"), [(2, 2), (0, 1)])
def test_two_workers_speak_one_request_at_once_and_its_chunks_keep_their_order(
        voice_plan_of, lookahead, at_once):
    """With the window, one request keeps both of the replica's voice workers busy; without
    it (0: one sentence at a time, the behaviour before), never more than one."""
    worker = Worker(seconds=0.03)
    pipeline = pipeline_of(voice_plan_of(threads=2), lookahead=lookahead, threads=2,
                           worker=worker)

    async def scenario() -> list[bytes]:
        return [chunk async for chunk in pipeline.synthesize(speech_of(8))]

    try:
        chunks = asyncio.run(scenario())
    finally:
        pipeline.stop()
    assert chunks == [i.to_bytes(2, "little") for i in range(8)]
    assert worker.most_at_once == at_once
    assert pipeline.num_in_flight == 0 and pipeline.stats().num_running == 0


@pytest.mark.parametrize("lookahead", [0, 1, 2, 3])
def test_at_most_the_window_is_spoken_ahead_of_the_sentence_streaming(voice_plan_of,
                                                                       lookahead):
    """A slow reader: while sentence i is out with it, sentences up to i + W have started,
    none after (the PCM a request holds is at most W + 1 sentences')."""
    worker = Worker()
    pipeline = pipeline_of(voice_plan_of(threads=4), lookahead=lookahead, threads=4,
                           worker=worker)

    async def scenario() -> list[int]:
        ahead = []
        async for chunk in pipeline.synthesize(speech_of(10)):
            index = int.from_bytes(chunk, "little")
            wanted = min(index + lookahead, 9)
            await until(lambda wanted=wanted: len(worker.finished) > wanted)
            await asyncio.sleep(0.02)  # room for a sentence past the window to start
            with worker.lock:
                ahead.append(max(worker.started) - index)
        return ahead

    try:
        ahead = asyncio.run(scenario())
    finally:
        pipeline.stop()
    assert ahead == [min(lookahead, 9 - i) for i in range(10)]


def test_voice_processes_are_busy_at_once_and_answers_out_of_order_stream_in_order(
        voice_plan_of):
    """The voice stage in two stage processes (the group faked: each Speak is recorded; the
    Spoken comes back through the inbox's hand-over): the first sentence alone until its
    audio (the cores are its own), then, while it streams, the next two at once, one on each
    process; a later sentence answered first still streams after the earlier one."""
    pipeline = pipeline_of(voice_plan_of(threads=2), lookahead=2, threads=2)
    sent = speaks_elsewhere(pipeline)

    def answer(position: int) -> None:
        speak = sent[position][1]
        pipeline._from_stages(Spoken(speak.sentence_id, speak.ids[0].to_bytes(2, "little")))

    async def scenario() -> tuple[list[bytes], list[int], list[int]]:
        pipeline.start()
        chunks: list[bytes] = []

        async def read() -> None:
            async for chunk in pipeline.synthesize(speech_of(5)):
                chunks.append(chunk)

        reading = asyncio.create_task(read())
        await until(lambda: len(sent) == 1)
        await asyncio.sleep(0.05)
        alone = list(pipeline._voice_policy.loads)  # nothing but sentence 0 before its audio
        answer(0)
        await until(lambda: len(sent) == 3 and len(chunks) == 1)  # 1 and 2, while 0 streams
        busy = list(pipeline._voice_policy.loads)
        answer(2)  # sentence 2 first: nothing may stream before sentence 1
        await asyncio.sleep(0.05)
        assert len(chunks) == 1 and len(sent) == 3
        answer(1)
        await until(lambda: len(sent) == 5)
        answer(3)
        answer(4)
        await asyncio.wait_for(reading, PATIENCE_S)
        return chunks, alone, busy

    chunks, alone, busy = asyncio.run(scenario())
    assert chunks == [i.to_bytes(2, "little") for i in range(5)]
    assert sorted(alone) == [0, 1]
    assert busy == [1, 1], f"one voice process idled: {busy}"
    assert pipeline._answers == {} and pipeline._voice_policy.loads == [0, 0]


def test_a_short_request_waits_behind_a_window_not_behind_a_long_request(voice_plan_of):
    """Fairness with one worker: a long request (12 sentences) is speaking when a one-sentence
    request arrives; the short one's sentence starts after at most the long one's window
    (W + 1 sentences were submitted before it), not after its whole text."""
    lookahead = 2
    worker = Worker(seconds=0.01, held=(0,))
    pipeline = pipeline_of(voice_plan_of(threads=1), lookahead=lookahead, threads=1,
                           worker=worker)
    short = VoiceSpeech(VoicePrompt("s", 0, [99]), [[99, 0, 4, 0, 2]], 1.0, None)

    async def scenario() -> None:
        async def drain(speech: VoiceSpeech) -> None:
            async for _ in pipeline.synthesize(speech):
                pass

        long = asyncio.create_task(drain(speech_of(12)))
        await until(lambda: worker.started == [0])  # held until the short one has asked
        asked = asyncio.create_task(drain(short))
        await until(lambda: pipeline.num_in_flight == 2)
        worker.release()
        await asyncio.wait_for(asyncio.gather(long, asked), PATIENCE_S)

    try:
        asyncio.run(scenario())
    finally:
        pipeline.stop()
    assert worker.started.index(99) <= lookahead + 1, worker.started


# --- ending early -------------------------------------------------------------------------

def test_a_hang_up_cancels_the_window_and_leaves_nothing_running(voice_plan_of):
    """The client gone (the server closes the generator, as its aclosing does): sentence 1,
    running on the only worker, runs to its end (a thread cannot be interrupted); sentence 2,
    queued in the window, never starts; no task of the request is left."""
    worker = Worker(held=(1,))
    pipeline = pipeline_of(voice_plan_of(threads=1), lookahead=2, threads=1, worker=worker)

    async def scenario() -> list[asyncio.Task]:
        chunks = pipeline.synthesize(speech_of(6))
        assert await anext(chunks) == b"\0\0"
        await until(lambda: worker.started == [0, 1])
        await chunks.aclose()
        await asyncio.sleep(0.01)  # the cancelled tasks end on the loop's next turns
        left = sentence_tasks()
        worker.release()
        await until(lambda: worker.finished == [0, 1])
        await asyncio.sleep(0.1)  # room for sentence 2 to start, were it still queued
        return left

    try:
        left = asyncio.run(scenario())
    finally:
        pipeline.stop()
    assert left == []
    assert worker.started == [0, 1]
    assert pipeline.num_in_flight == 0 and pipeline.stats().num_running == 0


def test_a_hang_up_drops_the_stage_processes_answers(voice_plan_of):
    """The voice in stage processes: the window's Speaks were sent; closed, their answers are
    dropped on arrival and their processes' loads given back."""
    pipeline = pipeline_of(voice_plan_of(threads=2), lookahead=2, threads=2)
    sent = speaks_elsewhere(pipeline)

    async def scenario() -> list[asyncio.Task]:
        pipeline.start()
        chunks = pipeline.synthesize(speech_of(6))
        first = asyncio.ensure_future(anext(chunks))
        await until(lambda: len(sent) == 1)
        pipeline._from_stages(Spoken(sent[0][1].sentence_id, b"\0\0"))
        assert await first == b"\0\0"
        assert len(sent) == 3  # sentences 1 and 2 sent while 0 streams
        await chunks.aclose()
        await asyncio.sleep(0.01)
        left = sentence_tasks()  # none waits for its answer any more
        assert pipeline._voice_policy.loads == [0, 0]
        for _, speak in sent[1:]:  # late answers of the cancelled sentences
            pipeline._from_stages(Spoken(speak.sentence_id, b"\1\1"))
        await asyncio.sleep(0.01)
        return left

    assert asyncio.run(scenario()) == []
    assert len(sent) == 3  # sentence 0 and its window; closed while 0 streamed: none after
    assert pipeline._answers == {} and pipeline._voice_policy.loads == [0, 0]


def test_a_cut_off_ends_the_request_at_once_and_cancels_its_window(voice_plan_of):
    """cut_off_all (the drain ran out) while the request waits for a sentence that is still
    being spoken: it ends now with RequestCutOff, not when that sentence is done; the queued
    sentence never starts."""
    worker = Worker(held=(1,))
    pipeline = pipeline_of(voice_plan_of(threads=1), lookahead=2, threads=1, worker=worker)

    async def scenario() -> tuple[float, list[asyncio.Task]]:
        chunks = pipeline.synthesize(speech_of(6))
        await anext(chunks)
        waiting = asyncio.ensure_future(anext(chunks))
        await until(lambda: worker.started == [0, 1])
        await asyncio.sleep(0.05)  # the request now waits for sentence 1, still held
        assert not waiting.done()
        cut_at = time.monotonic()
        pipeline.cut_off_all("the replica stopped")
        with pytest.raises(RequestCutOff, match="the replica stopped"):
            await asyncio.wait_for(waiting, PATIENCE_S)
        took = time.monotonic() - cut_at
        await asyncio.sleep(0.01)
        left = sentence_tasks()
        worker.release()
        await until(lambda: worker.finished == [0, 1])
        await asyncio.sleep(0.1)
        return took, left

    try:
        took, left = asyncio.run(scenario())
    finally:
        pipeline.stop()
    assert took < 1.0 and left == []
    assert worker.started == [0, 1] and pipeline.num_in_flight == 0


def test_the_window_is_a_serve_option_checked_by_the_plan(voice_plan_of):
    assert ServeOptions().voice_lookahead == 2
    assert voice_plan_of(voice_lookahead=0).options.voice_lookahead == 0
    for name in ("voice_lookahead", "voice_first_piece_chars"):
        with pytest.raises(ServePlanError, match=f"--{name.replace('_', '-')} must not be "
                                                 "negative"):
            voice_plan_of(**{name: -1})


# --- the first piece ----------------------------------------------------------------------

LONG_FIRST = ("When the morning came and the sun rose over the quiet hills, we packed our "
              "bags; the road ahead was long — and nobody knew where it would end, or when "
              "we would be home again.")
LATER_LONG = ("After a while the rain stopped, the clouds moved away to the east, and the "
              "whole valley was bright and warm in the afternoon light.")


def test_a_long_first_sentence_is_cut_at_its_clauses_into_pieces_under_the_bound():
    pieces = speech_pieces(f"{LONG_FIRST} {LATER_LONG} Short one.", 80)
    first = pieces[:-2]
    assert len(first) >= 2 and all(len(piece) <= 80 for piece in first), first
    # cut only where the text pauses: each piece but the last ends at a comma, semicolon
    # or the dash (spoken as a comma); the words are the sentence's, in order
    assert [piece[-1] for piece in first[:-1]] == [";", ","], first
    assert first[0].endswith("over the quiet hills, we packed our bags;")
    assert first[1].startswith("the road ahead was long,")
    assert " ".join(first).replace(",", "").split() == \
        LONG_FIRST.replace(",", "").replace(" —", "").split()
    assert first[-1].endswith("home again.")
    # a later sentence over the bound is spoken whole, and so is a short first sentence
    assert len(LATER_LONG) > 80 and pieces[-2:] == [LATER_LONG, "Short one."]
    assert speech_pieces(f"Hello there. {LONG_FIRST}", 80) == ["Hello there.", LONG_FIRST]
    assert speech_pieces(LONG_FIRST, 0) == [LONG_FIRST]  # --voice-first-piece-chars 0


def test_the_first_piece_bound_cuts_between_words_only_where_a_clause_has_no_mark():
    words = " ".join(["word"] * 40) + "."
    pieces = clause_pieces(words, 60)
    assert all(len(piece) <= 60 for piece in pieces) and pieces[-1].endswith("word.")
    assert all(piece.endswith("word,") for piece in pieces[:-1])
    assert " ".join(pieces).replace(",", "").split() == words.split()
    # no cut inside a number, a time or a hyphenated word
    assert clause_pieces("It is well-known that 1,000 people came at 10:30 to see it, all "
                         "of them.", 60) == ["It is well-known that 1,000 people came at "
                                             "10:30 to see it,", "all of them."]


def test_every_sentence_is_cut_under_the_memory_bound_first_or_not():
    """The graph's memory grows with its input: no piece past MAX_PIECE_CHARS, whatever the
    sentence (a 20,000-character input with no full stop stays bounded)."""
    runaway = ", ".join(["and then the story went on"] * 800)
    pieces = speech_pieces(f"Hi. {runaway}.", 80)
    assert pieces[0] == "Hi." and max(len(p) for p in pieces) <= MAX_PIECE_CHARS
    assert len(pieces) > len(runaway) // MAX_PIECE_CHARS


def test_the_preprocess_speaks_the_first_piece_first(voice_plan_of):
    plan = voice_plan_of()
    stage = VoicePreprocess(plan.voice, OPENAI_MAX_INPUT_CHARS, 80)
    checked = stage.check(SpeechAsk(f"{LONG_FIRST} {LATER_LONG}", "alloy"))
    assert checked.sentences == speech_pieces(f"{LONG_FIRST} {LATER_LONG}", 80)
    whole = VoicePreprocess(plan.voice, OPENAI_MAX_INPUT_CHARS, 0)
    assert whole.check(SpeechAsk(LONG_FIRST, "alloy")).sentences == [LONG_FIRST]
    # a speech session's later sentence, asked alone, opens nothing: spoken whole
    later = SpeechAsk(LONG_FIRST, "alloy", opens_answer=False)
    assert stage.check(later).sentences == [LONG_FIRST]


# --- the input bound ----------------------------------------------------------------------

def test_inputs_past_openais_4096_characters_are_a_400_naming_input_and_the_bound(
        voice_plan_of):
    """OpenAI's bound by default, on the voice and the seeded engine alike; the message
    names the bound and the option that raises it."""
    from omni_dp.engine.config import PRESETS
    from omni_dp.engine.preprocess import PreprocessLimits, prepare

    assert ServeOptions().max_input_chars == 4096
    voice = VoicePreprocess(voice_plan_of().voice, ServeOptions().max_input_chars)
    limits = PreprocessLimits(ServeOptions().max_input_chars, max_total_tokens=10**6)
    refusals = [lambda text: voice.check(SpeechAsk(text, "alloy")),
                lambda text: prepare(PRESETS["tiny"], SpeechAsk(text, "alloy"), limits)]
    for refuse in refusals:
        with pytest.raises(PreprocessError) as caught:
            refuse("x" * 4097)
        assert caught.value.field == "input"
        assert "4097 characters" in str(caught.value) and "limit is 4096" in str(caught.value)
        assert "--max-input-chars" in str(caught.value)
    assert voice.check(SpeechAsk("x" * 4096, "alloy")).text == "x" * 4096


def test_max_input_chars_raises_the_bound(voice_plan_of):
    plan = voice_plan_of(max_input_chars=20000)
    stage = VoicePreprocess(plan.voice, plan.options.max_input_chars)
    text = " ".join(["A sentence of the long input."] * 680)[:20000]
    assert len(stage.check(SpeechAsk(text, "alloy")).text) == 20000
    with pytest.raises(PreprocessError, match="limit is 20000"):
        stage.check(SpeechAsk(text + " more", "alloy"))


def test_the_first_piece_bound_reaches_a_preprocess_placed_in_a_stage_process(voice_plan_of):
    """--voice-first-piece-chars travels in the stage process's launch (JSON), and its
    preprocess cuts by it, as the front's does."""
    from omni_dp.engine.server import stage_launch_base
    from omni_dp.engine.stage_launch import StageLaunch
    from omni_dp.engine.voice.stages import VoiceStages

    plan = voice_plan_of(voice_first_piece_chars=40,
                         placement_overrides=(("preprocess.process", "pre"),))
    spec = StageLaunch.from_json(StageLaunch(
        **stage_launch_base(plan), process="pre", stages=("preprocess",), device="cpu",
        inbox="ipc://unused", front="ipc://unused", vocoders=(), log_level="info",
        log_format="text").to_json())
    stages = VoiceStages(spec, outbox=None, fatal=lambda why: None)
    try:
        assert stages.preprocess is not None and stages.preprocess.first_piece_chars == 40
        assert stages.preprocess.check(SpeechAsk(LONG_FIRST, "alloy")).sentences == \
            speech_pieces(LONG_FIRST, 40)
    finally:
        stages.stop()
