"""A Piper-shaped voice directory for tests that plan a voice without loading its graph."""

from __future__ import annotations

import json
from pathlib import Path

ID_MAP = {"_": [0], "^": [1], "$": [2], " ": [3], "a": [4], "b": [5], ".": [6], ",": [7]}


def write_voice(directory: Path, **config) -> None:
    """An (empty) graph and its config; `config` replaces the config's top-level fields."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "v.onnx").write_bytes(b"\0" * 1000)
    data = {"audio": {"sample_rate": 22050}, "espeak": {"voice": "en-us"},
            "phoneme_type": "espeak", "phoneme_id_map": ID_MAP, "num_speakers": 1,
            "inference": {"noise_scale": 0.5, "length_scale": 1.0, "noise_w": 0.7}, **config}
    (directory / "v.onnx.json").write_text(json.dumps(data))
