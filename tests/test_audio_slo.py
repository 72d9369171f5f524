"""The playback meter (omni_dp/audio_slo.py) on hand-made timelines, with exact numbers, and the
Prometheus families it reports into (omni_dp/audio_slo_metrics.py)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from omni_dp.audio_slo import CONTINUITY_THRESHOLDS_MS, PlaybackMeter, PlaybackReport
from omni_dp.audio_slo_metrics import AudioSloMetrics, MeteredAnswer


def feed(meter: PlaybackMeter, timeline) -> list[float | None]:
    return [meter.add(at, seconds) for at, seconds in timeline]


def test_a_stream_faster_than_real_time_has_no_underrun():
    meter = PlaybackMeter(start=10.0)
    # 0.5 s of audio every 0.25 s from 10.2: the buffer only grows.
    intervals = feed(meter, [(10.2, 0.5), (10.45, 0.5), (10.7, 0.5), (10.95, 0.5)])
    assert intervals == [None, pytest.approx(0.25), pytest.approx(0.25), pytest.approx(0.25)]
    report = meter.report()
    assert report.ttfa == pytest.approx(0.2)
    assert report.e2e == pytest.approx(0.95)
    assert report.duration == pytest.approx(2.0)
    assert report.rtf == pytest.approx(0.475)
    assert report.underrun == 0.0
    assert all(report.continuity_ok(ms) for ms in CONTINUITY_THRESHOLDS_MS)


def test_the_largest_stall_is_the_underrun_and_playback_restarts_at_the_arrival():
    meter = PlaybackMeter(start=0.0)
    feed(meter, [
        (1.0, 0.5),   # plays 1.0-1.5
        (1.8, 0.5),   # 0.3 s stall; plays 1.8-2.3
        (2.0, 1.0),   # buffered: plays 2.3-3.3
        (3.45, 0.2),  # 0.15 s stall: smaller than the first
        (4.35, 0.1),  # 3.65 ran out: 0.7 s stall, the largest
        (4.40, 0.1),  # buffered (runs to 4.45, then 4.55)
    ])
    report = meter.report()
    assert report.underrun == pytest.approx(0.7)
    assert report.ttfa == pytest.approx(1.0)
    assert report.e2e == pytest.approx(4.4)
    assert report.duration == pytest.approx(2.4)
    assert report.rtf == pytest.approx(4.4 / 2.4)
    assert not report.continuity_ok(100)
    assert not report.continuity_ok(500)


def test_the_stall_is_measured_from_the_buffer_not_the_previous_chunk():
    """A chunk 1 s after the previous one is no underrun when that one held 1.2 s of audio,
    and an arrival exactly when the buffer runs out is none either."""
    meter = PlaybackMeter(start=0.0)
    feed(meter, [(0.1, 1.2), (1.1, 0.1), (1.4, 0.5)])
    assert meter.report().underrun == 0.0  # 1.4 is exactly the end of 0.1+1.2+0.1


@pytest.mark.parametrize(("stall", "ok"), [
    (0.05, {100: True, 200: True, 500: True}),
    (0.1, {100: True, 200: True, 500: True}),  # within: at most the threshold
    (0.15, {100: False, 200: True, 500: True}),
    (0.3, {100: False, 200: False, 500: True}),
    (0.75, {100: False, 200: False, 500: False}),
])
def test_continuity_per_threshold(stall, ok):
    meter = PlaybackMeter(start=0.0)
    feed(meter, [(0.0, 1.0), (1.0 + stall, 1.0)])
    report = meter.report()
    assert report.underrun == pytest.approx(stall)
    assert {ms: report.continuity_ok(ms) for ms in CONTINUITY_THRESHOLDS_MS} == ok


def test_empty_chunks_are_not_audio():
    """The time to first audio is the first NON-EMPTY chunk's: a wav header or an encoder's
    empty output is not audio, and an empty chunk between two is no interval."""
    meter = PlaybackMeter(start=0.0)
    assert feed(meter, [(0.1, 0.0), (0.4, 0.25), (0.5, 0.0), (0.6, 0.25)]) == [
        None, None, None, pytest.approx(0.2)]
    report = meter.report()
    assert report.ttfa == pytest.approx(0.4)
    assert report.duration == pytest.approx(0.5)
    assert report.underrun == 0.0


def test_no_audio_reports_nothing():
    meter = PlaybackMeter(start=0.0)
    feed(meter, [(0.3, 0.0)])
    assert not meter.started
    assert meter.report() == PlaybackReport(None, None, None, None, None)
    assert not meter.report().continuity_ok(500)


def test_a_single_chunk_answer():
    """A buffered (non-streamed) answer is one chunk: TTFA is its e2e, and nothing stalls."""
    meter = PlaybackMeter(start=5.0)
    meter.add(6.5, 3.0)
    assert meter.report() == PlaybackReport(1.5, 1.5, 3.0, 0.5, 0.0)


def test_untimed_audio_gives_ttfa_and_e2e_only():
    """mp3 at the router: bytes that do not map to time still say when audio began and ended."""
    meter = PlaybackMeter(start=0.0, timed=False)
    assert feed(meter, [(0.1, 0.0), (0.2, 1.0), (0.9, 1.0), (3.0, 1.0)]) == [
        None, None, pytest.approx(0.7), pytest.approx(2.1)]
    report = meter.report()
    assert (report.ttfa, report.e2e) == (pytest.approx(0.2), pytest.approx(3.0))
    assert (report.duration, report.rtf, report.underrun) == (None, None, None)


def sample(registry: CollectorRegistry, name: str, **labels) -> float | None:
    return registry.get_sample_value(name, labels)


def test_metered_answers_report_into_the_families():
    registry = CollectorRegistry()
    metrics = AudioSloMetrics("t_audio_", "replica", registry, "to the client")
    labels = {"replica": "r0", "format": "pcm", "priority": "default"}

    done = MeteredAnswer(metrics, "pcm", "default", start=0.0)
    for at, seconds in [(0.2, 0.5), (0.5, 0.5), (1.5, 0.5)]:  # 0.3 s underrun at 1.5
        done.add(at, seconds, "r0")
    done.finish(completed=True, who="r9")  # the first audio's writer labels it, not the last
    cut = MeteredAnswer(metrics, "pcm", "default", start=0.0)
    cut.add(0.1, 0.5, "r0")
    cut.add(3.0, 0.5, "r0")  # a long stall, but the answer is cut: no underrun counted
    cut.finish(completed=False, who="r0")
    cut.finish(completed=True, who="r0")  # only the first end counts

    assert sample(registry, "t_audio_streams_total", outcome="completed", **labels) == 1
    assert sample(registry, "t_audio_streams_total", outcome="interrupted", **labels) == 1
    assert sample(registry, "t_audio_ttfa_seconds_count", **labels) == 2
    assert sample(registry, "t_audio_ttfa_seconds_sum", **labels) == pytest.approx(0.3)
    assert sample(registry, "t_audio_chunk_interval_seconds_count", **labels) == 3
    assert sample(registry, "t_audio_e2e_latency_seconds_sum", **labels) == pytest.approx(1.5)
    assert sample(registry, "t_audio_duration_seconds_sum", **labels) == pytest.approx(1.5)
    assert sample(registry, "t_audio_real_time_factor_sum", **labels) == pytest.approx(1.0)
    assert sample(registry, "t_audio_underrun_seconds_count", **labels) == 1
    assert sample(registry, "t_audio_underrun_seconds_sum", **labels) == pytest.approx(0.3)
    assert sample(registry, "t_audio_continuity_ok_total", threshold_ms="100", **labels) == 0
    assert sample(registry, "t_audio_continuity_ok_total", threshold_ms="200", **labels) == 0
    assert sample(registry, "t_audio_continuity_ok_total", threshold_ms="500", **labels) == 1
    assert sample(registry, "t_audio_streams_total", outcome="completed", replica="r9",
                  format="pcm", priority="default") is None


def test_an_answer_without_audio_is_labelled_by_who_finished_it():
    registry = CollectorRegistry()
    metrics = AudioSloMetrics("t_audio_", "replica", registry, "to the client")
    answer = MeteredAnswer(metrics, "mp3", "bulk", start=0.0, timed=False)
    answer.add(0.5, 0.0, "r0")  # no audio in it: the answer is still unlabelled
    answer.finish(completed=False, who="r1")
    labels = {"replica": "r1", "format": "mp3", "priority": "bulk"}
    assert sample(registry, "t_audio_streams_total", outcome="interrupted", **labels) == 1
    # its thresholds exist, at 0, from the series' first use
    assert sample(registry, "t_audio_continuity_ok_total", threshold_ms="200", **labels) == 0


def test_a_tally_adds_what_observe_would_have():
    """Tally writes prometheus-client's private histogram fields: the exposition must be the
    one per-value observe() gives, bounds and +Inf included."""
    bounds = (0.01, 0.1, 1.0)
    values = [0.0, 0.01, 0.0100001, 0.05, 0.1, 0.7, 1.0, 3.5, 1e9]
    observed, tallied = CollectorRegistry(), CollectorRegistry()
    from prometheus_client import Histogram
    from prometheus_client.exposition import generate_latest

    from omni_dp.audio_slo_metrics import Tally

    one = Histogram("h", "h", ["a"], buckets=bounds, registry=observed).labels("x")
    for value in values:
        one.observe(value)
    tally = Tally((*bounds, float("inf")))
    for value in values:
        tally.observe(value)
    tally.add_to(Histogram("h", "h", ["a"], buckets=bounds, registry=tallied).labels("x"))

    def exposition(registry) -> list[bytes]:
        return [line for line in generate_latest(registry).splitlines()
                if b"_created" not in line]  # a timestamp of each child's creation

    assert exposition(tallied) == exposition(observed)
