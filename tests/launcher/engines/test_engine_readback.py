"""The log read-back helpers on real files: only the tail is read, only the latest start counts,
and counts with thousands separators parse."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from omni_dp.launcher.engines.base import EngineUnreadable
from omni_dp.launcher.engines.readback import (
    COUNT,
    is_start_banner,
    kv_tokens_from_log,
    last_count,
    parse_count,
    read_tail,
    since_last_start,
)
from omni_dp.logs import json_line

KV = re.compile(r"KV cache size: " + COUNT + " tokens")
BANNER = "--- omni-dp: starting replica 1 at 2026-12-01 12:00:00 ---"


def test_counts_parse_with_and_without_thousands_separators():
    assert [parse_count(text) for text in ("0", "1024", "1,024", "12,345,678")] == [
        0, 1024, 1024, 12345678]


def test_a_count_stops_before_the_comma_that_follows_it():
    tokens = re.compile("#tokens: " + COUNT)
    assert [tokens.search(line).group(1) for line in (
        "#tokens: 58240, KV size: 6.22 GB", "#tokens: 1,024 tokens", "#tokens: 12,345,678, x",
        "#tokens: 1234,567")] == ["58240", "1,024", "12,345,678", "1234"]


def test_the_launchers_banners_are_starts_quotes_of_them_are_not():
    assert is_start_banner(BANNER)
    assert is_start_banner(json_line("omni_dp.launch", "starting replica 3"))
    assert not is_start_banner(json_line("engine", "starting replica 3"))
    assert not is_start_banner("INFO echo '--- omni-dp: starting replica 0'")
    assert not is_start_banner('{"message": "starting replica 0", "logger": "omni_dp.launch"')


def test_lines_after_the_last_banner_or_all_without_one():
    assert since_last_start(["a", BANNER, "b", BANNER, "c", "d"]) == ["c", "d"]
    assert since_last_start(["a", "b"]) == ["a", "b"]
    assert since_last_start(["a", BANNER]) == []


def test_the_last_matching_line_wins():
    lines = ["KV cache size: 1,024 tokens", "noise", "KV cache size: 2,048 tokens", "end"]
    assert last_count(lines, (KV,)) == 2048
    assert last_count(["noise"], (KV,)) is None


def test_only_the_tail_is_read_and_a_line_cut_by_the_window_is_dropped(tmp_path):
    log = tmp_path / "replica.log"
    log.write_text("first line\n" + "x" * 100 + "\nsecond\nthird\n")
    assert read_tail(log, 20) == ["second", "third"]  # the x…x line is cut: dropped
    assert read_tail(log, 10_000)[0] == "first line"
    assert read_tail(log, 3) == []


def test_a_tail_without_a_banner_is_all_the_latest_start(tmp_path):
    """The banner (and the older start's line before it) fall outside the window: what is left
    is the latest start's, since a later banner would be inside it."""
    log = tmp_path / "replica.log"
    older = f"KV cache size: 111 tokens\n{BANNER}\n"
    latest = "KV cache size: 2,222 tokens\n" + "".join(f"request {i}\n" for i in range(200))
    log.write_text(older + latest)
    assert kv_tokens_from_log(log, (KV,), "KV size", max_bytes=len(latest)) == 2222


def test_the_latest_start_of_a_real_log_with_an_older_start_before_it(tmp_path):
    log = tmp_path / "replica.log"
    log.write_text(f"{BANNER}\nKV cache size: 1,024 tokens\nkilled\n{BANNER}\n"
                   "KV cache size: 2,048 tokens\nready\n")
    assert kv_tokens_from_log(log, (KV,), "KV size") == 2048


def test_no_line_since_the_last_start_is_unreadable_and_names_what_was_looked_for(tmp_path):
    log = tmp_path / "replica.log"
    log.write_text(f"KV cache size: 1,024 tokens\n{BANNER}\nloading\n")
    with pytest.raises(EngineUnreadable) as info:
        kv_tokens_from_log(log, (KV,), "`KV cache size: N tokens`", max_bytes=1024)
    assert str(info.value) == (
        f"no `KV cache size: N tokens` line in {log} since the replica's last start (read its "
        "last 1.00 KiB): the engine did not log its KV allocation, or logs it in other words "
        "than this omni-dp knows")


def test_an_unreadable_log_is_unreadable_capacity(tmp_path: Path):
    with pytest.raises(EngineUnreadable, match="cannot read the replica's log"):
        kv_tokens_from_log(tmp_path, (KV,), "KV size")  # a directory


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_the_banner_the_launcher_writes_is_the_one_the_read_back_finds(log_format):
    """One writer, one reader: a reworded banner that the read-back no longer recognised
    would make it read an earlier start's KV line."""
    from omni_dp.launcher.engines.readback import is_start_banner, start_banner

    banner = start_banner(3, log_format)
    assert is_start_banner(banner)
    assert since_last_start(["old KV line", banner, "new KV line"]) == ["new KV line"]
