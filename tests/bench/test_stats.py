"""The bench's arithmetic, pure: points from requests, levels as ranges over trials, the sweep
that stops where throughput stops rising (or on p99, or on failures), and the verdict."""

from __future__ import annotations

import pytest

from omni_dp.bench.results import ConfigResult, LevelSummary, PointResult, Range, RequestResult
from omni_dp.bench.sampler import Samples
from omni_dp.bench.stats import (
    SaturationSweep,
    percentile,
    summarize_level,
    summarize_point,
    verdict,
)
from omni_dp.bench.workload import BUILTIN_TEXTS, Workload, load_texts, wav_seconds


def ok(latency: float, audio: float = 1.0, replica: str | None = "0") -> RequestResult:
    return RequestResult("ok", 200, latency, latency / 4, audio_s=audio, replica=replica)


def point(concurrency: int, rps: float, *, trial: int = 0, p99: float | None = 0.5,
          failures: dict[str, int] | None = None, requests: int = 100,
          sm: float | None = None, cpu: dict[str, float] | None = None) -> PointResult:
    return PointResult(concurrency, trial, 10.0, requests, requests - sum((failures or {})
                                                                           .values()),
                       failures or {}, rps, rps, 0.0, 0.2, p99, 0.05, 0.3,
                       cpu_util=cpu, gpu_sm_util=sm)


def level(concurrency: int, rps: float, **kw) -> LevelSummary:
    return summarize_level([point(concurrency, rps, **kw)])


# --- percentiles and points -------------------------------------------------------------


def test_percentiles_interpolate_between_ranks():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile(range(1, 101), 99) == pytest.approx(99.01)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_a_point_counts_every_failure_and_rates_only_what_succeeded():
    results = [ok(0.2, replica="0"), ok(0.4, replica="1"), ok(0.6, replica="1"),
               RequestResult("http", 503, 0.01, None, replica=None),
               RequestResult("http", 503, 0.01, None),
               RequestResult("timeout", None, 5.0, None),
               RequestResult("error", 200, 0.1, 0.05)]
    p = summarize_point(results, 2.0, concurrency=4, trial=1,
                        samples=Samples({"replica 0": 0.9}, 0.5, 123))
    assert (p.requests, p.ok) == (7, 3)
    assert p.failures == {"error": 1, "http 503": 2, "timeout": 1}
    assert p.requests_per_s == pytest.approx(1.5)
    assert p.audio_s_per_s == pytest.approx(1.5)
    assert p.latency_p50_s == pytest.approx(0.4)  # of the ok requests only
    assert p.ttfb_p50_s == pytest.approx(0.1)
    assert p.rtf_p50 == pytest.approx(0.4)
    assert p.per_replica == {"0": 1, "1": 2}
    assert (p.cpu_util, p.gpu_sm_util, p.gpu_memory_bytes) == ({"replica 0": 0.9}, 0.5, 123)
    assert (p.concurrency, p.trial, p.duration_s) == (4, 1, 2.0)


def test_a_point_where_everything_failed_has_no_latencies():
    p = summarize_point([RequestResult("timeout", None, 1.0, None)] * 3, 1.0, 1, 0)
    assert p.ok == 0 and p.requests_per_s == 0
    assert p.latency_p99_s is None and p.ttfb_p50_s is None and p.rtf_p50 is None


# --- levels: ranges over trials -----------------------------------------------------------


def test_a_level_is_the_range_of_its_trials_not_the_best_one():
    trials = [point(8, 10.0, trial=0, p99=0.9, failures={"http 503": 1}),
              point(8, 14.0, trial=1, p99=0.5),
              point(8, 11.0, trial=2, p99=None, failures={"http 503": 2, "timeout": 1})]
    summary = summarize_level(trials)
    assert summary.trials == 3 and summary.requests == 300
    assert summary.requests_per_s == Range(10.0, 11.0, 14.0)
    assert summary.latency_p99_s == Range(0.5, 0.7, 0.9)  # the trial without one is left out
    assert summary.failures == {"http 503": 3, "timeout": 1}
    with pytest.raises(ValueError):
        summarize_level([point(8, 1.0), point(16, 1.0)])


# --- the sweep ----------------------------------------------------------------------------


def drive(sweep: SaturationSweep, rates: dict[int, float],
          extra: dict[int, dict] | None = None) -> list[int]:
    """Feed the sweep one single-trial level per concurrency it asks for; the levels it
    measured."""
    measured = []
    while (c := sweep.next_level()) is not None:
        measured.append(c)
        sweep.record(level(c, rates[c], **(extra or {}).get(c, {})))
    return measured


def test_doubling_stops_where_the_median_throughput_stops_rising():
    sweep = SaturationSweep(start=1, maximum=64)
    measured = drive(sweep, {1: 10.0, 2: 19.0, 4: 30.0, 8: 31.0, 16: 99.0})
    assert measured == [1, 2, 4, 8]
    assert sweep.saturation == 4
    assert "stopped rising" in sweep.stop_reason and "concurrency 8" in sweep.stop_reason


def test_a_gain_just_above_min_gain_goes_on():
    sweep = SaturationSweep([1, 2, 4], min_gain=0.05)
    assert drive(sweep, {1: 10.0, 2: 10.6, 4: 10.7}) == [1, 2, 4]
    assert sweep.saturation == 2


def test_the_sweep_stops_when_p99_passes_its_bound():
    sweep = SaturationSweep(start=2, maximum=64, max_p99_s=1.0)
    measured = drive(sweep, {2: 10.0, 4: 20.0, 8: 40.0}, {8: {"p99": 1.5}})
    assert measured == [2, 4, 8]
    assert sweep.saturation == 4  # the last level within the bound
    assert "p99" in sweep.stop_reason and "1 s" in sweep.stop_reason


def test_the_sweep_stops_when_too_many_requests_fail():
    sweep = SaturationSweep([1, 2, 4, 8], max_failure_share=0.05)
    rates = {1: 10.0, 2: 20.0, 4: 40.0}
    measured = drive(sweep, rates, {2: {"failures": {"http 503": 5}},
                                    4: {"failures": {"http 503": 6}}})
    assert measured == [1, 2, 4]  # 5 % is allowed, 6 % is not
    assert sweep.saturation == 2
    assert "6%" in sweep.stop_reason and "http 503" in sweep.stop_reason


def test_a_first_level_that_fails_leaves_no_saturation():
    sweep = SaturationSweep([1, 2])
    drive(sweep, {1: 0.0}, {1: {"failures": {"error": 100}, "p99": None}})
    assert sweep.saturation is None and sweep.done


def test_levels_that_run_out_while_rising_say_so():
    sweep = SaturationSweep([1, 2])
    assert drive(sweep, {1: 1.0, 2: 2.0}) == [1, 2]
    # no saturation found: the report compares at the highest level and says so
    assert sweep.saturation is None and "still rising" in sweep.stop_reason
    doubling = SaturationSweep(start=1, maximum=4)
    assert drive(doubling, {1: 1.0, 2: 2.0, 4: 4.0}) == [1, 2, 4]
    assert "maximum concurrency 4" in doubling.stop_reason and doubling.saturation is None


def test_the_sweep_refuses_a_level_it_did_not_ask_for_and_bad_settings():
    sweep = SaturationSweep([1, 2])
    with pytest.raises(ValueError):
        sweep.record(level(2, 1.0))
    for bad in ([], [2, 1], [0, 1]):
        with pytest.raises(ValueError):
            SaturationSweep(bad)
    with pytest.raises(ValueError):
        SaturationSweep(start=8, maximum=4)


# --- the verdict --------------------------------------------------------------------------


def config(*points: PointResult, saturation: int = 4) -> ConfigResult:
    return ConfigResult("1", 1, False, "ok", None, points, saturation=saturation)


def test_the_gpu_verdict_reads_sm_activity_at_saturation():
    idle = config(point(4, 10, sm=0.35), point(4, 10, trial=1, sm=0.45), point(8, 10, sm=0.99))
    assert verdict(idle).startswith("host-bound: SM activity 40% at saturation (concurrency 4)")
    busy = config(point(4, 10, sm=0.9), point(4, 10, trial=1, sm=0.95))
    assert verdict(busy).startswith("gpu-bound: SM activity 92%")
    assert "will not help" in verdict(busy)
    assert verdict(config(point(4, 10, sm=0.7))).startswith("unknown: SM activity 70%")


def test_the_cpu_verdict_reads_the_busiest_replica_against_its_block():
    host = config(point(4, 10, cpu={"replica 0": 1.0, "replica 1": 0.5, "client": 0.2}))
    assert verdict(host, {"replica 0": 4, "replica 1": 4}).startswith(
        "host-bound: replica 0 used 1.00 of its 4 cores (25%)")
    bound = config(point(4, 10, cpu={"replica 0": 1.9, "client": 0.95}))
    text = verdict(bound, {"replica 0": 2})
    assert text.startswith("compute-bound: replica 0 used 1.90 of its 2 cores (95%)")
    assert "load generator itself used 0.95" in text
    assert verdict(bound).startswith("unknown: replica 0 used 1.90 cores")  # block unknown


def test_no_samples_or_no_saturation_is_unknown():
    assert verdict(config(point(4, 10))).startswith("unknown: neither")
    # not saturated: judged at its highest level, and said so
    unsaturated = verdict(config(point(2, 10, sm=0.9), point(4, 10, sm=0.3), saturation=None))
    assert unsaturated.startswith("host-bound: SM activity 30% at its highest level "
                                  "(concurrency 4, not saturated)")
    assert verdict(config(saturation=None)).startswith("unknown: no saturation")


# --- the workload ---------------------------------------------------------------------------


def test_requests_are_fixed_by_seed_and_index():
    a, b = Workload(seed=3), Workload(seed=3)
    assert [a.request(i) for i in range(50)] == [b.request(i) for i in range(50)]
    assert [a.request(i) for i in range(50)] != [Workload(seed=4).request(i) for i in range(50)]
    assert len({a.request(i)[1]["input"] for i in range(200)}) == len(BUILTIN_TEXTS)
    path, body = a.request(7)
    assert path == "/v1/audio/speech"
    assert body["stream"] is True and body["response_format"] == "pcm"
    assert Workload(kind="speech").request(7)[1] | {"stream": True, "response_format": "pcm"} \
        == Workload(kind="speech-stream").request(7)[1]
    path, body = Workload(kind="completions", model="m", max_tokens=9).request(0)
    assert path == "/v1/completions"
    assert body["stream_options"] == {"include_usage": True}
    assert (body["model"], body["max_tokens"], body["stream"]) == ("m", 9, True)
    with pytest.raises(ValueError):
        Workload(kind="video")


def test_texts_from_a_file_one_per_line(tmp_path):
    good = tmp_path / "texts.txt"
    good.write_text("first line\n\n  second  \n")
    assert load_texts(good) == ("first line", "second")
    blank = tmp_path / "blank.txt"
    blank.write_text("\n \n")
    with pytest.raises(ValueError, match=r"blank\.txt holds no text"):
        load_texts(blank)
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"ok\n\xff\xfe\n")
    with pytest.raises(ValueError, match=r"bin.txt:2: not UTF-8"):
        load_texts(binary)
    long = tmp_path / "long.txt"
    long.write_text("x\n" + "y" * 5000 + "\n")
    with pytest.raises(ValueError, match=r"long.txt:2: 5000 characters"):
        load_texts(long)
    with pytest.raises(ValueError, match="cannot read texts from"):
        load_texts(tmp_path / "missing.txt")


def test_wav_seconds_reads_the_header():
    from support.bench_standin import wav

    assert wav_seconds(wav(bytes(48000), rate=24000)) == pytest.approx(1.0)
    from omni_dp.bench.workload import AnswerError

    with pytest.raises(AnswerError):
        wav_seconds(b"not a wav file at all")
