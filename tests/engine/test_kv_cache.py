import pytest
import torch

from omni_dp.engine.config import PRESETS
from omni_dp.engine.kv_cache import (
    DEFAULT_MAX_TOTAL_TOKENS,
    DEFAULT_PAGE_SIZE,
    KVCache,
    KVSizingError,
    PageAllocator,
    plan_kv_cache,
)

TINY = PRESETS["tiny"]


def plan(**kwargs):
    shape = {"num_layers": 3, "num_kv_heads": 2, "head_dim": 8, "dtype": torch.float32}
    return plan_kv_cache(**(shape | kwargs))


# --- sizing ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "itemsize"), [(torch.float64, 8), (torch.float32, 4), (torch.bfloat16, 2)]
)
def test_bytes_per_token_is_keys_and_values_of_every_layer(dtype, itemsize):
    spec = plan(num_layers=3, num_kv_heads=2, head_dim=8, dtype=dtype)
    assert spec.bytes_per_token == 2 * 3 * 2 * 8 * itemsize
    assert spec.bytes_per_page == spec.page_size * spec.bytes_per_token


def test_tiny_preset_bytes_per_token_in_float64():
    spec = plan_kv_cache(
        num_layers=TINY.num_layers, num_kv_heads=TINY.num_kv_heads, head_dim=TINY.head_dim,
        dtype=torch.float64,
    )
    assert spec.bytes_per_token == 2 * 4 * 2 * 64 * 8


@pytest.mark.parametrize("extra", [0, 1, 12345])
def test_kv_cache_bytes_gives_whole_pages_rounded_down(extra):
    per_token = 2 * 3 * 2 * 8 * 4
    page = 16
    budget = 7 * page * per_token + extra
    spec = plan(kv_cache_bytes=budget, page_size=page)
    assert spec.num_pages == budget // (page * per_token)
    assert spec.cache_bytes == spec.num_pages * page * per_token
    assert spec.cache_bytes <= budget
    assert budget - spec.cache_bytes < page * per_token


def test_kv_cache_bytes_just_below_a_page_boundary_loses_that_page():
    per_page = plan(max_total_tokens=16).bytes_per_page
    assert plan(kv_cache_bytes=3 * per_page - 1).num_pages == 2
    assert plan(kv_cache_bytes=3 * per_page).num_pages == 3


@pytest.mark.parametrize(("tokens", "page"), [(16, 16), (4096, 16), (96, 32), (7, 1)])
def test_max_total_tokens_gives_exactly_that_many_tokens(tokens, page):
    spec = plan(max_total_tokens=tokens, page_size=page)
    assert spec.max_total_tokens == tokens
    assert spec.num_pages == tokens // page
    assert spec.cache_bytes == tokens * spec.bytes_per_token


def test_both_knobs_is_an_error_naming_both_flags():
    with pytest.raises(KVSizingError) as info:
        plan(kv_cache_bytes=10**9, max_total_tokens=1024)
    assert "--kv-cache-bytes" in str(info.value)
    assert "--max-total-tokens" in str(info.value)


def test_tokens_not_a_multiple_of_page_size_suggests_nearest_multiples():
    with pytest.raises(KVSizingError) as info:
        plan(max_total_tokens=1000, page_size=16)
    message = str(info.value)
    assert "1000" in message
    assert "992" in message  # 62 pages
    assert "1008" in message  # 63 pages


def test_suggested_multiples_are_accepted():
    for tokens in (992, 1008):
        assert plan(max_total_tokens=tokens, page_size=16).max_total_tokens == tokens


@pytest.mark.parametrize("tokens", [0, -16])
def test_non_positive_tokens_is_an_error(tokens):
    with pytest.raises(KVSizingError, match="--max-total-tokens"):
        plan(max_total_tokens=tokens)


def test_bytes_smaller_than_one_page_is_an_error():
    per_page = plan(max_total_tokens=16).bytes_per_page
    with pytest.raises(KVSizingError) as info:
        plan(kv_cache_bytes=per_page - 1)
    assert "--kv-cache-bytes" in str(info.value)
    assert str(per_page) in str(info.value)
    assert plan(kv_cache_bytes=per_page).num_pages == 1


def test_non_positive_page_size_is_an_error():
    with pytest.raises(KVSizingError, match="--page-size"):
        plan(page_size=0)


def test_default_when_neither_knob_given():
    spec = plan()
    assert spec.page_size == DEFAULT_PAGE_SIZE
    assert spec.max_total_tokens == DEFAULT_MAX_TOTAL_TOKENS


def test_default_works_for_a_page_size_that_does_not_divide_the_default():
    spec = plan(page_size=24)
    assert spec.num_pages > 0
    assert spec.max_total_tokens % 24 == 0


def test_sizing_depends_on_dtype_for_bytes_but_not_for_tokens():
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        assert plan(max_total_tokens=256, dtype=dtype).num_pages == 16
    budget = 10 * plan(max_total_tokens=16, dtype=torch.float64).bytes_per_page
    assert plan(kv_cache_bytes=budget, dtype=torch.float64).num_pages == 10
    assert plan(kv_cache_bytes=budget, dtype=torch.float32).num_pages == 20
    assert plan(kv_cache_bytes=budget, dtype=torch.bfloat16).num_pages == 40


def test_pages_for_rounds_up():
    spec = plan(max_total_tokens=64, page_size=16)
    assert [spec.pages_for(n) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]


# --- page allocator ----------------------------------------------------------------------


def test_allocate_hands_out_distinct_pages_and_counts_them():
    allocator = PageAllocator(8)
    assert (allocator.num_free, allocator.num_used) == (8, 0)
    first = allocator.allocate(3)
    second = allocator.allocate(4)
    assert len(first) == 3 and len(second) == 4
    assert not set(first) & set(second)
    assert set(first) | set(second) <= set(range(8))
    assert (allocator.num_free, allocator.num_used) == (1, 7)


def test_allocate_zero_pages_returns_empty_list():
    allocator = PageAllocator(2)
    assert allocator.allocate(0) == []
    assert allocator.num_free == 2


def test_allocate_returns_none_on_shortage_without_taking_anything():
    allocator = PageAllocator(4)
    allocator.allocate(3)
    assert allocator.allocate(2) is None
    assert allocator.num_free == 1
    assert allocator.allocate(1) is not None
    assert allocator.allocate(1) is None


def test_free_returns_pages_for_reuse():
    allocator = PageAllocator(4)
    pages = allocator.allocate(4)
    assert allocator.allocate(1) is None
    allocator.free(pages[1:3])
    assert (allocator.num_free, allocator.num_used) == (2, 2)
    again = allocator.allocate(2)
    assert sorted(again) == sorted(pages[1:3])


def test_double_free_asserts():
    allocator = PageAllocator(4)
    pages = allocator.allocate(4)
    allocator.free(pages)
    with pytest.raises(AssertionError, match="freed twice"):
        allocator.free(pages[:1])


def test_double_free_is_detected_while_other_pages_are_in_use():
    allocator = PageAllocator(4)
    pages = allocator.allocate(2)
    allocator.free(pages[:1])
    with pytest.raises(AssertionError):
        allocator.free(pages[:1])


# --- pool tensors ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_kv_cache_tensor_shapes_and_dtype(dtype):
    spec = plan(num_layers=3, num_kv_heads=2, head_dim=8, dtype=dtype, max_total_tokens=64,
                page_size=16)
    cache = KVCache(spec, torch.device("cpu"))
    for tensor in (cache.k, cache.v):
        assert tensor.shape == (3, 4, 16, 2, 8)
        assert tensor.dtype == dtype
        assert not tensor.any()
    assert cache.k.data_ptr() != cache.v.data_ptr()
    bytes_total = (cache.k.numel() + cache.v.numel()) * cache.k.element_size()
    assert bytes_total == spec.cache_bytes
