"""The overlap arithmetic of `verify-mps --overlap` (omni_dp/mps/overlap.py), on synthetic
intervals: what a GPU run would send, without one."""

from __future__ import annotations

import random

import pytest

from omni_dp.mps.overlap import (
    CANNOT_CHECK,
    DEFAULT_MIN_SHARE,
    FAIL,
    PASS,
    independent_share,
    merge,
    overlap_share,
    sweep,
)


def steps(start: float, count: int, busy: float, period: float) -> list[tuple[float, float]]:
    """`count` steps of `busy` seconds, one every `period`, from `start`."""
    return [(start + k * period, start + k * period + busy) for k in range(count)]


def test_replicas_that_only_take_turns_fail():
    """Time slicing: one replica's step, then the other's, never both."""
    a = steps(0.0, 200, 0.004, 0.008)
    b = steps(0.004, 200, 0.004, 0.008)  # each starts as the other's ends
    report = overlap_share({"0": a, "1": b})
    assert report.result == FAIL, report.reason
    assert report.share == pytest.approx(0.0, abs=1e-9)
    assert report.union_s == pytest.approx(1.6)
    assert report.busy_s == pytest.approx({"0": 0.8, "1": 0.8})
    assert report.independent_share == pytest.approx(1 / 3)  # f = 0.5 each: this would show
    assert "take turns" in report.reason


def test_alternation_with_timing_jitter_still_fails():
    rng = random.Random(7)
    a = steps(0.0, 300, 0.004, 0.008)
    b = [(s + rng.uniform(-2e-5, 2e-5), e + rng.uniform(-2e-5, 2e-5))
         for s, e in steps(0.004, 300, 0.004, 0.008)]
    report = overlap_share({"0": a, "1": b})
    assert report.result == FAIL
    assert report.share < 0.01


def test_fully_concurrent_replicas_pass():
    a = steps(0.0, 100, 0.009, 0.01)
    report = overlap_share({"0": a, "1": list(a), "2": list(a)})
    assert report.result == PASS, report.reason
    assert report.share == pytest.approx(1.0)
    assert report.together_s == pytest.approx(report.union_s) == pytest.approx(0.9)


def test_partial_overlap_is_measured_exactly():
    # a busy [0, 3), b busy [2, 5): together 1 s of a 5 s union
    report = overlap_share({"a": [(0.0, 3.0)], "b": [(2.0, 5.0)]})
    assert (report.union_s, report.together_s) == (5.0, 1.0)
    assert report.share == pytest.approx(0.2)
    assert report.result == PASS  # the threshold itself passes
    below = overlap_share({"a": [(0.0, 3.0)], "b": [(2.5, 5.5)]})
    assert below.share == pytest.approx(0.5 / 5.5)
    assert below.result == FAIL
    stricter = overlap_share({"a": [(0.0, 3.0)], "b": [(2.0, 5.0)]}, min_share=0.3)
    assert stricter.result == FAIL and stricter.min_share == 0.3


def test_a_replicas_own_overlapping_steps_count_once():
    """Its talker and vocoder overlap each other: that is not two replicas at once."""
    talker = steps(0.0, 100, 0.006, 0.01)
    vocoder = steps(0.003, 100, 0.004, 0.01)
    other = steps(0.005, 100, 0.005, 0.01)
    report = overlap_share({"0": talker + vocoder, "1": other})
    assert report.busy_s["0"] == pytest.approx(100 * 0.007)
    alone = overlap_share({"0": talker + vocoder})
    assert alone.result == CANNOT_CHECK and alone.together_s == 0.0
    # [0, 7) ms against [5, 10) ms of each 10 ms: 2 ms together
    assert report.together_s == pytest.approx(100 * 0.002)


def test_no_or_one_busy_replica_cannot_be_checked():
    for given in ({}, {"0": []}, {"0": steps(0, 50, 0.004, 0.005)},
                  {"0": steps(0, 50, 0.004, 0.005), "1": []}):
        report = overlap_share(given)
        assert report.result == CANNOT_CHECK, given
        assert "two are needed" in report.reason


def test_too_little_busy_time_cannot_be_checked():
    report = overlap_share({"0": [(0.0, 0.01)], "1": [(0.0, 0.01)]})
    assert report.result == CANNOT_CHECK
    assert "less than the 50 ms" in report.reason


def test_replicas_too_idle_to_tell_are_not_a_fail():
    """Busy 5% of a 10 s load each: independent replicas would rarely overlap either."""
    a = steps(0.0, 100, 0.005, 0.1)
    b = steps(0.05, 100, 0.005, 0.1)
    report = overlap_share({"0": a, "1": b}, window=(0.0, 10.0))
    assert report.independent_share < DEFAULT_MIN_SHARE
    assert report.result == CANNOT_CHECK and "too idle" in report.reason
    # the same steps over their own span (about as long): still too idle
    assert overlap_share({"0": a, "1": b}).result == CANNOT_CHECK


def test_unsorted_input_gives_the_sorted_answer():
    a = steps(0.0, 50, 0.006, 0.01)
    b = steps(0.002, 50, 0.006, 0.01)
    shuffled_a, shuffled_b = a[:], b[:]
    random.Random(3).shuffle(shuffled_a)
    random.Random(4).shuffle(shuffled_b)
    assert overlap_share({"0": shuffled_a, "1": shuffled_b}) == overlap_share({"0": a, "1": b})


def test_zero_length_intervals_are_no_busy_time():
    a = [(1.0, 1.0), (2.0, 2.0)]
    b = [(1.0, 1.0)]
    report = overlap_share({"0": a, "1": b})
    assert report.union_s == 0.0 and report.share is None
    assert report.result == CANNOT_CHECK
    assert merge([(0.0, 1.0), (1.0, 1.0), (1.0, 2.0)]) == [(0.0, 2.0)]


def test_intervals_that_only_touch_do_not_overlap():
    assert sweep([[(0.0, 1.0)], [(1.0, 2.0)]]) == (2.0, 0.0)


def test_an_interval_that_ends_before_it_starts_is_refused():
    with pytest.raises(ValueError, match="not an interval"):
        overlap_share({"0": [(2.0, 1.0)], "1": [(0.0, 3.0)]})
    with pytest.raises(ValueError, match="not an interval"):
        merge([(0.0, float("nan"))])


def test_independent_share_matches_the_closed_form_for_two():
    for f in (0.1, 1 / 3, 0.5, 0.9):
        assert independent_share([f, f]) == pytest.approx(f / (2 - f))
    assert independent_share([0.0, 0.0]) == 0.0
    assert independent_share([1.0, 1.0, 1.0]) == pytest.approx(1.0)


def test_the_report_is_json():
    import json

    report = overlap_share({"0": [(0.0, 1.0)], "1": [(0.5, 1.5)]})
    data = json.loads(json.dumps(report.to_json()))
    assert data["result"] == PASS and data["share"] == pytest.approx(1 / 3)
    assert data["busy_s"] == {"0": 1.0, "1": 1.0}
