"""The repository stands alone: nothing in it points at the folder beside the checkout that CI
has and users do not, and the README's pointers to the design lead to files that exist."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The folder beside the checkout, by relative path and by this checkout's absolute one (never a
# path of one machine); its name is split so that no grep for it stops at this file.
_SIBLING = "sha" "red"
OUTSIDE = (f"../{_SIBLING}".encode(), str(ROOT.parent / _SIBLING).encode())
_SKIPPED_DIRS = {".git", ".venv", ".cache", "__pycache__", ".pytest_cache", ".ruff_cache"}
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)\s]*)?\)")


def repository_files() -> list[Path]:
    """Tracked files and new ones not ignored (what the next commit can hold)."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT, capture_output=True, check=True, timeout=60).stdout
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: walk the tree
        return [p for p in ROOT.rglob("*") if p.is_file()
                and not _SKIPPED_DIRS & set(p.relative_to(ROOT).parts)
                and not any(part.endswith(".egg-info") for part in p.parts)]
    return [ROOT / name for name in listed.decode().split("\0") if name]


def test_no_file_points_outside_the_repository():
    me = Path(__file__).resolve()
    files = [p for p in repository_files() if p.resolve() != me and p.is_file()]
    assert any(p.name == "README.md" for p in files)  # the listing itself works
    offenders = sorted(str(p.relative_to(ROOT)) for p in files
                       if any(needle in p.read_bytes() for needle in OUTSIDE))
    assert not offenders, f"these point outside the repository: {offenders}"


def test_the_readme_links_to_the_design_and_every_doc_link_resolves():
    readme = (ROOT / "README.md").read_text()
    targets = set(_LINK.findall(readme))
    assert {"docs/design.md", "docs/contracts.md"} <= targets, targets
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in _LINK.findall(page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            assert (page.parent / target).exists(), f"{page.name} links to missing {target}"


def test_the_contract_names_every_replica_route_and_speech_field():
    """The API contract drifts from the code as endpoints and fields are added: catch it."""
    from omni_dp.engine.api import _FIELDS

    contracts = (ROOT / "docs" / "contracts.md").read_text()
    server = (ROOT / "omni_dp" / "engine" / "server.py").read_text()
    routes = re.findall(r'web\.(get|post|put|delete)\("(/[^"]*)"', server)
    assert ("get", "/health") in routes and ("post", "/v1/audio/speech") in routes
    for method, path in routes:
        assert f"`{method.upper()} {path}`" in contracts, f"{method.upper()} {path} undocumented"
    for name in _FIELDS:
        assert f"| `{name}` |" in contracts, f"speech field {name} undocumented"
