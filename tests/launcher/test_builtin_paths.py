"""The built-in engine's arguments reach a replica with their paths absolute: a replica, and
a restart by the detached supervisor, read the file the preflight read whatever its cwd."""

from __future__ import annotations

import os

from omni_dp.launcher.engines.builtin import absolute_paths


def test_path_flags_are_made_absolute_and_nothing_else(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "placement.yaml").write_text("vocoder: {process: vocoder}\n")
    (tmp_path / "weights").mkdir()
    args = ("--placement-config", "placement.yaml", "--model=weights", "--vocoder.process",
            "placement.yaml", "--model", "tiny")
    assert absolute_paths(args) == [
        "--placement-config", os.path.join(tmp_path, "placement.yaml"),
        f"--model={os.path.join(tmp_path, 'weights')}", "--vocoder.process", "placement.yaml",
        "--model", "tiny"]  # a preset name, not a path here


def test_a_preset_name_stays_a_name_even_beside_a_directory_of_that_name(tmp_path,
                                                                        monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").mkdir()  # serve reads presets first: `--model tiny` is the preset
    assert absolute_paths(("--model", "tiny", "--model=tiny")) == ["--model", "tiny",
                                                                  "--model=tiny"]
