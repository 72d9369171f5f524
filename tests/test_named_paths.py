"""Every repository path that a module docstring or a documentation page names exists.

A docstring that names a file (`omni_dp/launcher/planning/options.py`, `engine/plan.py`,
`bench/weight_share.py`, `docs/contracts.md`, or a sibling module as `gates.py`) is how a reader
finds their way; once the file moves the pointer is wrong and nothing else notices. The same
for the docs site's pages, whose pointers to files outside docs/ are code spans (MkDocs' strict
build checks the links between pages, not a path into the rest of the repository).

What counts as a path: a word with a slash whose first part is a folder of the repository
(`omni_dp/...`, `bench/...`) or of the package (`engine/...`, `launcher/...`), resolved against
the repository's root, the package and the module's own folder and the folders above it; or,
in a docstring, a bare `name.py`, resolved against the module's folder and those above it (a
`test_*.py` anywhere under tests/). Names of other projects' files (`torch/...`), files a run
writes (`run.json`, `mps/daemon.json`) and placeholders (`DIR/summary.json`) are not paths of
this repository and are not checked.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "omni_dp"
SCANNED = ("omni_dp", "bench", "scripts", "tests/support")
TOP = ("omni_dp", "bench", "scripts", "tests", "docs", "deploy")
SOURCE_SUFFIXES = (".py", ".md", ".sh", ".yaml", ".yml", ".toml")
# A docstring's bare names that are not this repository's files, each with why.
NOT_OURS = {
    ("bench/migration_faults.py", "serve.py"): "vLLM's own `vllm bench serve` module",
    ("tests/support/mps_hybrid.py", "sitecustomize.py"): "the file the stand-in writes",
}
_WORD = re.compile(r"(?<![\w./~$<-])([\w-][\w.-]*(?:/[\w.-]+)*/?)")
_OUTPUT = re.compile(r"(--out|>)\s*$")  # `--out bench/results/x.json`: what a command writes


def _package_dirs() -> set[str]:
    return {p.name for base in (PACKAGE, ROOT / "tests") for p in base.rglob("*")
            if p.is_dir() and p.name != "__pycache__"}


PACKAGE_DIRS = _package_dirs()


def named_paths(text: str, *, in_docstring: bool) -> list[str]:
    """The words of `text` that look like paths of this repository (on a page, only those
    from the root: a page's `share/` is a run's folder, not the package's)."""
    found = []
    for match in _WORD.finditer(text):
        word = match.group(1).rstrip(".")
        if _OUTPUT.search(text[:match.start()]):
            continue
        first, slash, _ = word.partition("/")
        if slash:
            suffix = Path(word.rstrip("/")).suffix
            if first in TOP or (in_docstring and first in PACKAGE_DIRS
                                and suffix in SOURCE_SUFFIXES):
                found.append(word)
        elif in_docstring and word.endswith(".py") and len(word) > 3:
            found.append(word)
    return found


def resolves(word: str, near: Path) -> bool:
    bases = [ROOT, PACKAGE, near, *[p for p in near.parents if p == ROOT or ROOT in p.parents]]
    if any((base / word).exists() for base in bases):
        return True
    return "/" not in word and word.startswith("test_") and any((ROOT / "tests").rglob(word))


def docstrings() -> list[tuple[Path, str]]:
    found = []
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            doc = ast.get_docstring(ast.parse(path.read_text(), str(path)))
            if doc:
                found.append((path, doc))
    return found


def _code_spans(markdown: str) -> str:
    return "\n".join(re.findall(r"`([^`\n]+)`", markdown))


def test_the_scan_finds_paths():
    """The patterns work: a docstring's repository paths are seen, other paths are not."""
    text = ("omni_dp/runfile.py, engine/plan.py and gates.py; `bench/results/`; "
            "torch/multiprocessing/reductions.py, run.json, mps/daemon.json, DIR/summary.json")
    assert named_paths(text, in_docstring=True) == [
        "omni_dp/runfile.py", "engine/plan.py", "gates.py", "bench/results/"]
    assert len([p for _, doc in docstrings() for p in named_paths(doc, in_docstring=True)]) > 100
    assert not resolves("gates.py", PACKAGE / "launcher")  # a module of a subpackage, not here
    assert resolves("gates.py", PACKAGE / "launcher" / "bringup")


def test_every_path_a_module_docstring_names_exists():
    missing = []
    for path, doc in docstrings():
        module = str(path.relative_to(ROOT))
        for word in named_paths(doc, in_docstring=True):
            if (module, word) not in NOT_OURS and not resolves(word, path.parent):
                missing.append(f"{module} names {word}")
    assert missing == [], "docstrings name files that do not exist:\n" + "\n".join(missing)


@pytest.mark.parametrize("page", [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_a_page_names_exists(page):
    missing = [word for word in named_paths(_code_spans(page.read_text()), in_docstring=False)
               if not any((base / word).exists() for base in (ROOT, PACKAGE))]
    assert missing == [], f"{page.relative_to(ROOT)} names files that do not exist: {missing}"
