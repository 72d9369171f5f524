"""The GPU busy recorder's clock mapping (engine/gpu_busy.py), checked with a stand-in clock,
and a CPU replica's GET /gpu_busy, which says why it times nothing."""

from __future__ import annotations

import json

import pytest
import torch

from omni_dp.engine.gpu_busy import (
    CLOCK_CREEP,
    MAX_PENDING,
    ON_CPU,
    BusyRecorder,
    NotRecording,
    busy_answer,
    recorder_for,
)
from omni_dp.engine.kv_cache import KVCache, plan_kv_cache
from omni_dp.engine.model import Talker
from omni_dp.engine.runner import ModelRunner
from omni_dp.engine.scheduler import Scheduler, TalkerRequest

from support.gpu_clock import FakeGpuClock
from support.http_client import get
from support.talker import CFG, PAGE

OFFSET = 1_000.0  # wall time = GPU time + OFFSET, in these tests


def recorder(clock: FakeGpuClock, **kwargs) -> BusyRecorder:
    return BusyRecorder(clock.event, current_stream=lambda: "stream-0", clock=clock.time,
                        **kwargs)


def step(busy: BusyRecorder, clock: FakeGpuClock, gpu_s: float, wake_up_s: float) -> None:
    """One step of `gpu_s` on the device; the host's wait returns `wake_up_s` after it ends."""
    busy.begin()
    clock.advance(gpu_s)
    busy.end()
    clock.wall = clock.gpu + OFFSET + wake_up_s
    busy.synced()
    clock.advance(0.001)  # the host's bookkeeping before the next step


def test_a_step_maps_to_wall_time_late_by_its_wake_up_only():
    clock = FakeGpuClock(gpu=5.0, wall=5.0 + OFFSET)
    busy = recorder(clock)
    step(busy, clock, 0.004, wake_up_s=0.0002)
    [(start, end)] = busy.snapshot(0)[0]
    assert start == pytest.approx(5.0 + OFFSET + 0.0002, abs=1e-9)
    assert end - start == pytest.approx(0.004, abs=1e-9)
    assert set(clock.streams) == {"stream-0"}  # recorded on the stage's stream


def test_one_prompt_wake_up_bounds_every_later_step():
    """A wait that returned late (another context held the GPU) does not shift its step: the
    earlier, prompt one carried forward is the tighter bound."""
    clock = FakeGpuClock(gpu=0.0, wall=OFFSET)
    busy = recorder(clock)
    step(busy, clock, 0.004, wake_up_s=0.003)
    step(busy, clock, 0.004, wake_up_s=0.00001)
    step(busy, clock, 0.004, wake_up_s=0.002)  # late: carried from the prompt one instead
    intervals = busy.snapshot(0)[0]
    true_starts = [0.0, 0.005, 0.010]
    errors = [start - (true + OFFSET) for (start, _), true in zip(intervals, true_starts,
                                                                  strict=True)]
    assert errors[0] == pytest.approx(0.003, abs=1e-9)  # nothing better known yet
    assert errors[1] == pytest.approx(0.00001, abs=1e-9)
    assert errors[2] == pytest.approx(0.00001, abs=2e-6)  # + the creep over 5 ms
    assert errors[2] >= 0.00001  # an upper bound still
    assert all(end - start == pytest.approx(0.004, abs=1e-9) for start, end in intervals)


def test_a_wall_clock_running_ahead_of_the_gpu_is_followed_within_the_creep():
    """The carried bound grows by CLOCK_CREEP: a GPU clock slower than the wall clock by less
    than that never leaves the estimate below the truth."""
    clock = FakeGpuClock(gpu=0.0, wall=OFFSET)
    busy = recorder(clock)
    drift = CLOCK_CREEP / 2
    for k in range(200):
        busy.begin()
        clock.advance(0.004)
        busy.end()
        true_end = OFFSET + clock.gpu * (1 + drift)
        clock.wall = true_end + (0.00001 if k == 0 else 0.001)  # prompt once, then late
        busy.synced()
        end = busy.snapshot(0)[0][-1][1]
        assert true_end - 1e-9 <= end <= true_end + 0.00001 + CLOCK_CREEP * clock.gpu
        clock.advance(0.001)


def test_steps_without_a_wait_are_resolved_at_the_next_one_in_stream_order():
    clock = FakeGpuClock(gpu=0.0, wall=OFFSET)
    busy = recorder(clock)
    for _ in range(2):  # two steps that end without a wait of their own
        busy.begin()
        clock.advance(0.002)
        busy.end()
        clock.advance(0.001)
    assert busy.snapshot(0)[0] == []  # nothing known of them yet
    step(busy, clock, 0.002, wake_up_s=0.0)
    intervals = busy.snapshot(0)[0]
    assert [(round(s - OFFSET, 6), round(e - OFFSET, 6)) for s, e in intervals] == [
        (0.0, 0.002), (0.003, 0.005), (0.006, 0.008)]


def test_a_cancelled_step_leaves_no_interval_and_events_are_reused():
    clock = FakeGpuClock()
    busy = recorder(clock)
    busy.begin()
    busy.cancel()
    busy.synced()  # a wait with nothing pending: nothing to resolve
    assert busy.snapshot(0) == ([], False)
    for _ in range(50):
        step(busy, clock, 0.003, wake_up_s=0.0001)
    assert len(busy.snapshot(0)[0]) == 50
    assert clock.created <= 4  # recorded again, not created per step


def test_since_filters_and_a_full_deque_says_it_let_intervals_go():
    clock = FakeGpuClock(gpu=0.0, wall=OFFSET)
    busy = recorder(clock, keep=3)
    for _ in range(5):
        step(busy, clock, 0.004, wake_up_s=0.0)
    kept, truncated = busy.snapshot(0)
    assert len(kept) == 3 and truncated  # two older steps were let go
    later, truncated = busy.snapshot(kept[0][0])
    assert later == kept and not truncated  # nothing after `since` was lost
    assert busy.snapshot(kept[-1][1]) == ([], False)


def test_more_pending_steps_than_the_bound_are_counted_lost():
    clock = FakeGpuClock()
    busy = recorder(clock)
    for _ in range(MAX_PENDING + 3):
        busy.begin()
        clock.advance(0.001)
        busy.end()
    step(busy, clock, 0.001, wake_up_s=0.0)
    assert busy.lost == 4  # the bound counts the open step too
    assert len(busy.snapshot(0)[0]) == MAX_PENDING


def test_the_talker_step_is_bracketed_around_its_one_wait():
    """A real runner on the CPU with the stand-in recorder: one interval per executed step."""
    torch.set_num_threads(1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        talker = Talker(CFG).eval()
    spec = plan_kv_cache(num_layers=CFG.num_layers, num_kv_heads=CFG.num_kv_heads,
                         head_dim=CFG.head_dim, dtype=torch.float32, page_size=PAGE,
                         max_total_tokens=8 * PAGE)
    runner = ModelRunner(talker, KVCache(spec, torch.device("cpu")), torch.device("cpu"))
    assert isinstance(runner.busy, NotRecording) and runner.busy.why == ON_CPU
    clock = FakeGpuClock()
    runner.busy = recorder(clock)
    scheduler = Scheduler(spec, end_of_audio=CFG.end_of_audio, max_running_requests=2)
    prompt = [CFG.first_speaker_id, CFG.bos_text_id, 7, 8, 9]
    scheduler.add_request(TalkerRequest("a", prompt, 3, 1, CFG.first_code_id))
    steps = 0
    while not (output := scheduler.schedule()).is_empty:
        scheduler.update_from_output(output, runner.execute(output))
        steps += 1
    assert steps >= 3
    assert len(runner.busy.snapshot(0)[0]) == steps


def test_the_answer_on_the_cpu_says_why_it_times_nothing():
    cpu = {"talker": recorder_for(torch.device("cpu")),
           "vocoder": recorder_for(torch.device("cpu"))}
    answer = busy_answer("cpu", cpu, 0.0)
    assert (answer["device"], answer["recording"], answer["intervals"]) == ("cpu", False, [])
    assert answer["why"] == ON_CPU
    remote = busy_answer("cpu", {}, 0.0, elsewhere=["talker"])
    assert not remote["recording"] and "stage processes talker" in remote["why"]


def test_the_answer_merges_the_timed_stages_sorted():
    clock = FakeGpuClock(gpu=0.0, wall=OFFSET)
    talker, vocoder = recorder(clock), recorder(clock)
    step(talker, clock, 0.004, wake_up_s=0.0)
    step(vocoder, clock, 0.002, wake_up_s=0.0)
    step(talker, clock, 0.004, wake_up_s=0.0)
    answer = busy_answer("cuda:0", {"vocoder": vocoder, "talker": talker}, 0.0)
    assert answer["recording"] and answer["stages"] == ["talker", "vocoder"]
    starts = [start for start, _ in answer["intervals"]]
    assert len(starts) == 3 and starts == sorted(starts)
    json.dumps(answer)  # a JSON body as it is


def test_a_cpu_replica_answers_gpu_busy_with_why_it_cannot(replica):
    status, _, body = get(replica.url + "/gpu_busy?since=0")
    assert status == 200, body
    answer = json.loads(body)
    assert answer["device"] == "cpu" and answer["recording"] is False
    assert answer["intervals"] == [] and answer["why"] == ON_CPU
    status, _, body = get(replica.url + "/gpu_busy?since=yesterday")
    assert status == 400 and json.loads(body)["error"]["param"] == "since"
