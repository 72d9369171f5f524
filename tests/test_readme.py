"""The commands of the README and of the docs site's pages (docs/*.md) as written: one prefix,
every flag one the command has, the sample output in the shape the command prints today.

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

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# The README and every page its reference moved into: each command and sample checked where it is.
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
PREFIX = ".venv/bin/omni-dp"
PLACEHOLDER = re.compile(r"\[[^\]]*\]")  # `[RUN_ID]`, `[--json]`, `[--replica I | --router]`


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def blocks(kind: str, pages: list[Path] = PAGES) -> list[str]:
    """The fenced blocks of one kind (`bash`, or "" for output samples) of `pages`, a block
    indented in a list item included."""
    return [block for page in pages for block in _page_blocks(kind, page)]


def _page_blocks(kind: str, page: Path) -> list[str]:
    found, inside, lines, indent = [], None, [], ""
    for line in page.read_text().splitlines():
        stripped = line.lstrip(" ")
        if not stripped.startswith("```"):
            lines.append(line[len(indent):] if line.startswith(indent) else line)
        elif inside is None:
            inside, lines, indent = stripped[3:].strip(), [], line[:len(line) - len(stripped)]
        else:
            if inside == kind:
                found.append("\n".join(lines) + "\n")
            inside, indent = None, ""
    return found


def commands(pages: list[Path] = PAGES) -> list[str]:
    """Every command line of the bash blocks: continuations joined, comments dropped, `a; b`
    and `a && b` split."""
    found = []
    for block in blocks("bash", pages):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            found += [part.strip() for part in re.split(r"&&|;", line) if part.strip()]
    return found


def omni_dp_commands(pages: list[Path] = PAGES) -> list[list[str]]:
    runs = []
    for command in commands(pages):
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


def test_the_readme_tours_the_run_s_commands():
    toured = {args[0] for args in omni_dp_commands([README])}
    assert {"launch", "status", "top", "restart", "scale", "down"} <= toured, toured


def _page_commands() -> list[tuple[str, list[str]]]:
    return [(_name(page), args) for page in PAGES for args in omni_dp_commands([page])]


@pytest.mark.parametrize(("page", "args"), _page_commands(),
                         ids=[f"{page}: {' '.join(args)}"[:80] for page, args in _page_commands()])
def test_every_command_of_the_readme_and_the_docs_parses(page, args):
    cut = args.index("--") if "--" in args else len(args)
    result = CliRunner().invoke(cli, [*args[:cut], "--help", *args[cut:]], prog_name="omni-dp")
    assert result.exit_code == 0, f"{page}: {' '.join(args)}:\n{result.output}"


def _rows(text: str) -> tuple[str, list[str]]:
    """A plan's first words and its labels, in order."""
    lines = text.strip().splitlines()
    return lines[0].split(";")[0], [line[2:].split("  ")[0] for line in lines[1:]]


def test_the_plan_sample_is_what_plan_prints():
    page = next(p for p in PAGES if any(b.startswith("omni-dp plan: ") for b in blocks("", [p])))
    sample = next(b for b in blocks("", [page]) if b.startswith("omni-dp plan: "))
    command = next(a for a in omni_dp_commands([page]) if a[0] == "plan")
    printed = subprocess.run([sys.executable, "-m", "omni_dp", *command], capture_output=True,
                             text=True, timeout=120)
    assert printed.returncode == 0, printed.stderr
    assert _rows(sample) == _rows(printed.stdout)
    confirm = next(line for line in sample.splitlines() if "confirm with" in line)
    assert confirm.split("confirm with", 1)[1].strip().startswith(PREFIX + " bench ")


def test_yaml_keys_are_spelled_with_dashes_as_the_flags_are():
    text = "\n".join(page.read_text() for page in PAGES)
    keys = re.findall(r"YAML `([a-z_-]+)`", text) + re.findall(r"`([a-z_-]+):` in the YAML", text)
    assert keys, "no page names a YAML key: this test checks nothing"
    assert [k for k in keys if "_" in k] == []


def test_the_ready_sample_is_the_line_launch_prints():
    from omni_dp.launcher.views.summary import RunSummary

    samples = [line for block in blocks("") for line in block.splitlines()
               if line.startswith("omni-dp: ready: ")]
    assert len(samples) >= 2  # the README's tour and the launcher's page
    summary = RunSummary(run_id="run-x", endpoint="http://127.0.0.1:8000",
                         replicas=[{"health": "healthy"}] * 2,
                         checks=("health", "equal KV"), try_command="", status_command="",
                         teardown_command="")
    run_id = re.compile(r"run run-[\w-]+;")
    for sample in samples:
        assert run_id.sub("run RUN;", sample) == run_id.sub("run RUN;", f"omni-dp: "
                                                                            f"{summary.ready_line}")
