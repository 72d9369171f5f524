import math

import pytest
import torch

from omni_dp.engine.api import MAX_SEED
from omni_dp.engine.sampling import derive_seed, sample, uniform_for


def test_uniform_for_is_deterministic():
    assert uniform_for(42, 7) == uniform_for(42, 7)
    assert [uniform_for(3, k) for k in range(50)] == [uniform_for(3, k) for k in range(50)]


def test_uniform_for_is_in_unit_interval():
    values = [uniform_for(seed, step) for seed in (0, 1, 2**63 - 1, 2**64 + 5) for step in
              range(500)]
    assert all(0.0 <= u < 1.0 for u in values)


def test_uniform_for_differs_across_steps_and_seeds():
    by_step = [uniform_for(5, k) for k in range(200)]
    by_seed = [uniform_for(s, 0) for s in range(200)]
    assert len(set(by_step)) == 200
    assert len(set(by_seed)) == 200
    assert uniform_for(5, 1) != uniform_for(6, 1)


def test_uniform_for_looks_uniform():
    values = [uniform_for(123, k) for k in range(20000)]
    assert abs(sum(values) / len(values) - 0.5) < 0.01
    deciles = [0] * 10
    for u in values:
        deciles[int(u * 10)] += 1
    assert all(abs(count / len(values) - 0.1) < 0.01 for count in deciles)


def test_derive_seed_is_stable_and_ignores_key_order():
    fields = {"input": "hello", "voice": "alloy", "max_new_tokens": 64}
    reordered = {"max_new_tokens": 64, "voice": "alloy", "input": "hello"}
    assert derive_seed(fields) == derive_seed(dict(fields)) == derive_seed(reordered)


def test_derive_seed_depends_on_every_field():
    base = {"input": "hello", "voice": "alloy", "max_new_tokens": 64}
    seeds = {
        derive_seed(base),
        derive_seed(base | {"input": "hello!"}),
        derive_seed(base | {"voice": "echo"}),
        derive_seed(base | {"max_new_tokens": 65}),
    }
    assert len(seeds) == 4


def test_derive_seed_is_a_valid_request_seed():
    for text in ("a", "b", "ünïcödé", "x" * 1000):
        seed = derive_seed({"input": text})
        assert 0 <= seed <= MAX_SEED


def peaked_logits(vocab, peak):
    logits = torch.full((1, vocab), -30.0)
    logits[0, peak] = 30.0
    return logits


@pytest.mark.parametrize("peak", [0, 4, 9])
def test_peaked_logits_always_pick_the_peak(peak):
    logits = peaked_logits(10, peak).repeat(200, 1)
    # Not u = 0: the other codes have tiny but nonzero probability, and u = 0 picks the first.
    uniforms = [1e-9, 1.0 - 2**-53, *[uniform_for(1, k) for k in range(198)]]
    assert sample(logits, 0.8, uniforms) == [peak] * 200


def test_u_zero_picks_first_index_with_nonzero_probability():
    logits = torch.tensor([[-math.inf, -math.inf, 0.5, 2.0, -math.inf, 1.0]])
    assert sample(logits, 1.0, [0.0]) == [2]
    assert sample(logits, 1.0, [1e-12]) == [2]


def test_u_near_one_picks_last_index_with_nonzero_probability():
    logits = torch.tensor([[1.0, 0.5, 2.0, -math.inf, -math.inf]])
    assert sample(logits, 1.0, [1.0 - 2**-53]) == [2]


def test_zero_probability_indices_are_never_picked():
    logits = torch.tensor([[-math.inf, 0.0, -math.inf, 0.0, -math.inf]]).repeat(500, 1)
    picks = sample(logits, 1.0, [uniform_for(9, k) for k in range(500)])
    assert set(picks) == {1, 3}


def test_each_row_uses_its_own_uniform():
    logits = torch.zeros(4, 4)  # uniform distribution over 4 codes
    assert sample(logits, 1.0, [0.1, 0.3, 0.6, 0.9]) == [0, 1, 2, 3]


def test_sample_result_is_monotonic_in_u():
    logits = torch.tensor([[0.3, -1.0, 2.0, 0.0, 1.1, -0.4]])
    us = [i / 400 for i in range(400)]
    picks = sample(logits.repeat(400, 1), 0.9, us)
    assert picks == sorted(picks)
    assert picks[0] == 0 and picks[-1] == 5


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_empirical_distribution_matches_softmax_over_temperature(temperature):
    logits = torch.tensor([1.5, -0.5, 0.0, 2.5, 0.7])
    n = 20000
    picks = sample(logits.repeat(n, 1), temperature, [uniform_for(77, k) for k in range(n)])
    counts = torch.bincount(torch.tensor(picks), minlength=5).double() / n
    expected = torch.softmax(logits.double() / temperature, dim=-1)
    assert (counts - expected).abs().max() < 0.015


def test_lower_temperature_concentrates_on_the_top_logit():
    logits = torch.tensor([1.0, 0.0, 0.5, 1.2])
    n = 5000
    uniforms = [uniform_for(3, k) for k in range(n)]
    share = {
        t: sum(p == 3 for p in sample(logits.repeat(n, 1), t, uniforms)) / n
        for t in (0.25, 1.0, 4.0)
    }
    assert share[0.25] > share[1.0] > share[4.0]


def test_low_precision_logits_sample_like_float64():
    logits = torch.tensor([[0.25, 1.5, -0.75, 1.0]])
    uniforms = [uniform_for(8, k) for k in range(300)]
    as64 = sample(logits.double().repeat(300, 1), 0.8, uniforms)
    as16 = sample(logits.to(torch.bfloat16).repeat(300, 1), 0.8, uniforms)
    assert as16 == as64  # these logits are exact in bfloat16
