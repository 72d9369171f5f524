"""The house as the design describes it: the launcher's rooms follow a run's life and import
only downwards, no class name means two things, and docs/design.md's map is the tree.

Imports are read from the source (absolute `omni_dp...` imports, lazy ones inside functions
included), so a new arrow that breaks the layering fails here before a reader trips on it.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "omni_dp"
LAUNCHER = "omni_dp.launcher"

# Each room of the launcher and the rooms it may import (itself always). A run's life, bottom
# up: engine adapters; pure planning; the run's record; the processes it starts; bring-up; the
# teardown; supervision; `launch` at the top. The views read the record and the plan, and never
# start or stop anything.
MAY_IMPORT: dict[str, set[str]] = {
    "engines": set(),
    "planning": {"engines"},
    "record": {"planning", "engines"},
    "processes": {"record", "planning", "engines"},
    "bringup": {"processes", "record", "planning", "engines"},
    "teardown": {"bringup", "processes", "record", "planning", "engines"},
    "supervision": {"teardown", "bringup", "processes", "record", "planning", "engines"},
    "views": {"record", "planning", "engines"},
    "launch": {"supervision", "teardown", "bringup", "processes", "record", "planning",
               "engines", "views"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(path: Path, *, top_level_only: bool = False) -> set[str]:
    """The omni_dp modules a file imports (`from X import y` counts X, and X.y when that is a
    module: `from omni_dp.launcher import launch`)."""
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    if top_level_only:  # `if TYPE_CHECKING:` blocks run no import
        nodes = [n for n in nodes if isinstance(n, (ast.Import, ast.ImportFrom))]
    found = set()
    known = modules()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("omni_dp")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                node.module.startswith("omni_dp"):
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names
                      if f"{node.module}.{a.name}" in known}
    return found


def room(module: str) -> str | None:
    """The launcher room a module belongs to; None outside the launcher."""
    if not module.startswith(LAUNCHER + "."):
        return None
    return module[len(LAUNCHER) + 1:].split(".")[0]


def test_every_launcher_module_is_in_a_room_of_the_map():
    rooms = {room(m) for m in modules() if room(m)}
    assert rooms == set(MAY_IMPORT), "a room of the launcher is missing from MAY_IMPORT " \
        "(or one there no longer exists): say where it sits in a run's life"


def test_the_launcher_imports_only_downwards():
    wrong = []
    for module, path in modules().items():
        mine = room(module)
        if mine is None:
            continue
        for imported in imports_of(path):
            theirs = room(imported)
            if theirs and theirs != mine and theirs not in MAY_IMPORT[mine]:
                wrong.append(f"{module} ({mine}) imports {imported} ({theirs})")
    assert not wrong, "\n".join(wrong)


def test_planning_signals_and_writes_nothing():
    """Planning reads the machine (facts: /sys, NVML, the engine's dry run) and plans; it
    never signals a process or writes a file: a refused launch leaves nothing behind."""
    for module, path in modules().items():
        if room(module) == "planning":
            source = path.read_text()
            for name in ("os.kill(", "os.killpg(", "send_signal(", "atomic_write(",
                         "write_text(", "write_bytes(", "mkdir(", "open_private("):
                assert name not in source, f"{module} uses {name}: planning only plans"


def test_the_rooms_and_the_modules_form_no_cycle():
    graph = defaultdict(set)
    for module, path in modules().items():
        if room(module) is None:
            continue
        for imported in imports_of(path, top_level_only=True):
            if room(imported) and imported != module:
                graph[module].add(imported)
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])
    rooms = {r: MAY_IMPORT[r] for r in MAY_IMPORT}
    assert find_cycle(rooms) is None


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_check_finds_a_cycle_and_a_wrong_arrow():
    """The checks above can fail: a planted cycle and a planted upward arrow are seen."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    assert "bringup" not in MAY_IMPORT["planning"] and "bringup" not in MAY_IMPORT["views"]


# --- one name per thing --------------------------------------------------------------------


def public_classes() -> dict[str, list[str]]:
    found = defaultdict(list)
    for module, path in modules().items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                found[node.name].append(module)
    return found


def test_no_public_class_name_is_defined_twice():
    twice = {name: where for name, where in public_classes().items() if len(where) > 1}
    assert not twice, twice


# --- the design's map is the tree --------------------------------------------------------------


def design_map() -> set[str]:
    """The packages docs/design.md's map names (`omni_dp/...`/ lines of its Layout block)."""
    text = (ROOT / "docs" / "design.md").read_text()
    block = re.search(r"<!-- map -->\n```\n(.*?)```", text, re.S)
    assert block, "docs/design.md has no map (a ``` block after <!-- map -->)"
    return {m.rstrip("/") for m in re.findall(r"^\s*(omni_dp/[a-z_/]+/)", block.group(1), re.M)}


def packages() -> set[str]:
    return {str(p.parent.relative_to(ROOT)) for p in PACKAGE.rglob("__init__.py")} - {"omni_dp"}


def test_the_design_map_names_every_package_and_only_packages():
    named, present = design_map(), packages()
    assert not named - present, f"the map names packages that do not exist: {named - present}"
    assert not present - named, f"packages the map does not name: {present - named}"


@pytest.mark.parametrize("folder", ["bench", "omni_dp/bench"])
def test_each_bench_folder_says_what_it_is_for_and_when_to_use_the_other(folder):
    readme = ROOT / folder / "README.md"
    assert readme.is_file(), f"{folder} has no README.md"
    other = "omni_dp/bench" if folder == "bench" else "bench/"
    assert other in readme.read_text()
