import math

import pytest
import torch
import torch.nn.functional as F

from omni_dp.engine.kv_cache import KVCache, plan_kv_cache
from omni_dp.engine.model import Talker
from omni_dp.engine.runner import ModelRunner
from omni_dp.engine.scheduler import (
    ScheduledRequest,
    Scheduler,
    SchedulerOutput,
    TalkerRequest,
)

from support.talker import CFG, PAGE

NUM_PAGES = 24
ATOL = 1e-9


@pytest.fixture(scope="module")
def talker():
    torch.set_num_threads(1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        model = Talker(CFG).to(torch.float64).eval()
        with torch.no_grad():
            # Non-trivial norm weights, so a reference that forgot them would disagree.
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.uniform_(0.5, 1.5)
    return model


def make_runner(talker, num_pages=NUM_PAGES):
    spec = plan_kv_cache(
        num_layers=CFG.num_layers, num_kv_heads=CFG.num_kv_heads, head_dim=CFG.head_dim,
        dtype=torch.float64, page_size=PAGE, max_total_tokens=num_pages * PAGE,
    )
    cache = KVCache(spec, torch.device("cpu"))
    # Garbage everywhere: attention must only ever read the rows it wrote.
    generator = torch.Generator().manual_seed(99)
    cache.k.copy_(torch.randn(cache.k.shape, generator=generator, dtype=torch.float64) * 50)
    cache.v.copy_(torch.randn(cache.v.shape, generator=generator, dtype=torch.float64) * 50)
    return ModelRunner(talker, cache, torch.device("cpu"))


def prompt_ids(length, offset=0):
    return [CFG.first_speaker_id + offset % CFG.num_speakers, CFG.bos_text_id,
            *[(17 * i + 5 + offset) % 256 for i in range(length - 2)]]


def make_request(request_id, prompt, pages, max_new_tokens=8, seed=0):
    request = TalkerRequest(request_id, list(prompt), max_new_tokens, seed, CFG.first_code_id)
    request.pages = list(pages)
    return request


def run_step(runner, items):
    """items: [(request, num_new_tokens)]; returns logits and advances num_computed_tokens."""
    output = SchedulerOutput([ScheduledRequest(r, n) for r, n in items], [])
    logits = runner.talker(runner.build_batch(output), runner.kv_cache.k, runner.kv_cache.v)
    for request, n in items:
        request.num_computed_tokens += n
    return logits


# --- a dense reference written from the architecture, not from model.py -----------------


def rms_norm(x, weight):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + CFG.rms_norm_eps) * weight


def apply_rope(x, positions):
    """x [T, heads, d]; rotate-half convention: pairs (i, i + d/2)."""
    d = x.shape[-1]
    inv_freq = CFG.rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def dense_logits(model, token_ids):
    """Logits at every position of one sequence, no cache: [T, codebook_size + 1]."""
    ids = torch.tensor(token_ids)
    seq_len = len(token_ids)
    positions = torch.arange(seq_len)
    heads, kv_heads, d = CFG.num_heads, CFG.num_kv_heads, CFG.head_dim
    x = model.embed.weight[ids]
    causal = torch.tril(torch.ones(seq_len, seq_len, dtype=torch.bool))
    for layer in model.layers:
        h = rms_norm(x, layer.input_norm.weight)
        qkv = h @ layer.attn.qkv_proj.weight.t()
        q = qkv[:, : heads * d].reshape(seq_len, heads, d)
        k = qkv[:, heads * d : (heads + kv_heads) * d].reshape(seq_len, kv_heads, d)
        v = qkv[:, (heads + kv_heads) * d :].reshape(seq_len, kv_heads, d)
        q, k = apply_rope(q, positions), apply_rope(k, positions)
        group = heads // kv_heads  # query head j reads kv head j // group
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
        scores = scores.masked_fill(~causal, float("-inf"))
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(seq_len, heads * d)
        x = x + attn @ layer.attn.o_proj.weight.t()
        h = rms_norm(x, layer.post_attn_norm.weight)
        gate, up = (h @ layer.mlp.gate_up_proj.weight.t()).chunk(2, dim=-1)
        x = x + (F.silu(gate) * up) @ layer.mlp.down_proj.weight.t()
    return rms_norm(x, model.norm.weight) @ model.lm_head.weight.t()


# --- tests -------------------------------------------------------------------------------


def test_paged_prefill_matches_dense_reference(talker):
    runner = make_runner(talker)
    prompt = prompt_ids(11)
    request = make_request("r", prompt, pages=[0, 1, 2])
    logits = run_step(runner, [(request, len(prompt))])
    assert logits.shape == (1, CFG.codebook_size + 1)
    torch.testing.assert_close(logits[0], dense_logits(talker, prompt)[-1], rtol=0, atol=ATOL)


def test_reference_is_sensitive_to_the_sequence(talker):
    # Guards the comparisons below: different contexts give clearly different logits.
    a = dense_logits(talker, prompt_ids(11))[-1]
    b = dense_logits(talker, prompt_ids(11, offset=1))[-1]
    assert (a - b).abs().max() > 1e-3


def test_prefill_then_decode_matches_prefill_of_whole_sequence(talker):
    runner = make_runner(talker)
    prompt = prompt_ids(6)
    codes = [3, 31, 0, 7, 7, 12, 30, 1]
    request = make_request("r", prompt, pages=[0, 1, 2, 3], max_new_tokens=len(codes) + 1)
    run_step(runner, [(request, len(prompt))])
    for i, code in enumerate(codes):
        request.output_codes.append(code)
        decoded = run_step(runner, [(request, 1)])[0]
        full_ids = prompt + [CFG.first_code_id + c for c in codes[: i + 1]]
        other = make_request("whole", full_ids, pages=[10, 11, 12, 13])
        prefilled = run_step(runner, [(other, len(full_ids))])[0]
        torch.testing.assert_close(decoded, prefilled, rtol=0, atol=ATOL)
        torch.testing.assert_close(decoded, dense_logits(talker, full_ids)[-1], rtol=0, atol=ATOL)


def test_prefill_in_two_parts_matches_one_prefill(talker):
    runner = make_runner(talker)
    prompt = prompt_ids(13)
    request = make_request("r", prompt, pages=[4, 5, 6, 7])
    run_step(runner, [(request, 6)])
    split = run_step(runner, [(request, 7)])[0]
    torch.testing.assert_close(split, dense_logits(talker, prompt)[-1], rtol=0, atol=ATOL)


def test_scattered_pages_give_the_same_logits_as_contiguous_pages(talker):
    prompt = prompt_ids(15)
    results = []
    for pages in ([0, 1, 2, 3, 4], [19, 3, 11, 6, 14]):
        runner = make_runner(talker)
        request = make_request("r", prompt, pages=pages, max_new_tokens=4)
        logits = [run_step(runner, [(request, len(prompt))])[0]]
        for code in (5, 9, 2):
            request.output_codes.append(code)
            logits.append(run_step(runner, [(request, 1)])[0])
        results.append(torch.stack(logits))
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=ATOL)


def test_mixed_batch_rows_match_each_sequence_alone(talker):
    runner = make_runner(talker)
    a = make_request("a", prompt_ids(9), pages=[2, 0, 5])
    b = make_request("b", prompt_ids(5, offset=3), pages=[7, 1])
    run_step(runner, [(a, 9)])
    a.output_codes.append(4)
    # One flat batch: a decodes one token while b prefills five.
    logits = run_step(runner, [(a, 1), (b, 5)])
    expected_a = dense_logits(talker, [*a.prompt_ids, CFG.first_code_id + 4])[-1]
    torch.testing.assert_close(logits[0], expected_a, rtol=0, atol=ATOL)
    torch.testing.assert_close(logits[1], dense_logits(talker, b.prompt_ids)[-1], rtol=0,
                               atol=ATOL)


def test_several_decoding_sequences_in_one_padded_call_match_dense_reference(talker):
    runner = make_runner(talker)
    # Different context lengths (padding needed), scattered pages, one on a page boundary.
    requests = [
        make_request("a", prompt_ids(3), pages=[21, 4]),
        make_request("b", prompt_ids(11, offset=1), pages=[9, 0, 17, 2, 13]),
        make_request("c", prompt_ids(7, offset=2), pages=[6, 15, 3]),
    ]
    run_step(runner, [(r, len(r.prompt_ids)) for r in requests])
    for code in (3, 30, 8, 0, 19):
        items = []
        for i, request in enumerate(requests):
            request.output_codes.append((code + 5 * i) % CFG.codebook_size)
            items.append((request, 1))
        output = SchedulerOutput([ScheduledRequest(r, n) for r, n in items], [])
        assert runner.build_batch(output).decode is not None  # the padded path is taken
        logits = run_step(runner, items)
        for row, request in zip(logits, requests, strict=True):
            expected = dense_logits(talker, request.token_ids(0, request.num_tokens))[-1]
            torch.testing.assert_close(row, expected, rtol=0, atol=ATOL)


def test_decoding_sequences_beside_a_prefill_match_dense_reference(talker):
    runner = make_runner(talker)
    a = make_request("a", prompt_ids(5), pages=[3, 8])
    b = make_request("b", prompt_ids(9, offset=4), pages=[12, 1, 7])
    c = make_request("c", prompt_ids(6, offset=6), pages=[19, 5])
    run_step(runner, [(a, 5), (b, 9)])
    a.output_codes.append(2)
    b.output_codes.append(29)
    logits = run_step(runner, [(a, 1), (c, 6), (b, 1)])
    for row, request in zip(logits, (a, c, b), strict=True):
        expected = dense_logits(talker, request.token_ids(0, request.num_tokens))[-1]
        torch.testing.assert_close(row, expected, rtol=0, atol=ATOL)


def generate(talker, specs, *, num_pages, max_running, arrivals=None):
    """Run requests through Scheduler + ModelRunner.execute; returns codes by id."""
    runner = make_runner(talker, num_pages)
    scheduler = Scheduler(
        runner.kv_cache.spec, end_of_audio=CFG.end_of_audio, max_running_requests=max_running
    )
    arrivals = arrivals or {}
    requests = {}
    pending = list(specs)
    steps = 0
    while pending or scheduler.has_requests():
        for spec in [s for s in pending if arrivals.get(s[0], 0) <= steps]:
            request_id, prompt, max_new, seed = spec
            requests[request_id] = TalkerRequest(request_id, prompt, max_new, seed,
                                                 CFG.first_code_id)
            scheduler.add_request(requests[request_id])
            pending.remove(spec)
        output = scheduler.schedule()
        if not output.is_empty:
            scheduler.update_from_output(output, runner.execute(output))
        steps += 1
        assert steps < 1000
    preemptions = scheduler.num_preemptions_total
    return {rid: r.output_codes for rid, r in requests.items()}, preemptions


def test_sampled_codes_do_not_depend_on_batching(talker):
    specs = [
        ("x", prompt_ids(7), 30, 11),
        ("y", prompt_ids(12, offset=2), 30, 22),
        ("z", prompt_ids(4, offset=5), 30, 33),
    ]
    alone = {}
    for spec in specs:
        codes, _ = generate(talker, [spec], num_pages=NUM_PAGES, max_running=4)
        alone.update(codes)
    # Batched, arriving at different steps, and in a pool so small that requests get
    # preempted and recomputed.
    batched, preemptions = generate(
        talker, specs, num_pages=12, max_running=4, arrivals={"y": 3, "z": 5}
    )
    assert preemptions > 0
    assert batched == alone
    assert sum(len(codes) for codes in alone.values()) > 10
    assert len({tuple(codes) for codes in alone.values()}) == 3


def test_module_apply_is_not_shadowed():
    seen = []
    Talker(CFG).apply(seen.append)  # nn.Module.apply: fn on every submodule, then itself
    assert isinstance(seen[-1], Talker)
    assert len(seen) > 1
