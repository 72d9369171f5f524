"""bench/priority.py: its figures and its verdict on the goal, from phases made by hand (the
benchmark itself runs minutes and is not a test)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import priority


def phase(name: str, first_audio: list[float], bulk_audio_s: float, failed=None):
    p = priority.Phase(name, started=0.0, ended=10.0, first_audio=first_audio,
                       bulk_audio_s=bulk_audio_s, bulk_done=3)
    for what in failed or ():
        p.fail("bulk", what)
    return p.row()


def test_the_goal_is_judged_on_p99_and_bulk_throughput():
    args = priority.parse_args(["--phase-s", "10"])
    rows = [phase("alone", [0.1] * 98 + [0.2] * 2, 0.0),
            phase("flood", [1.0] * 100, 50.0),
            phase("classes", [0.2] * 98 + [0.3] * 2, 46.0, failed=["HTTP 503"])]
    assert rows[2]["ttfa_p99_s"] == 0.3 and rows[2]["bulk_audio_s_per_s"] == 4.6
    text = priority.markdown(rows, args, ["--replicas", "2"])
    assert "1.50x its p99 alone (goal ≤ 1.5x: met)" in text
    assert "92% of the flood's without (goal ≥ 90%: met)" in text
    assert "bulk: HTTP 503 ×1" in text
    rows[2] = phase("classes", [0.2] * 98 + [0.31] * 2, 44.0)
    text = priority.markdown(rows, args, ["--replicas", "2"])
    assert "(goal ≤ 1.5x: NOT met)" in text and "(goal ≥ 90%: NOT met)" in text


@pytest.mark.parametrize("argv", [["--bulk", "0"], ["--phase-s", "0"], ["--replicas", "0"]])
def test_bad_arguments_exit_2_naming_the_flag(argv, capsys):
    with pytest.raises(SystemExit) as exited:
        priority.parse_args(argv)
    assert exited.value.code == 2
    assert argv[0] in capsys.readouterr().err
