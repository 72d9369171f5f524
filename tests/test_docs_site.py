"""The docs site (docs/, mkdocs.yml: MkDocs with the Material theme) builds with `--strict`:
a link to a missing page or anchor, or a page left out of the nav, fails the build — and so
this test. The build needs no network: no plugin that downloads (search only), no web font, and
it runs here with every proxy pointing at a closed port, so a fetch would fail it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from mkdocs.config import load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "mkdocs.yml"
_NOWHERE = "http://127.0.0.1:9"  # the discard port: nothing listens, a fetch fails at once


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "HTTP_PROXY": _NOWHERE,
           "HTTPS_PROXY": _NOWHERE, "http_proxy": _NOWHERE, "https_proxy": _NOWHERE,
           "NO_PROXY": "", "no_proxy": ""}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(config), "--site-dir", str(site)], capture_output=True, text=True,
                          env=env, timeout=240)


def nav_pages(nav: list) -> list[str]:
    pages = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_the_site_builds_strict_with_every_page_in_the_nav(tmp_path):
    done = build(CONFIG, tmp_path / "site")
    assert done.returncode == 0, done.stderr
    pages = nav_pages(load_config(str(CONFIG))["nav"])
    assert sorted(pages) == sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    for page in pages:
        built = "index.html" if page == "index.md" else f"{page[:-3]}/index.html"
        assert (tmp_path / "site" / built).is_file(), page


def test_the_build_downloads_nothing():
    config = load_config(str(CONFIG))
    assert list(config["plugins"]) == ["material/search"], list(config["plugins"])
    assert config["theme"]["font"] is False  # Material's default is Google Fonts, in the browser
    assert config["strict"] is True


@pytest.mark.parametrize(("page", "added", "said"), [
    ("launcher.md", "\nSee [the placement](placement.md#no-such-heading).\n", "no-such-heading"),
    ("router.md", "\nSee [the missing page](missing.md).\n", "missing.md"),
    ("orphan.md", "# A page the nav does not list\n", "orphan.md"),
], ids=["anchor", "page", "nav"])
def test_a_broken_link_or_a_page_outside_the_nav_fails_the_build(tmp_path, page, added, said):
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(CONFIG, tmp_path / "mkdocs.yml")
    with (tmp_path / "docs" / page).open("a") as f:
        f.write(added)
    done = build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0
    assert said in done.stderr, done.stderr
