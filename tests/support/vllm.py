"""vLLM's CPU build and the tiny Llama, for the tests that run real vLLM replicas
(scripts/setup-vllm, scripts/make-tiny-llama; scripts/test exports OMNI_DP_VLLM_PYTHON and
OMNI_DP_TINY_LLAMA). Under CI (OMNI_DP_REQUIRE_VLLM=1) a missing install fails those tests
instead of skipping them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

VLLM_PYTHON = os.environ.get("OMNI_DP_VLLM_PYTHON")
TINY_LLAMA = os.environ.get("OMNI_DP_TINY_LLAMA")


def installed_vllm() -> tuple[str, str]:
    """(vLLM's python, the tiny model's directory), or the test is skipped (failed in CI)."""
    if VLLM_PYTHON and TINY_LLAMA and Path(VLLM_PYTHON).exists() and Path(TINY_LLAMA).is_dir():
        return VLLM_PYTHON, TINY_LLAMA
    why = ("vLLM's CPU build or the tiny model is not installed (scripts/setup-vllm, "
           "scripts/make-tiny-llama; scripts/test exports OMNI_DP_VLLM_PYTHON and "
           "OMNI_DP_TINY_LLAMA)")
    if os.environ.get("OMNI_DP_REQUIRE_VLLM"):
        pytest.fail(why)
    pytest.skip(why)


def vllm_args(python: str, model: str, *extra: str) -> tuple[str, ...]:
    """`omni-dp launch` arguments for vLLM replicas of `model`: --enforce-eager skips a ~30 s
    compile per start; float32 because vLLM serves this float32 checkpoint in bfloat16 by
    default, whose eager CPU attention kernel died with SIGILL on some of these machines (AMX
    path)."""
    return ("--engine", "vllm", "--engine-python", python, *extra, "--", model,
            "--enforce-eager", "--dtype", "float32")
