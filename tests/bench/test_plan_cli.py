"""`omni-dp plan` as a person runs it, on this machine with the built-in engine (its real dry
run, the real CPU topology): the JSON's numbers, the text's wording, bad input exiting 2."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from omni_dp.launcher.planning.topology import read_topology


def omni_dp(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "omni_dp", *args], capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL)


PLAN = ("plan", "--gpu", "none", "--max-total-tokens", "1024")


def test_plan_on_this_machine_with_the_builtin_engine():
    result = omni_dp(*PLAN, "--json", "--", "--model", "tiny")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    physical = len(read_topology().cores)  # this process's affinity, as the child inherits it
    assert data["n_cores"] == data["physical_cores"] == physical
    assert data["engine"] == "builtin" and data["device"] == "cpu" and data["gpus"] == []
    assert data["n_mps_clients"] is None
    sizing = data["sizing"]
    assert sizing["kv_tokens"] == 1024 and sizing["device"] == "cpu"
    assert sizing["total_bytes"] == (sizing["weights_bytes"] + sizing["kv_cache_bytes"]
                                     + sizing["overhead_bytes"])
    assert data["shares_weights"] and data["n_memory_shared"] >= data["n_memory"] >= 1
    assert data["n_fits"] == min(data["n_memory"], physical)
    assert data["candidates"] == ["1", *(str(n) for n in range(2, data["n_fits"] + 1))]
    assert data["bench_command"].endswith(
        f"bench --configs {','.join(data['candidates'])} -- --gpu none --max-total-tokens 1024 "
        "-- --model tiny")
    assert {limit["name"] for limit in data["limits"]} == {"memory", "memory (shared)",
                                                            "cpu cores"}


def test_plan_text_says_fits_with_its_formulas_never_faster():
    result = omni_dp(*PLAN, "--", "--model", "tiny")
    assert result.returncode == 0, result.stderr
    text = re.sub(" {2,}", "  ", result.stdout)  # the columns' width is the widest label's
    for words in ("per replica  weights ", "memory  N ≤ ", "cpu cores  N ≤ ",
                  "no GPU: MPS does not apply", "fits  N = min(", "confirm with  ",
                  "bench --configs 1,"):
        assert words in text, words
    assert "faster" not in text.replace("not faster", "")


def test_plan_to_a_pipe_is_one_line_per_row_and_markdown_on_request():
    """Printed to a pipe (a file, a CI log) no row is wrapped, however long; markdown is a
    table with every row of the text."""
    text = omni_dp(*PLAN, "--", "--model", "tiny").stdout.splitlines()
    assert text[0].startswith("omni-dp plan: engine builtin on the CPU")
    rows = text[1:]
    assert all(line.startswith("  ") and line[2] != " " for line in rows), text
    assert max(map(len, rows)) > 120  # the memory formula: one line, not squeezed to 80
    labels = [line.split("  ")[1] for line in rows]
    md = omni_dp(*PLAN, "--format", "markdown", "--", "--model", "tiny").stdout.splitlines()
    assert md[0] == f"**{text[0]}**" and md[2:4] == ["| what | value |", "|---|---|"]
    assert [line.split(" | ")[0].lstrip("| ") for line in md[4:]] == labels


def test_plan_unpinned_says_it_took_the_engines_default():
    result = omni_dp("plan", "--gpu", "none", "--json", "--", "--model", "tiny")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert not data["kv_pinned"] and data["sizing"]["kv_tokens"] == 16384
    assert any(note.startswith("KV not pinned: planned with the engine's default (16384")
               for note in data["notes"])
    assert "--max-total-tokens 16384" in data["bench_command"]  # pinned for equal KV


@pytest.mark.parametrize(("args", "says"), [
    (("--gpu", "7"), "omni-dp plan: --gpu 7: "),
    (("--gpu", "none", "--memory-headroom", "1.5"),
     "omni-dp plan: --memory-headroom must be a fraction in [0, 1), got 1.5"),
    (("--gpu", "none", "--max-total-tokens", "1000", "--", "--model", "tiny"),
     "omni-dp plan: engine: --max-total-tokens 1000 is not a whole number of 16-token pages"),
    (("--gpu", "none", "--cores-per-replica", "0"), "Invalid value for '--cores-per-replica'"),
])
def test_bad_input_exits_2_naming_it_without_a_traceback(args, says):
    result = omni_dp("plan", *args)
    assert result.returncode == 2, result
    assert says in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_plans_flags_are_launchs_own_settings():
    """Generated from LaunchOptions' fields: the same flags, defaults and checks as launch."""
    from omni_dp.cli import plan
    from omni_dp.cli.commands.plan import PLAN_FIELDS
    from omni_dp.cli.common import FieldOption
    from omni_dp.launcher.planning.options import LaunchOptions

    generated = {p.name: p for p in plan.params if isinstance(p, FieldOption)}
    assert set(generated) == set(PLAN_FIELDS)
    for name, option in generated.items():
        assert option.field.name == name and option.opts[0] == "--" + name.replace("_", "-")
    assert generated["memory_headroom"].default == LaunchOptions.memory_headroom
    result = omni_dp("plan", "--help")
    assert result.returncode == 0 and "How many replicas FIT this machine" in result.stdout
