"""Real voice-agent frameworks, unmodified, against a launched voice run: pipecat's
OpenAITTSService and LiveKit Agents' OpenAI TTS plugin (PyPI, pinned, in the venv that
scripts/setup-agents makes), each pointed at the router's base URL with the run's API key.

What a framework hands on is what its user hears: its audio frames, played at the sample rate
the frames say. Neither framework asks the answer for its rate when it takes `pcm` (pipecat
always, LiveKit when told to): both stamp the bytes with OpenAI's 24 kHz. So a `pcm` served at
another rate is understood still (a little fast and high) but lasts the wrong time, and only a
duration check catches it: the audio each framework hands on, summed over fixed sentences,
must last within 5 % of the same texts' buffered WAVs fetched directly (whose header carries
the true rate), and the recognizer must hear at least 60 % of the words at the believed rate.
The voice's durations vary about 2 % from request to request (its noise is drawn in its graph),
so the sum over six sentences is compared, not each one, against the mean of three rounds.

One launch (one voice replica behind the router) serves every test here; the frameworks run in
one process of the agents venv's python (tests/support/agents_driver.py), which writes what
each handed on as WAVs at the believed rate, and a summary.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import soundfile

from omni_dp.contract import API_KEY_ENV
from omni_dp.engine.options import DEFAULT_MODEL_ENV

from support.http_client import request
from support.launcher import OMNI_DP, Run, describe
from support.recognizer import require_voice, transcribe, word_recall

pytestmark = pytest.mark.slow

AGENTS_PYTHON_ENV = "OMNI_DP_AGENTS_PYTHON"
REQUIRE_AGENTS_ENV = "OMNI_DP_REQUIRE_AGENTS"
DRIVER = Path(__file__).resolve().parent / "support" / "agents_driver.py"
# Everyday sentences, none of them in the recognizer's way (no acronyms, no numbers).
SENTENCES = (
    "Please call me back in the morning.",
    "The weather is very nice today.",
    "I would like a cup of coffee.",
    "Thank you very much for your help.",
    "We will meet at the station after lunch.",
    "She left her keys on the kitchen table.",
)
# What the driver runs: pipecat (pcm, always), LiveKit with its default (mp3, decoded: the
# rate read from the mp3) and LiveKit told to take pcm. LiveKit's streaming mp3 decoder keeps
# the encoder's delay and padding that the mp3's LAME tag says to drop (about 43 ms a request,
# where PyAV decoding the whole file drops them), so its mp3 audio lasts 2 to 3 % longer than
# the WAVs over these sentences: inside 5 %, with less room than pcm's.
FRAMEWORKS = ("pipecat", "livekit", "livekit-pcm")
MIN_RECALL = 0.6
MAX_DURATION_GAP = 0.05
# The six sentences' summed duration spreads about 0.6 % (sd) from one request of each to the
# next; the reference is the mean of three rounds, so that a framework's one round against it
# spreads under 1 %: a right rate stays well inside 5 %, a rate 8 % off well outside.
REFERENCE_ROUNDS = 3
DRIVER_TIMEOUT_S = 500


def agents_python() -> str:
    """The agents venv's python (scripts/setup-agents; scripts/test exports it as
    OMNI_DP_AGENTS_PYTHON); skips without it, fails instead under OMNI_DP_REQUIRE_AGENTS=1."""
    python = os.environ.get(AGENTS_PYTHON_ENV)
    if python and os.access(python, os.X_OK):
        return python
    why = (f"the agent frameworks are not installed (scripts/setup-agents; scripts/test exports "
           f"{AGENTS_PYTHON_ENV}, now {python!r})")
    if os.environ.get(REQUIRE_AGENTS_ENV):
        pytest.fail(f"CI requires the agent frameworks: {why}")
    pytest.skip(why)


# --- the comparison ---------------------------------------------------------------------------


def duration_gap(heard_s: float, reference_s: float) -> float:
    """How far the audio a framework handed on lasts from the same texts' WAVs, as a fraction
    of the WAVs' (negative: shorter). The WAVs' header carries the rate the voice spoke at, so
    they are the truth; the framework's audio lasts samples / the rate its frames claim."""
    assert reference_s > 0, "no reference audio"
    return heard_s / reference_s - 1


def lasts_as_long(heard_s: float, reference_s: float) -> bool:
    return abs(duration_gap(heard_s, reference_s)) <= MAX_DURATION_GAP


def wav_seconds(body: bytes) -> float:
    """A WAV's duration from its own header's rate."""
    info = soundfile.info(io.BytesIO(body))
    return info.frames / info.samplerate


# --- the run and what the frameworks made of it -------------------------------------------------


@dataclass
class VoiceRun:
    run: Run
    key: str
    base_url: str  # the router's OpenAI base URL, as a framework is given it


@pytest.fixture(scope="module")
def voice_run(tmp_path_factory):
    """One voice replica (joe) behind the router, which wants an API key (so each framework
    must send the one it was given); stopped by `omni-dp down` at the end, which must leave
    nothing for the cleanup after it to kill."""
    require_voice()
    agents_python()  # no launch when the frameworks cannot run
    run = Run(tmp_path_factory.mktemp("agents"), replicas=1)
    key = f"agents-{uuid.uuid4().hex}"
    env = {**{k: v for k, v in run.env.items() if k != DEFAULT_MODEL_ENV}, API_KEY_ENV: key}
    try:
        launched = subprocess.run(
            [*OMNI_DP, "launch", "--replicas", "1", "--detach", "--json", "--run-id", run.run_id,
             "--router-port", str(run.router_port), "--base-port", str(run.base_port),
             "--", "--model", "joe"],
            env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
        assert launched.returncode == 0, describe(launched)
        summary = json.loads(launched.stdout)
        assert summary["endpoint"] == run.router_url, summary
        yield VoiceRun(run, key, summary["endpoint"] + "/v1")
        run.run_json()  # the run's processes, remembered for the check below
        down = subprocess.run([*OMNI_DP, "down", run.run_id], env=env, capture_output=True,
                              text=True, timeout=120, stdin=subprocess.DEVNULL)
        assert down.returncode == 0, describe(down)
        assert not run.leftover_pids(), f"left running after down: {run.leftover_pids()}"
        assert not run.listening_ports(), f"still listening: {run.listening_ports()}"
    finally:
        run.cleanup()


@pytest.fixture(scope="module")
def references(voice_run) -> list[list[bytes]]:
    """Each sentence as a buffered WAV, asked of the router directly (with the key; without it
    the router refuses, so the frameworks' audio proves they sent theirs), REFERENCE_ROUNDS
    times over: the yardstick is their mean, so that its own spread does not eat into the 5 %."""
    url = voice_run.run.router_url + "/v1/audio/speech"
    refused = request("POST", url, {"input": SENTENCES[0]}, timeout=60)
    assert refused[0] == 401, refused[2][:300]
    rounds = []
    for _ in range(REFERENCE_ROUNDS):
        bodies = []
        for text in SENTENCES:
            status, headers, body = request(
                "POST", url, {"input": text, "response_format": "wav", "stream": False},
                headers={"Authorization": f"Bearer {voice_run.key}"}, timeout=120)
            assert status == 200 and headers.get("Content-Type") == "audio/wav", body[:300]
            bodies.append(body)
        rounds.append(bodies)
    return rounds


def reference_seconds(rounds: list[list[bytes]]) -> float:
    """The sentences' WAVs, summed, in the mean round."""
    return sum(sum(wav_seconds(body) for body in bodies) for bodies in rounds) / len(rounds)


@pytest.fixture(scope="module")
def handed_on(voice_run, tmp_path_factory) -> dict:
    """The driver's summary: per framework, per sentence, what the frames said and carried."""
    out = tmp_path_factory.mktemp("agents-audio")
    sentences = out / "sentences.json"
    sentences.write_text(json.dumps(SENTENCES))
    env = {**os.environ, "OPENAI_API_KEY": voice_run.key, "NO_PROXY": "127.0.0.1,localhost"}
    done = subprocess.run(
        [agents_python(), str(DRIVER), "--base-url", voice_run.base_url, "--out", str(out),
         "--sentences", str(sentences), *(f"--framework={name}" for name in FRAMEWORKS)],
        env=env, capture_output=True, text=True, timeout=DRIVER_TIMEOUT_S,
        stdin=subprocess.DEVNULL)
    assert done.returncode == 0, describe(done)
    sys.stderr.write(done.stderr[-2000:])
    return json.loads((out / "summary.json").read_text())


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_framework_hands_on_speech_heard_and_as_long_as_the_wavs(framework, handed_on,
                                                                   references):
    """Every sentence came back as mono frames at one claimed rate, with no error; at that
    rate the recognizer hears ≥ 60 % of the words, and the audio lasts, summed over the
    sentences, within 5 % of the WAVs'."""
    spoken = handed_on["frameworks"][framework]["sentences"]
    assert [one["text"] for one in spoken] == list(SENTENCES)
    for one in spoken:
        assert not one["errors"], (one["text"], one["errors"])
        assert len(one["rates"]) == 1 and one["channels"] == [1], one
        assert one["samples"] > 0, one
    got = total = 0
    heard_texts = []
    for one in spoken:
        wav = Path(one["wav"]).read_bytes()
        info = soundfile.info(io.BytesIO(wav))
        assert (info.samplerate, info.frames) == (one["rates"][0], one["samples"]), one
        heard = transcribe(wav)  # at the rate the frames claimed
        n, of = word_recall(one["text"], heard)
        got, total = got + n, total + of
        heard_texts.append(heard)
    heard_s = sum(one["seconds"] for one in spoken)
    reference_s = reference_seconds(references)
    gap = duration_gap(heard_s, reference_s)
    rates = sorted({one["rates"][0] for one in spoken})
    print(f"{framework} ({handed_on['versions']}): rates {rates}; "
          f"{got}/{total} words ({got / total:.0%}); {heard_s:.3f} s against the WAVs' "
          f"{reference_s:.3f} s ({gap:+.1%}); heard {heard_texts}")
    assert got / total >= MIN_RECALL, heard_texts
    assert lasts_as_long(heard_s, reference_s), (
        f"{framework}'s audio lasts {heard_s:.3f} s at the rate its frames claim, the same "
        f"texts' WAVs {reference_s:.3f} s ({gap:+.1%}, more than {MAX_DURATION_GAP:.0%} off): "
        f"the pcm it took is not at the {spoken[0]['rates'][0]} Hz it believes")


def test_the_direct_wavs_are_speech_too(references):
    """The yardstick itself: the WAVs fetched directly are heard (a silent reference would
    make any duration comparison meaningless)."""
    got = total = 0
    for text, body in zip(SENTENCES, references[0], strict=True):
        n, of = word_recall(text, transcribe(body))
        got, total = got + n, total + of
    assert got / total >= MIN_RECALL, (got, total)


def test_a_mislabelled_rate_fails_the_duration_check():
    """The comparison itself, on known numbers: 22,050-Hz samples labelled 24 kHz (what a
    framework that takes the answer's pcm for OpenAI's rate does with a 22,050-Hz voice) last
    8.1 % short of their WAV, and fail; labelled right, or 3 % off (the voice's own spread),
    they pass."""
    samples = 22050 * 10  # ten seconds of the voice, at its true rate
    truth = samples / 22050
    believed = samples / 24000
    assert duration_gap(believed, truth) == pytest.approx(22050 / 24000 - 1)
    assert round(duration_gap(believed, truth), 3) == -0.081
    assert not lasts_as_long(believed, truth)
    assert not lasts_as_long(samples / 20000, truth)  # the other way: labelled too slow
    assert lasts_as_long(samples / 22050, truth)
    assert lasts_as_long(truth * 1.03, truth) and lasts_as_long(truth * 0.97, truth)
    assert not lasts_as_long(truth * 1.06, truth)
