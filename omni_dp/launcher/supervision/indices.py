"""A set of replica indices that several supervision threads may change (the followers told to
wait for their gone leader, shared by every restart thread; the replicas the router did not take
back, which only the loop changes while it runs — a thread hands it a RouterLeftOut — but a
thread may change where no loop runs: a unit test, teardown).

Every operation holds one lock, and reading gives a copy: the loop iterates what it read while a
restart thread adds to the set, and "add these, which were new?" is one step, so two threads
never both say the same news.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator


class SharedIndices:
    def __init__(self, indices: Iterable[int] = ()) -> None:
        self._lock = threading.Lock()
        self._indices: set[int] = set(indices)

    def add(self, index: int) -> None:
        with self._lock:
            self._indices.add(index)

    def update(self, indices: Iterable[int]) -> None:
        with self._lock:
            self._indices.update(indices)

    def add_new(self, indices: Iterable[int]) -> list[int]:
        """Add these; the ones that were not in already, in the order given."""
        with self._lock:
            new = [i for i in dict.fromkeys(indices) if i not in self._indices]
            self._indices.update(new)
            return new

    def discard(self, index: int) -> None:
        with self._lock:
            self._indices.discard(index)

    def difference_update(self, indices: Iterable[int]) -> None:
        with self._lock:
            self._indices.difference_update(indices)

    def clear(self) -> None:
        with self._lock:
            self._indices.clear()

    def snapshot(self) -> frozenset[int]:
        with self._lock:
            return frozenset(self._indices)

    def __contains__(self, index: object) -> bool:
        with self._lock:
            return index in self._indices

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self.snapshot()))

    def __len__(self) -> int:
        with self._lock:
            return len(self._indices)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SharedIndices):
            other = other.snapshot()
        return isinstance(other, (set, frozenset)) and self.snapshot() == other

    __hash__ = None  # type: ignore[assignment]  # mutable, as a set

    def __repr__(self) -> str:
        return f"SharedIndices({sorted(self.snapshot())})"
