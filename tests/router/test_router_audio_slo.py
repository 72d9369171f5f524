"""What the router counts as audio in each chunk it relays (omni_dp/router/audio_slo.py): the
formats it times, the wav header, SSE deltas from their base64 length, and what it leaves."""

from __future__ import annotations

import base64

import pytest
from multidict import CIMultiDict
from prometheus_client import CollectorRegistry

from omni_dp.audio_slo_metrics import AudioSloMetrics
from omni_dp.engine.audio import sse_audio_delta, sse_audio_done, wav_header
from omni_dp.router.audio_slo import RelayedAudio, delta_audio_bytes

RATE = 24_000


@pytest.mark.parametrize("size", [0, 1, 2, 3, 4, 5, 1919, 1920, 4801])
def test_a_deltas_audio_is_its_base64_length_without_decoding(size):
    audio = bytes(range(256)) * (size // 256 + 1)
    event = sse_audio_delta(audio[:size])
    assert delta_audio_bytes(event) == size
    assert len(base64.b64decode(event.split(b'"audio":"')[1].split(b'"')[0])) == size


def test_several_events_sum_and_other_events_count_nothing():
    events = sse_audio_delta(b"x" * 10) + sse_audio_delta(b"y" * 7) + sse_audio_done({})
    assert delta_audio_bytes(events) == 17
    assert delta_audio_bytes(b'data: {"error": {"message": "no"}}\n\n') == 0


def meter(content_type: str, body: bytes = b"{}", *, status: int = 200, rate: str = "24000",
          path: str = "/v1/audio/speech", method: str = "POST"):
    registry = CollectorRegistry()
    metrics = AudioSloMetrics("t_", "replica", registry, "to the client")
    headers = CIMultiDict({"Content-Type": content_type, "X-Sample-Rate": rate})
    return RelayedAudio.of(metrics, method, path, body, status, headers, "bulk", 0.0), registry


def duration(registry, fmt: str) -> float | None:
    return registry.get_sample_value("t_duration_seconds_sum",
                                     {"replica": "r", "format": fmt, "priority": "bulk"})


def test_pcm_is_timed_from_its_bytes():
    audio, registry = meter("audio/pcm")
    audio.wrote(b"\0" * 4800, "r")
    audio.wrote(b"\0" * 48_000, "r")
    audio.finish(True, "r")
    assert duration(registry, "pcm") == pytest.approx(1.1)


def test_wav_is_timed_after_its_header_however_the_writes_cut_it():
    audio, registry = meter("audio/wav")
    header = wav_header(RATE, None)
    audio.wrote(header[:20], "r")  # header bytes alone are no audio: no first audio yet
    assert not audio.answer.meter.started
    audio.wrote(header[20:] + b"\0" * 4800, "r")
    audio.finish(True, "r")
    assert duration(registry, "wav") == pytest.approx(0.1)


def test_sse_is_timed_from_its_deltas_and_wav_inside_skips_the_header():
    audio, registry = meter("text/event-stream", b'{"response_format": "wav"}')
    audio.wrote(sse_audio_delta(wav_header(RATE, None)), "r")
    assert not audio.answer.meter.started
    audio.wrote(sse_audio_delta(b"\0" * 9600) + sse_audio_done({}), "r")
    audio.finish(True, "r")
    assert duration(registry, "sse") == pytest.approx(0.2)


@pytest.mark.parametrize(("content_type", "body", "fmt"), [
    ("audio/mpeg", b"{}", "mp3"),
    ("audio/ogg", b"{}", "opus"),
    ("text/event-stream", b'{"response_format": "opus"}', "sse"),
])
def test_formats_without_time_in_their_bytes_give_ttfa_and_e2e_only(content_type, body, fmt):
    audio, registry = meter(content_type, body)
    audio.wrote(sse_audio_delta(b"\1" * 50) if fmt == "sse" else b"\1" * 50, "r")
    audio.finish(True, "r")
    labels = {"replica": "r", "format": fmt, "priority": "bulk"}
    assert registry.get_sample_value("t_ttfa_seconds_count", labels) == 1
    assert registry.get_sample_value("t_e2e_latency_seconds_count", labels) == 1
    assert registry.get_sample_value("t_duration_seconds_count", labels) == 0
    assert registry.get_sample_value("t_underrun_seconds_count", labels) == 0


@pytest.mark.parametrize("why", ["status", "path", "method", "content_type"])
def test_only_speech_answers_that_begin_are_metered(why):
    audio, _ = meter("application/json" if why == "content_type" else "audio/pcm",
                     status=503 if why == "status" else 200,
                     path="/v1/completions" if why == "path" else "/v1/audio/speech",
                     method="GET" if why == "method" else "POST")
    assert audio is None


def test_pcm_without_a_sample_rate_is_untimed():
    audio, registry = meter("audio/pcm", rate="")
    audio.wrote(b"\0" * 4800, "r")
    audio.finish(True, "r")
    assert registry.get_sample_value("t_ttfa_seconds_count",
                                     {"replica": "r", "format": "pcm", "priority": "bulk"}) == 1
    assert duration(registry, "pcm") == 0


def test_a_removed_replicas_audio_series_go_with_it_and_the_others_stay():
    """The router drops every series of a replica it no longer routes to (RouterMetrics.forget,
    checked by the soak after a scale): its audio series too."""
    from omni_dp.router.metrics import RouterMetrics

    metrics = RouterMetrics(lambda: [])
    for replica in ("1", "2"):
        audio = RelayedAudio.of(metrics.audio, "POST", "/v1/audio/speech", b"{}", 200,
                                CIMultiDict({"Content-Type": "audio/pcm",
                                             "X-Sample-Rate": "24000"}), "bulk", 0.0)
        audio.wrote(b"\0" * 4800, replica)
        audio.finish(True, replica)
    metrics.forget("2")
    text = metrics.exposition().decode()
    audio_lines = [line for line in text.splitlines()
                   if line.startswith("omni_dp_router_audio_")]
    assert not [line for line in audio_lines if 'replica="2"' in line]
    assert [line for line in audio_lines if 'replica="1"' in line]
