"""Fixtures of the engine tests."""

from __future__ import annotations

import pytest
import torch

from omni_dp.engine.config import PRESETS
from omni_dp.engine.weights import seeded_models


@pytest.fixture(scope="module")
def vocoder():
    """The tiny preset's seeded vocoder (one per test module), on one CPU thread."""
    torch.set_num_threads(1)
    return seeded_models(PRESETS["tiny"], 0).vocoder
