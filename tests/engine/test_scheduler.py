import pytest
import torch

from omni_dp.engine.config import PRESETS
from omni_dp.engine.kv_cache import plan_kv_cache
from omni_dp.engine.scheduler import (
    AdmissionError,
    RequestStatus,
    Scheduler,
    TalkerRequest,
)

CFG = PRESETS["tiny"]
PAGE = 4


def make_scheduler(num_pages, *, max_running=8, max_prefill_tokens=4096):
    spec = plan_kv_cache(
        num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32, page_size=PAGE,
        max_total_tokens=num_pages * PAGE,
    )
    return Scheduler(
        spec, end_of_audio=CFG.end_of_audio, max_running_requests=max_running,
        max_prefill_tokens=max_prefill_tokens,
    )


def make_request(request_id, prompt_len, max_new_tokens=8):
    prompt = [CFG.first_speaker_id, CFG.bos_text_id, *range(65, 65 + prompt_len - 2)]
    return TalkerRequest(
        request_id=request_id, prompt_ids=prompt[:prompt_len], max_new_tokens=max_new_tokens,
        seed=0, first_code_id=CFG.first_code_id,
    )


def fake_code(request):
    """A code that depends only on the request and how many codes it has: never end-of-audio."""
    return (len(request.output_codes) * 7 + sum(map(ord, request.request_id))) % CFG.codebook_size


def step(scheduler, codes=None):
    """One schedule → fake sample → update round; returns (output, results by id)."""
    output = scheduler.schedule()
    codes = codes or {}
    sampled = [codes.get(item.request.request_id, fake_code(item.request))
               for item in output.scheduled]
    results = scheduler.update_from_output(output, sampled)
    check_invariants(scheduler)
    return output, {r.request_id: r for r in results}


def new_tokens(output):
    return {item.request.request_id: item.num_new_tokens for item in output.scheduled}


def check_invariants(scheduler):
    used = [page for request in scheduler.running for page in request.pages]
    assert len(used) == len(set(used)) == scheduler.allocator.num_used
    assert [r.arrival for r in scheduler.running] == sorted(r.arrival for r in scheduler.running)
    for request in scheduler.running:
        assert request.status == RequestStatus.RUNNING
        assert len(request.pages) >= scheduler.kv_spec.pages_for(request.num_computed_tokens)
    for request in scheduler.waiting:
        assert request.status == RequestStatus.WAITING
        assert request.pages == []


def ids(requests):
    return [r.request_id for r in requests]


# --- token ids ---------------------------------------------------------------------------


def test_token_ids_spans_prompt_and_output_codes():
    request = make_request("r", 5)
    request.output_codes = [3, 0, 9]
    prompt = request.prompt_ids
    code = CFG.first_code_id
    assert request.num_tokens == 8
    assert request.token_ids(0, 5) == prompt
    assert request.token_ids(0, 8) == [*prompt, code + 3, code, code + 9]
    assert request.token_ids(3, 7) == [*prompt[3:], code + 3, code]
    assert request.token_ids(5, 8) == [code + 3, code, code + 9]
    assert request.token_ids(7, 8) == [code + 9]
    assert request.token_ids(2, 4) == prompt[2:4]


# --- admission and batching --------------------------------------------------------------


def test_admits_up_to_max_running_requests_with_whole_prompts():
    scheduler = make_scheduler(64, max_running=3)
    for i, length in enumerate((5, 6, 7, 8, 9)):
        scheduler.add_request(make_request(f"r{i}", length))
    output = scheduler.schedule()
    assert new_tokens(output) == {"r0": 5, "r1": 6, "r2": 7}
    assert ids(scheduler.running) == ["r0", "r1", "r2"]
    assert ids(scheduler.waiting) == ["r3", "r4"]
    assert [len(item.request.pages) for item in output.scheduled] == [2, 2, 2]


def test_one_token_per_request_while_decoding():
    scheduler = make_scheduler(64)
    scheduler.add_request(make_request("a", 5))
    scheduler.add_request(make_request("b", 9))
    step(scheduler)
    for _ in range(3):
        output, results = step(scheduler)
        assert new_tokens(output) == {"a": 1, "b": 1}
        assert set(results) == {"a", "b"}
    assert scheduler.requests["a"].num_computed_tokens == 5 + 3
    assert len(scheduler.requests["a"].output_codes) == 4


def test_requests_join_and_leave_the_running_batch_between_steps():
    scheduler = make_scheduler(64)
    scheduler.add_request(make_request("a", 5, max_new_tokens=3))
    output, _ = step(scheduler)
    assert new_tokens(output) == {"a": 5}

    scheduler.add_request(make_request("b", 6, max_new_tokens=10))
    output, _ = step(scheduler)
    assert new_tokens(output) == {"a": 1, "b": 6}

    output, results = step(scheduler)
    assert new_tokens(output) == {"a": 1, "b": 1}
    assert results["a"].status == RequestStatus.FINISHED_LENGTH

    scheduler.add_request(make_request("c", 4))
    output, _ = step(scheduler)
    assert new_tokens(output) == {"b": 1, "c": 4}
    assert ids(scheduler.running) == ["b", "c"]


def test_waiting_request_is_admitted_when_a_running_slot_frees():
    scheduler = make_scheduler(64, max_running=1)
    scheduler.add_request(make_request("a", 5, max_new_tokens=2))
    scheduler.add_request(make_request("b", 7))
    assert new_tokens(step(scheduler)[0]) == {"a": 5}
    output, results = step(scheduler)
    assert new_tokens(output) == {"a": 1}
    assert results["a"].status.is_finished
    assert new_tokens(step(scheduler)[0]) == {"b": 7}


def test_prefill_budget_limits_admission_but_one_long_prompt_is_allowed():
    scheduler = make_scheduler(64, max_prefill_tokens=10)
    scheduler.add_request(make_request("long", 20))
    scheduler.add_request(make_request("a", 6))
    scheduler.add_request(make_request("b", 6))
    assert new_tokens(step(scheduler)[0]) == {"long": 20}
    assert new_tokens(step(scheduler)[0]) == {"long": 1, "a": 6}
    assert new_tokens(step(scheduler)[0]) == {"long": 1, "a": 1, "b": 6}


# --- finishing ---------------------------------------------------------------------------


def test_end_of_audio_finishes_and_frees_pages():
    scheduler = make_scheduler(16)
    scheduler.add_request(make_request("a", 5))
    scheduler.add_request(make_request("b", 5))
    step(scheduler)
    request = scheduler.requests["a"]
    codes_before = list(request.output_codes)
    assert scheduler.allocator.num_used == 4
    _, results = step(scheduler, codes={"a": CFG.end_of_audio})
    assert results["a"].status == RequestStatus.FINISHED_STOPPED
    assert results["a"].new_code is None
    assert results["b"].status == RequestStatus.RUNNING
    assert request.output_codes == codes_before  # the end token is not an audio code
    assert request.pages == []
    assert "a" not in scheduler.requests
    assert ids(scheduler.running) == ["b"]
    assert scheduler.allocator.num_used == len(scheduler.requests["b"].pages)


def test_max_new_tokens_finishes_and_frees_pages():
    scheduler = make_scheduler(16)
    request = make_request("a", 5, max_new_tokens=4)
    scheduler.add_request(request)
    statuses = [step(scheduler)[1]["a"].status for _ in range(4)]
    assert statuses == [RequestStatus.RUNNING] * 3 + [RequestStatus.FINISHED_LENGTH]
    assert len(request.output_codes) == 4
    assert scheduler.allocator.num_used == 0
    assert not scheduler.has_requests()
    assert scheduler.schedule().is_empty


# --- preemption --------------------------------------------------------------------------


def fill_pool_then_grow():
    """Pool of 3 pages; a (4 tokens), b and d (3 tokens each) take one page each.

    After the first step a holds 5 tokens and needs a second page while none is free.
    """
    scheduler = make_scheduler(3)
    for name, length, max_new in (("a", 4, 2), ("b", 3, 10), ("d", 3, 10)):
        scheduler.add_request(make_request(name, length, max_new))
    output, _ = step(scheduler)
    assert new_tokens(output) == {"a": 4, "b": 3, "d": 3}
    assert scheduler.allocator.num_free == 0
    scheduler.add_request(make_request("late", 1))
    return scheduler


def test_newest_running_request_is_preempted_when_pool_runs_out():
    scheduler = fill_pool_then_grow()
    victim = scheduler.requests["d"]
    codes = list(victim.output_codes)
    output, _ = step(scheduler)
    assert output.preempted_ids == ["d"]
    assert new_tokens(output) == {"a": 1, "b": 1}
    assert victim.status == RequestStatus.WAITING
    assert victim.pages == []
    assert victim.num_computed_tokens == 0
    assert victim.num_preemptions == 1
    assert victim.output_codes == codes and len(codes) == 1
    assert scheduler.num_preemptions_total == 1
    assert scheduler.stats().num_preemptions_total == 1


def test_preempted_request_goes_back_ahead_of_later_arrivals():
    scheduler = fill_pool_then_grow()
    step(scheduler)
    assert ids(scheduler.waiting) == ["d", "late"]


def test_step_that_preempted_admits_nobody_not_even_a_small_later_arrival():
    scheduler = make_scheduler(4)
    scheduler.add_request(make_request("a", 4))
    scheduler.add_request(make_request("b", 8))
    step(scheduler)
    scheduler.add_request(make_request("small", 1))
    output, _ = step(scheduler)
    # a grew into the last free page; b then had to preempt itself, freeing two pages that
    # "small" would fit in, yet nothing is admitted in this step.
    assert output.preempted_ids == ["b"]
    assert new_tokens(output) == {"a": 1}
    assert scheduler.allocator.num_free == 2
    assert ids(scheduler.waiting) == ["b", "small"]


def test_preempted_request_resumes_with_prompt_and_generated_codes():
    scheduler = fill_pool_then_grow()
    victim = scheduler.requests["d"]
    step(scheduler)  # d preempted; a finishes (max_new_tokens=2)
    assert "a" not in scheduler.requests
    output, _ = step(scheduler)
    assert output.preempted_ids == []
    assert new_tokens(output) == {"b": 1, "d": 3 + 1}
    assert victim.status == RequestStatus.RUNNING
    assert victim.num_computed_tokens == 4
    assert victim.token_ids(0, 4)[-1] == CFG.first_code_id + victim.output_codes[0]
    assert ids(scheduler.waiting) == ["late"]


def test_pool_that_fits_one_request_at_a_time_completes_them_all():
    prompt_len, max_new = 6, 10
    need_pages = -(-(prompt_len + max_new - 1) // PAGE)
    scheduler = make_scheduler(need_pages, max_running=4)
    requests = [make_request(f"r{i}", prompt_len, max_new) for i in range(4)]
    for request in requests:
        scheduler.add_request(request)
    steps = 0
    while scheduler.has_requests():
        output, _ = step(scheduler)
        assert not output.is_empty
        steps += 1
        assert steps < 500
    assert scheduler.num_preemptions_total > 0
    assert scheduler.allocator.num_used == 0
    assert scheduler.allocator.num_free == need_pages
    for request in requests:
        assert request.status == RequestStatus.FINISHED_LENGTH
        assert len(request.output_codes) == max_new
        # Output kept across preemptions: code k was sampled exactly once, at k codes.
        probe = make_request(request.request_id, prompt_len, max_new)
        expected = []
        for _ in range(max_new):
            expected.append(fake_code(probe))
            probe.output_codes.append(expected[-1])
        assert request.output_codes == expected


# --- refusal and abort -------------------------------------------------------------------


def test_request_that_cannot_fit_alone_is_refused_at_admission():
    scheduler = make_scheduler(2)  # 8 tokens
    scheduler.check_admissible(5, 4)  # 5 + 4 - 1 = 8 KV rows: fits exactly
    with pytest.raises(AdmissionError, match="8"):
        scheduler.check_admissible(5, 5)
    with pytest.raises(AdmissionError):
        scheduler.add_request(make_request("big", 9, max_new_tokens=1))
    assert not scheduler.has_requests()
    assert scheduler.requests == {}


def test_request_that_fits_exactly_runs_to_completion():
    scheduler = make_scheduler(2)
    request = make_request("exact", 5, max_new_tokens=4)
    scheduler.add_request(request)
    while scheduler.has_requests():
        step(scheduler)
    assert len(request.output_codes) == 4
    assert request.num_preemptions == 0


def test_abort_running_request_frees_its_pages():
    scheduler = make_scheduler(16)
    scheduler.add_request(make_request("a", 9))
    scheduler.add_request(make_request("b", 5))
    step(scheduler)
    used_by_b = len(scheduler.requests["b"].pages)
    aborted = scheduler.abort_request("a")
    assert aborted is not None and aborted.status == RequestStatus.FINISHED_ABORTED
    assert aborted.pages == []
    assert scheduler.allocator.num_used == used_by_b
    assert ids(scheduler.running) == ["b"]
    assert scheduler.abort_request("a") is None


def test_abort_waiting_request_removes_it_from_the_queue():
    scheduler = make_scheduler(16, max_running=1)
    scheduler.add_request(make_request("a", 5))
    scheduler.add_request(make_request("b", 5))
    scheduler.add_request(make_request("c", 5))
    step(scheduler)
    assert scheduler.abort_request("b").status == RequestStatus.FINISHED_ABORTED
    assert ids(scheduler.waiting) == ["c"]
    assert scheduler.abort_request("unknown") is None


def test_abort_of_preempted_request_leaves_pool_consistent():
    scheduler = fill_pool_then_grow()
    step(scheduler)
    scheduler.abort_request("d")
    assert ids(scheduler.waiting) == ["late"]
    check_invariants(scheduler)


def test_request_aborted_while_its_step_runs_gets_no_output():
    scheduler = make_scheduler(16)
    scheduler.add_request(make_request("a", 5))
    scheduler.add_request(make_request("b", 5))
    output = scheduler.schedule()
    scheduler.abort_request("a")
    results = scheduler.update_from_output(output, [1, 2])
    assert [r.request_id for r in results] == ["b"]
    assert scheduler.allocator.num_used == len(scheduler.requests["b"].pages)


def test_stats_reflect_queues_and_pages():
    scheduler = make_scheduler(10, max_running=2)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", 5))
    step(scheduler)
    stats = scheduler.stats()
    assert (stats.num_running, stats.num_waiting) == (2, 1)
    assert (stats.num_pages_used, stats.num_pages_total) == (4, 10)


def test_generated_token_count_includes_end_tokens_but_not_aborted_steps():
    scheduler = make_scheduler(16)
    for name in ("a", "b", "c"):
        scheduler.add_request(make_request(name, 5))
    step(scheduler)  # 3 codes
    step(scheduler, codes={"a": CFG.end_of_audio})  # 2 codes + 1 end token
    output = scheduler.schedule()
    scheduler.abort_request("b")
    scheduler.update_from_output(output, [1, 2])  # only c's code counts
    assert scheduler.stats().num_generated_tokens_total == 3 + 3 + 1
