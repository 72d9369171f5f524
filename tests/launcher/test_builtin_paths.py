"""The built-in engine's arguments reach a replica with their paths absolute: a replica, and
a restart by the detached supervisor, read the file the preflight read whatever its cwd."""

from __future__ import annotations

import os

from omni_dp.launcher.engines.builtin import absolute_paths


def test_the_placement_file_is_made_absolute_and_nothing_else(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "placement.yaml").write_text("vocoder: {process: vocoder}\n")
    (tmp_path / "tiny").mkdir()  # `--model tiny` is the preset to serve, whatever is here
    args = ("--placement-config", "placement.yaml", "--vocoder.process", "placement.yaml",
            "--model", "tiny", "--placement-config=placement.yaml", "--placement-config",
            "missing.yaml")
    assert absolute_paths(args) == [
        "--placement-config", os.path.join(tmp_path, "placement.yaml"), "--vocoder.process",
        "placement.yaml", "--model", "tiny",
        f"--placement-config={os.path.join(tmp_path, 'placement.yaml')}",
        "--placement-config", "missing.yaml"]  # left for serve to name as missing
