"""The declared dependencies are exactly the third-party packages omni_dp imports: none unused
(each one is a download for every user), none missing (one only installed by chance as another
package's dependency breaks when that package changes)."""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
# Extras that are not part of what omni_dp runs with (the test tools).
NOT_RUNTIME_EXTRAS = {"test"}
# Builds of a declared distribution under another name, that scripts/setup installs in its
# place: where torch is a CUDA build, the GPU onnxruntime (one module, two distributions).
SAME_AS_DECLARED = {"onnxruntime-gpu": "onnxruntime"}


def declared() -> dict[str, Requirement]:
    """Runtime requirements (extras but the test tools' included), by canonical name."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for extra, requirements in project.get("optional-dependencies", {}).items():
        if extra not in NOT_RUNTIME_EXTRAS:
            lines += requirements
    return {canonicalize_name(r.name): r for r in map(Requirement, lines)}


def applies_here(requirement: Requirement) -> bool:
    return requirement.marker is None or requirement.marker.evaluate()


def imported_modules() -> dict[str, str]:
    """Top-level module -> a file importing it, for every absolute import in omni_dp, lazy
    ones inside functions included."""
    found: dict[str, str] = {}
    for path in sorted((ROOT / "omni_dp").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], str(path.relative_to(ROOT)))
    return found


def third_party(modules: dict[str, str]) -> dict[str, str]:
    return {m: where for m, where in modules.items()
            if m not in sys.stdlib_module_names and m not in ("omni_dp", "__future__")}


@functools.cache
def _packages_distributions() -> dict[str, list[str]]:
    """Read once: it walks every installed distribution's file list (seconds a call)."""
    return importlib.metadata.packages_distributions()


def distributions(module: str) -> set[str]:
    """The installed distributions that provide a top-level module, by canonical name."""
    provided = _packages_distributions().get(module, [])
    names = {canonicalize_name(d) for d in provided}
    return {SAME_AS_DECLARED.get(name, name) for name in names}


def test_every_declared_dependency_is_imported_by_omni_dp():
    modules = third_party(imported_modules())
    used: set[str] = set()
    for module in modules:
        used |= distributions(module)
    # One for another Python or platform is not installed here, so nothing maps it to its
    # module: take the usual spelling (async-timeout -> async_timeout).
    used |= {name for name, r in declared().items()
             if not applies_here(r) and name.replace("-", "_") in modules}
    unused = sorted(set(declared()) - used)
    assert not unused, (f"declared in pyproject.toml but imported nowhere in omni_dp: {unused}; "
                        "remove them (or they are not installed here: install them)")


def test_every_third_party_import_is_declared():
    names = set(declared())
    # An import not installed here (behind a version check) is taken by its usual spelling.
    undeclared = {module: where for module, where in third_party(imported_modules()).items()
                  if not (distributions(module) or {canonicalize_name(module)}) & names}
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"


def test_the_checks_see_lazy_imports_and_map_distribution_names():
    modules = imported_modules()
    assert "pynvml" in modules and "uvloop" in modules  # imported inside functions only
    assert distributions("pynvml") == {"nvidia-ml-py"}
    assert distributions("yaml") == {"pyyaml"}
    assert set(SAME_AS_DECLARED.values()) <= set(declared())  # each stands for a declared one
