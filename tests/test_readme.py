"""The README's commands as written: one prefix, every flag one the command has, the sample
output in the shape the command prints today.

A command is checked by parsing it with `--help` added before its `--` (click rejects an
unknown option before it shows help), so nothing is started; the commands that start runs are
run by the end-to-end tests.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from omni_dp.cli import cli

README = Path(__file__).resolve().parents[1] / "README.md"
PREFIX = ".venv/bin/omni-dp"
PLACEHOLDER = re.compile(r"\[[^\]]*\]")  # `[RUN_ID]`, `[--json]`, `[--replica I | --router]`


def blocks(kind: str) -> list[str]:
    """The fenced blocks of one kind (`bash`, or "" for output samples)."""
    found, inside, lines = [], None, []
    for line in README.read_text().splitlines():
        if not line.startswith("```"):
            lines.append(line)
        elif inside is None:
            inside, lines = line[3:].strip(), []
        else:
            if inside == kind:
                found.append("\n".join(lines) + "\n")
            inside = None
    return found


def commands() -> list[str]:
    """Every command line of the bash blocks: continuations joined, comments dropped, `a; b`
    and `a && b` split."""
    found = []
    for block in blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            found += [part.strip() for part in re.split(r"&&|;", line) if part.strip()]
    return found


def omni_dp_commands() -> list[list[str]]:
    runs = []
    for command in commands():
        if not command.startswith(PREFIX + " "):
            continue
        command = re.sub(r"\$\([^)]*\)", "HOST", command)  # `$(hostname -f)`: the shell's
        words = shlex.split(PLACEHOLDER.sub("", command.replace("…", "")))
        runs.append(words[1:])
    return runs


def test_every_omni_dp_command_has_the_one_prefix():
    bare = [c for c in commands() if re.match(r"(\S*/)?omni-dp\b", c) and not
            c.startswith(PREFIX + " ")]
    assert bare == [], f"use {PREFIX} (what scripts/setup installs): {bare}"
    assert len(omni_dp_commands()) >= 30


@pytest.mark.parametrize("args", omni_dp_commands(), ids=lambda a: " ".join(a)[:60])
def test_every_readme_command_parses(args):
    cut = args.index("--") if "--" in args else len(args)
    result = CliRunner().invoke(cli, [*args[:cut], "--help", *args[cut:]], prog_name="omni-dp")
    assert result.exit_code == 0, f"{' '.join(args)}:\n{result.output}"


def _rows(text: str) -> tuple[str, list[str]]:
    """A plan's first words and its labels, in order."""
    lines = text.strip().splitlines()
    return lines[0].split(";")[0], [line[2:].split("  ")[0] for line in lines[1:]]


def test_the_plan_sample_is_what_plan_prints():
    sample = next(b for b in blocks("") if b.startswith("omni-dp plan: "))
    command = next(a for a in omni_dp_commands() if a[0] == "plan")
    printed = subprocess.run([sys.executable, "-m", "omni_dp", *command], capture_output=True,
                             text=True, timeout=120)
    assert printed.returncode == 0, printed.stderr
    assert _rows(sample) == _rows(printed.stdout)
    confirm = next(line for line in sample.splitlines() if "confirm with" in line)
    assert confirm.split("confirm with", 1)[1].strip().startswith(PREFIX + " bench ")


def test_yaml_keys_are_spelled_with_dashes_as_the_flags_are():
    text = README.read_text()
    keys = re.findall(r"YAML `([a-z_-]+)`", text) + re.findall(r"`([a-z_-]+):` in the YAML", text)
    assert keys, "the README names no YAML key: this test checks nothing"
    assert [k for k in keys if "_" in k] == []


def test_the_ready_sample_is_the_line_launch_prints():
    from omni_dp.launcher.views.summary import RunSummary

    sample = next(line for block in blocks("") for line in block.splitlines()
                  if line.startswith("omni-dp: ready: "))
    summary = RunSummary(run_id="run-x", endpoint="http://127.0.0.1:8000",
                         replicas=[{"health": "healthy"}] * 2,
                         checks=("health", "equal KV"), try_command="", status_command="",
                         teardown_command="")
    run_id = re.compile(r"run run-[\w-]+;")
    assert run_id.sub("run RUN;", sample) == run_id.sub("run RUN;", f"omni-dp: "
                                                                        f"{summary.ready_line}")
