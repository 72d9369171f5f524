"""Comparing audio bodies in tests."""

from __future__ import annotations


def first_difference(got: bytes, want: bytes) -> int | None:
    """Where two bodies first differ (the shorter one's length if it is the other's start), or
    None: pytest's own explanation of two unequal bodies of tens of kB takes minutes."""
    if got == want:
        return None
    return next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
                min(len(got), len(want)))
