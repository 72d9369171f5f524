"""The stages of one process and the routes between them (engine/stage_set.py), in-process.

LeastLoaded's choices, the talker → vocoder route with one and with several vocoders (each
request's outputs to one vocoder, in order; bound at its first output, released when it ends),
and StageSet's wiring: which inbox each message goes to. Nothing here starts a process."""

from __future__ import annotations

import threading

import pytest
import torch

from omni_dp.engine.config import PRESETS
from omni_dp.engine.core import Abort, Add, StepOutputs, VocoderWorker
from omni_dp.engine.kv_cache import KVCache, plan_kv_cache
from omni_dp.engine.preprocess import (
    PreprocessError,
    PreprocessLimits,
    SpeechAsk,
    prepare,
)
from omni_dp.engine.runner import ModelRunner
from omni_dp.engine.scheduler import RequestOutput, RequestStatus, TalkerRequest
from omni_dp.engine.stage_set import (
    LeastLoaded,
    PreprocessStage,
    StageModels,
    StageSet,
    VocoderRoute,
)
from omni_dp.engine.vocoder import ChunkSchedule
from omni_dp.engine.weights import seeded_models

from support.wait import wait_for

CFG = PRESETS["tiny"]
CPU = torch.device("cpu")
RUNNING, STOPPED = RequestStatus.RUNNING, RequestStatus.FINISHED_STOPPED
LENGTH, ABORTED = RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED
LIMITS = PreprocessLimits(max_input_chars=2000, max_total_tokens=1024)


def out(request_id: str, code: int | None, status: RequestStatus = RUNNING) -> RequestOutput:
    return RequestOutput(request_id, code, status)


class Capture:
    """A route target that keeps every StepOutputs it is given."""

    def __init__(self) -> None:
        self.steps: list[StepOutputs] = []

    def __call__(self, step: StepOutputs) -> None:
        self.steps.append(step)

    @property
    def outputs(self) -> list[RequestOutput]:
        return [o for step in self.steps for o in step.outputs]

    def requests(self) -> set[str]:
        return {o.request_id for o in self.outputs}


# --- LeastLoaded ------------------------------------------------------------------------------
def test_least_loaded_binds_to_the_target_with_the_fewest_requests():
    policy = LeastLoaded(3)
    policy.loads = [2, 0, 1]
    assert policy.bind() == 1
    assert policy.loads == [2, 1, 1]
    assert policy.bind() == 2  # 1 and 2 tie on load; 1 was just picked, 2 never
    assert policy.loads == [2, 1, 2]


def test_least_loaded_ties_go_to_the_one_picked_longest_ago():
    policy = LeastLoaded(3)
    assert [policy.bind() for _ in range(3)] == [0, 1, 2]
    policy.release(0)
    assert policy.bind() == 0  # the only idle one
    policy.release(0)
    policy.release(1)
    # 0 and 1 are idle; 1 was picked before 0's last pick, so 1 goes first, then 0.
    assert policy.bind() == 1
    assert policy.bind() == 0
    assert policy.loads == [1, 1, 1]


def test_equal_loads_take_turns_when_each_request_ends_before_the_next():
    policy = LeastLoaded(3)
    picks = []
    for _ in range(7):
        picks.append(policy.bind())
        policy.release(picks[-1])
    assert picks == [0, 1, 2, 0, 1, 2, 0]
    assert policy.loads == [0, 0, 0]


def test_release_lowers_the_load_and_makes_the_target_first_again():
    policy = LeastLoaded(2)
    first, second = policy.bind(), policy.bind()
    assert (first, second) == (0, 1)
    policy.release(1)
    assert policy.loads == [1, 0]
    assert policy.bind() == 1  # the least loaded, even though 0 was picked longer ago


def test_a_slow_target_with_long_requests_gets_fewer_new_ones():
    """One request arrives per tick; target 0 takes 8 ticks a request, target 1 takes 1.
    Round-robin would give each half; least-loaded sends most to the fast one."""
    policy = LeastLoaded(2)
    duration = {0: 8, 1: 1}
    ends: list[tuple[int, int]] = []  # (tick it ends, target)
    bound = [0, 0]
    for tick in range(80):
        for end in [e for e in ends if e[0] <= tick]:
            ends.remove(end)
            policy.release(end[1])
        target = policy.bind()
        bound[target] += 1
        ends.append((tick + duration[target], target))
    assert sum(bound) == 80
    assert bound[0] < bound[1] / 4, bound
    assert bound[0] >= 1  # the slow one still serves (it is not starved)


# --- VocoderRoute -----------------------------------------------------------------------------
def test_one_vocoder_gets_every_step_as_is():
    target = Capture()
    route = VocoderRoute([target])
    steps = [StepOutputs([out("a", 1), out("b", 2)]), StepOutputs([out("x", None, ABORTED)]),
             StepOutputs([out("a", None, STOPPED)])]
    for step in steps:
        route(step)
    assert [s is t for s, t in zip(target.steps, steps, strict=True)] == [True] * 3
    assert route.bound == {}


def test_two_vocoders_each_request_all_to_one_target_in_order():
    targets = [Capture(), Capture()]
    route = VocoderRoute(targets)
    sent: dict[str, list[RequestOutput]] = {}
    steps = [
        [out("a", 1)],
        [out("a", 2), out("b", 10)],
        [out("a", 3), out("b", 11), out("c", 20)],
        [out("a", 4, LENGTH), out("b", 12), out("c", 21)],
        [out("b", None, STOPPED), out("c", 22), out("d", 30)],
        [out("c", 23, LENGTH), out("d", 31, LENGTH)],
    ]
    for outputs in steps:
        for o in outputs:
            sent.setdefault(o.request_id, []).append(o)
        route(StepOutputs(outputs))
    where = {}
    for index, target in enumerate(targets):
        for request_id in target.requests():
            assert request_id not in where, f"{request_id} went to two vocoders"
            where[request_id] = index
        for request_id in target.requests():  # all of its outputs, in the talker's order
            assert [o for o in target.outputs if o.request_id == request_id] == sent[request_id]
    # a → 0 (first), b → 1 (least loaded), c → 0 (1:1, and 0 was picked longest ago);
    # d → 1: b finished earlier in d's own step, so 1 holds nothing and 0 still holds c.
    assert where == {"a": 0, "b": 1, "c": 0, "d": 1}
    assert route.bound == {}
    assert route.policy.loads == [0, 0]


def test_a_request_is_bound_at_its_first_output_and_released_when_it_finishes():
    targets = [Capture(), Capture()]
    route = VocoderRoute(targets)
    route(StepOutputs([out("a", 1)]))
    assert route.bound == {"a": 0}
    assert route.policy.loads == [1, 0]
    route(StepOutputs([out("a", 2)]))
    assert route.policy.loads == [1, 0]  # one binding per request, not per output
    route(StepOutputs([out("a", 3, LENGTH)]))
    assert route.bound == {}
    assert route.policy.loads == [0, 0]
    assert [len(t.outputs) for t in targets] == [3, 0]


def test_a_step_goes_to_each_target_as_one_message_and_none_to_an_idle_one():
    targets = [Capture(), Capture(), Capture()]
    route = VocoderRoute(targets)
    route(StepOutputs([out("a", 1), out("b", 2)]))
    assert [len(t.steps) for t in targets] == [1, 1, 0]
    route(StepOutputs([out("a", 3), out("b", 4)]))
    assert [len(t.steps) for t in targets] == [2, 2, 0]


def test_an_aborted_request_that_never_spoke_goes_nowhere():
    targets = [Capture(), Capture()]
    route = VocoderRoute(targets)
    route(StepOutputs([out("never", None, ABORTED)]))
    assert [t.steps for t in targets] == [[], []]  # not even an empty StepOutputs
    assert route.bound == {}
    assert route.policy.loads == [0, 0]
    # ... and it did not take a turn: the next request still goes to target 0.
    route(StepOutputs([out("a", 1)]))
    assert route.bound == {"a": 0}


def test_an_aborted_request_that_spoke_tells_its_own_vocoder_and_is_released():
    targets = [Capture(), Capture()]
    route = VocoderRoute(targets)
    route(StepOutputs([out("a", 1), out("b", 2)]))
    route(StepOutputs([out("b", None, ABORTED)]))
    assert targets[1].outputs[-1] == out("b", None, ABORTED)
    assert targets[0].outputs == [out("a", 1)]
    assert route.bound == {"a": 0}
    assert route.policy.loads == [1, 0]


def test_a_request_finished_at_its_first_output_still_reaches_a_vocoder():
    """End of audio sampled at once: new_code None, FINISHED_STOPPED. Some vocoder must hear
    of it, or the front never gets `done` and the response never ends."""
    targets = [Capture(), Capture()]
    route = VocoderRoute(targets)
    route(StepOutputs([out("a", 1)]))
    route(StepOutputs([out("a", 2), out("quick", None, STOPPED)]))
    assert targets[1].outputs == [out("quick", None, STOPPED)]
    assert route.bound == {"a": 0}
    assert route.policy.loads == [1, 0]


def test_two_real_vocoders_speak_each_request_as_one_does_and_say_done(vocoder):
    """The route in front of two VocoderWorkers gives every request the bytes one worker
    gives it, and `done` for each (the at-once finished one too)."""
    schedule = ChunkSchedule(CFG.vocoder.first_chunk_tokens, CFG.vocoder.chunk_tokens)
    steps = [
        [out("a", 5), out("b", 7)],
        [out("a", 6), out("b", 8), out("quick", None, STOPPED)],
        *[[out("a", 10 + i), out("b", 40 + i)] for i in range(14)],
        [out("a", 99, LENGTH), out("b", None, STOPPED)],
    ]

    def run(count: int) -> dict[str, list[tuple[bytes | None, bool]]]:
        got: dict[str, list[tuple[bytes | None, bool]]] = {}
        lock = threading.Lock()

        def deliver(request_id: str, chunk: bytes | None, done: bool) -> None:
            with lock:
                got.setdefault(request_id, []).append((chunk, done))

        fatal: list[str] = []
        workers = [VocoderWorker(vocoder, schedule, deliver, fatal.append)
                   for _ in range(count)]
        for worker in workers:
            worker.start()
        try:
            route = VocoderRoute([worker.inbox.put for worker in workers])
            for outputs in steps:
                route(StepOutputs(outputs))
        finally:
            for worker in workers:
                worker.stop()
        assert fatal == []
        return got

    one, two = run(1), run(2)
    assert set(two) == {"a", "b", "quick"}
    assert two["quick"] == [(None, True)]
    for request_id in ("a", "b"):
        assert two[request_id][-1] == (None, True)
        audio = b"".join(chunk for chunk, _ in two[request_id][:-1])
        assert audio and audio == b"".join(chunk for chunk, _ in one[request_id][:-1])


# --- PreprocessStage --------------------------------------------------------------------------
def test_the_preprocess_stage_is_prepare_with_its_limits():
    stage = PreprocessStage(CFG, LIMITS)
    ask = SpeechAsk("Hello there.", "nova", speed=2.0)
    assert stage.prepare(ask) == prepare(CFG, ask, LIMITS)
    small = PreprocessStage(CFG, PreprocessLimits(max_input_chars=2000, max_total_tokens=16))
    with pytest.raises(PreprocessError, match="the whole pool holds 16") as caught:
        small.prepare(ask)
    assert caught.value.field == "input"


# --- StageSet ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def models():
    torch.set_num_threads(1)
    return seeded_models(CFG, 0)


def held_models(models, stages: tuple[str, ...]) -> StageModels:
    held = StageModels(CFG, CPU)
    if "vocoder" in stages:
        held.vocoder = models.vocoder
    if "talker" in stages:
        spec = plan_kv_cache(num_layers=CFG.num_layers, num_kv_heads=CFG.num_kv_heads,
                             head_dim=CFG.head_dim, dtype=torch.float32, page_size=16,
                             max_total_tokens=512)
        talker = models.talker.to(dtype=torch.float32)
        held.kv_cache = KVCache(spec, CPU)
        held.talker_runner = ModelRunner(talker, held.kv_cache, CPU)
    return held


def stage_set(models, stages: tuple[str, ...], to_vocoder=None, deliver=None,
              fatal=None) -> StageSet:
    return StageSet(stages, held_models(models, stages), limits=LIMITS, max_running_requests=4,
                    to_vocoder=to_vocoder, deliver=deliver or (lambda *a: None),
                    on_fatal=fatal.append if fatal is not None else (lambda reason: None))


def request(request_id: str, max_new_tokens: int = 4, seed: int = 1) -> TalkerRequest:
    prompt = prepare(CFG, SpeechAsk("Hi.", "alloy"), LIMITS).prompt
    return TalkerRequest(request_id, list(prompt.token_ids), max_new_tokens, seed,
                         CFG.first_code_id)


def test_handle_routes_add_and_abort_to_the_talker_and_steps_to_the_vocoder(models):
    stages = stage_set(models, ("preprocess", "talker", "vocoder"))
    add, abort = Add(request("r")), Abort("r")
    step = StepOutputs([out("r", 1)])
    assert stages.handle(add) and stages.handle(abort) and stages.handle(step)
    assert stages.talker.inbox.get_nowait() is add
    assert stages.talker.inbox.get_nowait() is abort
    assert stages.talker.inbox.empty()
    assert stages.vocoder.inbox.get_nowait() is step
    assert stages.vocoder.inbox.empty()
    assert stages.handle("not a message") is False
    assert stages.handle(object()) is False
    # The edge inside the process is the vocoder's queue itself.
    assert stages.talker.emit == stages.vocoder.inbox.put


def test_a_preprocess_only_set_takes_no_talker_or_vocoder_message(models):
    stages = stage_set(models, ("preprocess",))
    assert stages.preprocess is not None
    assert (stages.talker, stages.vocoder, stages.scheduler) == (None, None, None)
    for message in (Add(request("r")), Abort("r"), StepOutputs([out("r", 1)])):
        assert stages.handle(message) is False


def test_a_vocoder_only_set_takes_steps_only(models):
    stages = stage_set(models, ("vocoder",))
    assert stages.preprocess is None and stages.talker is None
    assert stages.handle(Add(request("r"))) is False
    assert stages.handle(Abort("r")) is False
    step = StepOutputs([out("r", 1)])
    assert stages.handle(step) is True
    assert stages.vocoder.inbox.get_nowait() is step


def test_a_talker_without_its_vocoder_emits_through_to_vocoder(models):
    route = VocoderRoute([Capture(), Capture()])
    stages = stage_set(models, ("talker",), to_vocoder=route)
    assert stages.talker.emit is route
    assert stages.handle(StepOutputs([out("r", 1)])) is False  # no vocoder here
    assert stages.handle(Abort("r")) is True
    with pytest.raises(AssertionError, match="a talker needs a vocoder"):
        stage_set(models, ("talker",))


def finished_in(targets: list[Capture]) -> set[str]:
    return {o.request_id for t in targets for o in list(t.outputs) if o.status.is_finished}


def test_a_running_talker_set_sends_each_request_to_one_of_two_vocoders(models):
    targets = [Capture(), Capture()]
    route = VocoderRoute(targets)
    fatal: list[str] = []
    stages = stage_set(models, ("talker",), to_vocoder=route, fatal=fatal)
    stages.start()
    try:
        stages.handle(Add(request("a", max_new_tokens=5, seed=1)))
        stages.handle(Add(request("b", max_new_tokens=5, seed=2)))

        wait_for("both requests finished",
                 lambda: fatal or finished_in(targets) == {"a", "b"}, 10, 0.02)
    finally:
        stages.stop()
    assert fatal == []
    assert finished_in(targets) == {"a", "b"}
    assert targets[0].requests() | targets[1].requests() == {"a", "b"}
    assert not targets[0].requests() & targets[1].requests()
    for target in targets:
        for request_id in target.requests():
            mine = [o for o in target.outputs if o.request_id == request_id]
            assert mine[-1].status.is_finished
            assert not any(o.status.is_finished for o in mine[:-1])
            assert 1 <= len(mine) <= 5
    assert route.bound == {}
    assert route.policy.loads == [0, 0]
