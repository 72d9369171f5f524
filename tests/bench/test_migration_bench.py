"""The migration benches (bench/migration_faults.py, bench/migration_overhead.py) kept working:
the fault bench's summary from a hand-made vLLM client result (failed per 1,000, tokens
against expected, texts against the uncut round), and the overhead bench end to end for one
short round of each mode (its figures are the bench's to record, not asserted here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # the bench scripts import each other as top-level modules

import migration_faults  # noqa: E402


def client_result(texts: list[str], lens: list[int], errors: list[str]) -> dict:
    """What `vllm bench serve --save-detailed` writes, the fields the bench reads."""
    failed = sum(1 for e in errors if e)
    return {"completed": len(texts) - failed, "failed": failed,
            "total_output_tokens": sum(lens), "output_lens": lens,
            "generated_texts": texts, "errors": errors}


def test_the_fault_bench_counts_what_the_client_saw(tmp_path):
    args = migration_faults.parse_args(["--vllm-python", sys.executable, "--model", ".",
                                        "--prompts", "4", "--output-len", "3",
                                        "--state-dir", str(tmp_path), "--out", str(tmp_path)])
    uncut = client_result(["a", "b", "c", "d"], [3, 3, 3, 3], ["", "", "", ""])
    cut = client_result(["a", "b", "", "d"], [3, 3, 0, 3],
                        ["", "", "Traceback ...\nClientPayloadError: not completed", ""])
    row = migration_faults.compare(cut, uncut, args)
    assert (row["failed"], row["output_tokens"], row["expected_tokens"]) == (1, 9, 12)
    assert (row["short"], row["texts_equal"]) == (1, 3)
    assert row["errors"] == ["ClientPayloadError: not completed"]
    table = migration_faults.markdown([{"mode": "off", "rounds": [
        {**row, "fault": {"back_s": 20.0}}], "counters": {
        'streams_cut_total{why="not_resumable"}': 1.0}}], args)
    assert "| off | 4 | 1 | 250.0 | 9 / 12 | 3 of 4 | 20 |" in table


def test_the_overhead_bench_runs_each_mode(tmp_path):
    done = subprocess.run([sys.executable, str(BENCH / "migration_overhead.py"), "--duration",
                           "0.5", "--rounds", "1"], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| o")]
    assert [row.split(" | ")[0] for row in rows] == ["| off", "| on", "| on, ids asked"]
    assert all(row.endswith("| 0 |") for row in rows), rows  # no stream failed
