"""The house as docs/design.md describes it, checked on the source itself: the import rules
between packages ("Architecture"), the launcher's rooms importing only downwards, no cycle, one
class name per thing, and the design's map of the tree.

A rule that only lives in prose is broken by the first convenient import; these tests read every
module's imports with `ast` (module level and inside functions) and fail naming the import.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "omni_dp"
SUBPACKAGES = ("engine", "mps", "router", "launcher", "bench", "cli")
# The engine, the MPS supervision and the router stand alone: each may use the small shared
# modules at omni_dp/ but none of the other subpackages (the launcher drives them by argv, HTTP
# and files). The bench may use the launcher's machine facts and formulas (`plan`: what fits
# is what launch accepts). Shared modules import no subpackage, except runfile (the run-state
# format holds the MPS daemon's and attachment's records).
MAY_IMPORT = {
    "engine": set(),
    "mps": set(),
    "router": set(),
    "launcher": {"mps"},
    "bench": {"launcher", "mps"},
    "cli": {"engine", "mps", "router", "launcher", "bench"},
    "shared": set(),
    "runfile": {"mps"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every omni_dp import in the file; relative imports resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((node.lineno, target))
            # `from omni_dp import x` may name a module
            found += [(node.lineno, f"{target}.{a.name}") for a in node.names
                      if (PACKAGE.parent / Path(*f"{target}.{a.name}".split("."))).with_suffix(
                          ".py").exists()]
    return [(line, name) for line, name in found if name.split(".")[0] == "omni_dp"]


def area(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in SUBPACKAGES:
        return parts[1]
    if module == "omni_dp.__main__":  # `python -m omni_dp`: the command line
        return "cli"
    return "runfile" if module == "omni_dp.runfile" else "shared"


def sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_each_package_imports_only_what_the_design_allows():
    broken = []
    for path in sources():
        mine = area(module_name(path))
        for line, target in imports_of(path):
            theirs = area(target)
            if theirs in ("shared", "runfile") and target != "omni_dp" and mine != "shared":
                continue  # the small shared modules serve every package
            if target == "omni_dp" or theirs == mine:
                continue
            if theirs not in MAY_IMPORT[mine]:
                broken.append(f"{path.relative_to(ROOT)}:{line} imports {target} "
                              f"({mine} may not import {theirs})")
    assert not broken, "\n".join(broken)


def test_the_module_graph_has_no_cycle():
    """Imports inside functions count too: deferring one hides a cycle, it does not remove
    the two modules' dependence on each other."""
    graph: dict[str, set[str]] = {}
    names = {module_name(p) for p in sources()}
    for path in sources():
        targets = set()
        for _, target in imports_of(path):
            while target and target not in names:  # `from a.b import name` → a.b
                target = target.rpartition(".")[0]
            if target and target != module_name(path):
                targets.add(target)
        graph[module_name(path)] = targets

    cycles, done, stack = [], set(), []

    def visit(node: str) -> None:
        if node in stack:
            cycles.append(" -> ".join([*stack[stack.index(node):], node]))
            return
        if node in done:
            return
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if not nxt.endswith("__init__") and nxt != node.rpartition(".")[0]:
                visit(nxt)
        stack.pop()
        done.add(node)

    for node in sorted(graph):
        visit(node)
    assert not cycles, "\n".join(cycles)


def test_nothing_on_the_launchers_path_imports_torch():
    """Every launcher, MPS and run-state module, and the CLI with all its commands loaded,
    import without torch: `launch`, `status`, `down`, `verify-mps` start in well under a
    second, and the launcher never holds a CUDA context of its own."""
    modules = sorted(module_name(p) for p in sources()
                     if area(module_name(p)) in ("launcher", "mps", "bench", "runfile", "cli",
                                                 "shared")
                     and p.name != "__main__.py")
    code = ("import importlib, sys\n"
            f"for name in {modules!r}:\n"
            "    importlib.import_module(name)\n"
            "    assert 'torch' not in sys.modules, name + ' imported torch'\n"
            "from omni_dp.cli import cli\n"
            "for name in cli.list_commands(None):\n"
            "    cli.get_command(None, name)\n"
            "assert 'torch' not in sys.modules, 'a command module imported torch'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr


# --- the launcher's rooms ----------------------------------------------------------------------

LAUNCHER = "omni_dp.launcher"
# Each room of the launcher and the rooms it may import (itself always). A run's life, bottom
# up: the engine adapters; pure planning; the run's record; the processes it starts; bring-up;
# day-two changes as planned and asked for (the supervisor makes them); the teardown;
# supervision; `launch` at the top. The views read the record and the plan, and
# never start or stop anything.
ROOMS_MAY_IMPORT: dict[str, set[str]] = {
    "engines": set(),
    "planning": {"engines"},
    "record": {"planning", "engines"},
    "processes": {"record", "planning", "engines"},
    "bringup": {"processes", "record", "planning", "engines"},
    "changes": {"record", "planning", "engines"},
    "teardown": {"bringup", "processes", "record", "planning", "engines"},
    "supervision": {"teardown", "changes", "bringup", "processes", "record", "planning",
                    "engines"},
    "views": {"record", "planning", "engines"},
    "launch": {"supervision", "teardown", "changes", "bringup", "processes", "record",
               "planning", "engines", "views"},
}


def room(module: str) -> str | None:
    """The launcher room a module belongs to (a package, or launch/teardown at the top)."""
    if not module.startswith(LAUNCHER + "."):
        return None
    return module[len(LAUNCHER) + 1:].split(".")[0]


def test_every_launcher_module_is_in_a_room_the_rules_know():
    rooms = {room(module_name(p)) for p in sources()} - {None}
    assert rooms == set(ROOMS_MAY_IMPORT), (
        "a room of the launcher is missing from ROOMS_MAY_IMPORT (or one there is gone): say "
        "where it sits in a run's life")


def test_the_launcher_rooms_import_only_downwards():
    """Planning imports nothing of bring-up or supervision; the views no bring-up; and so on."""
    broken = []
    for path in sources():
        mine = room(module_name(path))
        if mine is None:
            continue
        for line, target in imports_of(path):
            theirs = room(target)
            if theirs and theirs != mine and theirs not in ROOMS_MAY_IMPORT[mine]:
                broken.append(f"{path.relative_to(ROOT)}:{line} imports {target} ({mine} may "
                              f"not import {theirs})")
    assert not broken, "\n".join(broken)


def test_the_rooms_themselves_form_no_cycle():
    seen: set[str] = set()

    def below(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, " -> ".join((*path, name))
        if name not in seen:
            for lower in ROOMS_MAY_IMPORT[name]:
                below(lower, (*path, name))
            seen.add(name)

    for name in ROOMS_MAY_IMPORT:
        below(name, ())


def test_planning_signals_and_writes_nothing():
    """Planning reads the machine (facts: /sys, NVML, the engine's dry run) and plans; it never
    signals a process or writes a file: a refused launch leaves nothing behind."""
    for path in sources():
        if room(module_name(path)) == "planning":
            source = path.read_text()
            for call in ("os.kill(", "os.killpg(", "send_signal(", "atomic_write(",
                         "write_text(", "write_bytes(", "mkdir("):
                assert call not in source, f"{path.relative_to(ROOT)} calls {call}..)"


# --- one name per thing ------------------------------------------------------------------------


def test_no_public_class_name_is_defined_twice():
    where: dict[str, list[str]] = defaultdict(list)
    for path in sources():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                where[node.name].append(module_name(path))
    twice = {name: modules for name, modules in where.items() if len(modules) > 1}
    assert not twice, twice


# --- the design's map is the tree ----------------------------------------------------------------


def design_map() -> set[str]:
    """The packages docs/design.md's map names (the `omni_dp/.../` lines of its Layout block)."""
    text = (ROOT / "docs" / "design.md").read_text()
    block = re.search(r"<!-- the map: tests/test_architecture.py -->\n```\n(.*?)```", text,
                      re.S)
    assert block, "docs/design.md has no map (a ``` block after its map comment)"
    return {m.rstrip("/") for m in re.findall(r"^(omni_dp/(?:[a-z_]+/)*)\s", block.group(1),
                                                re.M)}


def test_the_design_map_names_every_package_and_only_packages():
    named = design_map()
    present = {str(p.parent.relative_to(ROOT)) for p in PACKAGE.rglob("__init__.py")}
    assert not named - present, f"the map names packages that do not exist: {named - present}"
    assert not present - named, f"packages the map does not name: {present - named}"


@pytest.mark.parametrize(("folder", "other"), [("bench", "omni_dp/bench"),
                                               ("omni_dp/bench", "bench/")])
def test_each_bench_folder_says_what_it_is_for_and_when_to_use_the_other(folder, other):
    readme = ROOT / folder / "README.md"
    assert readme.is_file(), f"{folder} has no README.md"
    assert other in readme.read_text()
