"""The order the suite's files start in: the longest first.

scripts/test runs the files side by side in pytest-xdist workers (`--dist loadfile`), each
worker taking the next file as it finishes one. A run ends when its last file does, so a long
file started late leaves one worker running it alone while the other has nothing left: the
longest files go first (longest-processing-time-first), the many short ones fill in after.
xdist would otherwise order files by their number of tests (`--loadscope-reorder`, turned off
in scripts/test), which puts the live files of one or two long tests last.

LONGEST_FIRST is measured (`scripts/test` prints the slowest tests; a file's time is the sum
of its tests'), not derived: a file missing from it runs in collection order after those in it.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

LONGEST_FIRST = (
    "tests/test_gpu_run.py",
    "tests/launcher/test_engine_vllm_live.py",
    "tests/test_soak.py",
    "tests/launcher/test_launcher_mps.py",
    "tests/launcher/test_launcher_e2e.py",
    "tests/test_voice_run.py",
    "tests/launcher/test_changes_live.py",
    "tests/engine/test_placement_serve.py",
    "tests/launcher/test_launcher_gates_mutants.py",
    "tests/bench/test_bench_cli.py",
    "tests/launcher/test_launcher_gpus.py",
    "tests/bench/test_runner.py",
    "tests/launcher/test_launcher_hardening.py",
    "tests/test_cli.py",
    "tests/test_agent_frameworks.py",
    "tests/launcher/test_launcher_gateway.py",
    "tests/engine/test_lifecycle.py",
    "tests/engine/test_openai_compat.py",
    "tests/engine/test_server.py",
    "tests/router/test_router_resume.py",
    "tests/launcher/test_dashboard_live.py",
    "tests/launcher/test_launcher_share.py",
)


def longest_first(items: Sequence[pytest.Item]) -> list[pytest.Item]:
    """`items` with the files of LONGEST_FIRST first, in its order; each file's tests, and the
    other files, in the order they were collected (a stable sort)."""
    rank = {path: n for n, path in enumerate(LONGEST_FIRST)}
    return sorted(items, key=lambda item: rank.get(item.nodeid.partition("::")[0],
                                                   len(LONGEST_FIRST)))
