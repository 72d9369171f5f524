"""The paged KV cache: exact sizing, the page allocator, and the pool tensors.

Sizing is pure arithmetic so that the launcher's KV-equality check has something exact to
compare: a replica given `--kv-cache-bytes B` or `--max-total-tokens N` allocates a number of
pages that follows from the model and dtype alone, never from how much memory happens to be free.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omni_dp.engine.options import DEFAULT_MAX_TOTAL_TOKENS, DEFAULT_PAGE_SIZE


class KVSizingError(ValueError):
    """The KV budget asked for cannot be met; the message says what to change."""


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    page_size: int
    num_pages: int

    @property
    def bytes_per_token(self) -> int:
        """Key + value, every layer: 2 × layers × kv_heads × head_dim × dtype size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def bytes_per_page(self) -> int:
        return self.page_size * self.bytes_per_token

    @property
    def max_total_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def cache_bytes(self) -> int:
        return self.num_pages * self.bytes_per_page

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)


def plan_kv_cache(
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    page_size: int = DEFAULT_PAGE_SIZE,
    kv_cache_bytes: int | None = None,
    max_total_tokens: int | None = None,
) -> KVCacheSpec:
    """Size the pool from exactly one of the two knobs (or the default token count)."""
    if kv_cache_bytes is not None and max_total_tokens is not None:
        raise KVSizingError(
            "--kv-cache-bytes and --max-total-tokens both size the KV pool; give only one "
            "(bytes for a fixed memory budget, tokens for a fixed capacity)"
        )
    if page_size <= 0:
        raise KVSizingError(f"--page-size must be positive, got {page_size}")
    spec = KVCacheSpec(num_layers, num_kv_heads, head_dim, dtype, page_size, num_pages=0)
    if kv_cache_bytes is not None:
        num_pages = kv_cache_bytes // spec.bytes_per_page
        if num_pages < 1:
            raise KVSizingError(
                f"--kv-cache-bytes {kv_cache_bytes} holds no whole page: one page is "
                f"{page_size} tokens × {spec.bytes_per_token} bytes = {spec.bytes_per_page} bytes"
            )
    elif max_total_tokens is None:
        num_pages = max(1, DEFAULT_MAX_TOTAL_TOKENS // page_size)
    else:
        tokens = max_total_tokens
        if tokens <= 0:
            raise KVSizingError(f"--max-total-tokens must be positive, got {tokens}")
        if tokens % page_size:
            lower = tokens // page_size * page_size
            choices = f"{lower} or {lower + page_size}" if lower else f"{page_size}"
            raise KVSizingError(
                f"--max-total-tokens {tokens} is not a whole number of {page_size}-token pages; "
                f"use {choices}"
            )
        num_pages = tokens // page_size
    return KVCacheSpec(num_layers, num_kv_heads, head_dim, dtype, page_size, num_pages)


class PageAllocator:
    """Free-list of page ids. Running short is expected: `allocate` returns None, never raises."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        # Pop from the end: low page ids are handed out first, which keeps traces readable.
        self._free = list(range(num_pages - 1, -1, -1))
        self._is_free = bytearray(b"\x01" * num_pages)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        if n == 0:
            return []
        pages = self._free[-n:]
        del self._free[-n:]
        for page in pages:
            self._is_free[page] = 0
        return pages[::-1]

    def free(self, pages: list[int]) -> None:
        for page in pages:
            assert not self._is_free[page], f"page {page} freed twice"
            self._is_free[page] = 1
        self._free.extend(reversed(pages))


class KVCache:
    """The pool tensors, allocated (and touched) once at start-up: [layers, pages, page, kvh, d]."""

    def __init__(self, spec: KVCacheSpec, device: torch.device) -> None:
        self.spec = spec
        shape = (spec.num_layers, spec.num_pages, spec.page_size, spec.num_kv_heads, spec.head_dim)
        self.k = torch.zeros(shape, dtype=spec.dtype, device=device)
        self.v = torch.zeros(shape, dtype=spec.dtype, device=device)
