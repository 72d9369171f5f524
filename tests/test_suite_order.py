"""The suite's files start longest first (tests/support/order.py): the list names files that
exist, and the order it gives keeps each file's tests together and in their own order."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from support.order import LONGEST_FIRST, longest_first

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Item:
    nodeid: str


def test_every_file_named_to_run_first_exists():
    """A file renamed or merged away would silently fall back to collection order."""
    assert [path for path in LONGEST_FIRST if not (ROOT / path).is_file()] == []
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)


def test_the_longest_files_come_first_each_files_tests_in_order():
    first, second = LONGEST_FIRST[0], LONGEST_FIRST[1]
    collected = [Item(f"tests/a_test.py::t{n}") for n in range(2)] + [
        Item(f"{second}::late"), Item(f"{first}::one"), Item("tests/z_test.py::t"),
        Item(f"{first}::two")]
    assert [i.nodeid for i in longest_first(collected)] == [
        f"{first}::one", f"{first}::two", f"{second}::late",
        "tests/a_test.py::t0", "tests/a_test.py::t1", "tests/z_test.py::t"]
