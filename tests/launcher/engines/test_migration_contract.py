"""What the router's migration sends an engine (omni_dp/router/migration.py), checked by the
engines' own request models, and the endpoints each adapter names for it (`migration_paths`)
against what the engine's code does: vLLM 0.32 (OMNI_DP_VLLM_PYTHON) takes `return_token_ids`
on completions and chat; sglang 0.5.22 (OMNI_DP_PARSERS_PYTHON) on completions, and refuses it
on a streamed chat, hence completions alone."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from omni_dp.launcher.engines.sglang import SglangEngine
from omni_dp.launcher.engines.vllm import VllmEngine
from omni_dp.router.migration import CHAT_PATH, MIGRATION_PATHS, plan_migration
from omni_dp.router.token_stream import COMPLETIONS_PATH

from support.vllm import installed_vllm

TIMEOUT_S = 180
REQUESTS = {
    COMPLETIONS_PATH: {"model": "m", "prompt": "Hello", "max_tokens": 40, "min_tokens": 5,
                       "temperature": 0.7, "top_p": 0.9, "top_k": 20, "seed": 3,
                       "stream": True, "stream_options": {"include_usage": True},
                       "ignore_eos": True, "stop_token_ids": [7]},
    CHAT_PATH: {"model": "m", "messages": [{"role": "user", "content": "Hello"}],
                "max_completion_tokens": 40, "temperature": 0, "stream": True,
                "chat_template_kwargs": {"x": 1}},
}

# Run in the engine's python: validate each body with the engine's own request model.
PROBE = r"""
import json, sys
spec = json.load(sys.stdin)
if spec["engine"] == "vllm":
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    chat_source = ""
else:
    from pathlib import Path
    from sglang.srt.entrypoints.openai import protocol
    from sglang.srt.entrypoints.openai.protocol import CompletionRequest, ChatCompletionRequest
    chat_source = (Path(protocol.__file__).parent / "serving_chat.py").read_text()
models = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}
out = {"chat_refuses_streamed_ids":
       "return_token_ids is not supported with streaming on" in chat_source}
for name, (path, body) in spec["bodies"].items():
    request = models[path].model_validate(body)
    out[name] = {field: getattr(request, field, None) for field in (
        "prompt", "max_tokens", "min_tokens", "return_token_ids", "temperature", "top_p",
        "top_k", "seed", "stream", "ignore_eos", "stop_token_ids")}
print(json.dumps(out))
"""


def bodies(paths: tuple[str, ...]) -> dict[str, tuple[str, dict]]:
    """The first request and the continuation the router sends for each path."""
    made = {}
    for path in paths:
        raw = json.dumps(REQUESTS[path]).encode()
        plan = plan_migration("POST", path, raw, 1, MIGRATION_PATHS, None)
        made[f"first {path}"] = (path, json.loads(plan.upstream_body(raw)))
        made[f"continuation of {path}"] = (COMPLETIONS_PATH,
                                           json.loads(plan.continuation([1, 2, 3, 4, 5], 3)))
    return made


def probe(python: str, engine: str, paths: tuple[str, ...]) -> dict:
    spec = {"engine": engine, "bodies": bodies(paths)}
    done = subprocess.run([python, "-c", PROBE], input=json.dumps(spec), capture_output=True,
                          text=True, timeout=TIMEOUT_S,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def assert_taken(report: dict, paths: tuple[str, ...]) -> None:
    for path in paths:
        first = report[f"first {path}"]
        assert first["return_token_ids"] is True and first["stream"] is True
        continued = report[f"continuation of {path}"]
        assert continued["prompt"] == [1, 2, 3, 4, 5]
        assert (continued["max_tokens"], continued["return_token_ids"]) == (37, True)
        assert continued["temperature"] == REQUESTS[path]["temperature"]
    continued = report[f"continuation of {COMPLETIONS_PATH}"]
    assert continued["min_tokens"] == 2
    assert (continued["top_p"], continued["top_k"], continued["seed"]) == (0.9, 20, 3)
    assert (continued["ignore_eos"], continued["stop_token_ids"]) == (True, [7])


def test_vllm_takes_what_migration_sends_on_both_endpoints():
    python, _ = installed_vllm()
    assert VllmEngine.migration_paths == MIGRATION_PATHS
    assert_taken(probe(python, "vllm", VllmEngine.migration_paths), MIGRATION_PATHS)


def test_sglang_takes_it_on_completions_and_refuses_it_on_a_streamed_chat():
    python = os.environ.get("OMNI_DP_PARSERS_PYTHON")
    if not python:
        why = "OMNI_DP_PARSERS_PYTHON is not set (scripts/setup-engine-parsers)"
        if os.environ.get("OMNI_DP_REQUIRE_PARSERS"):
            pytest.fail(why)
        pytest.skip(why)
    assert SglangEngine.migration_paths == (COMPLETIONS_PATH,)
    report = probe(python, "sglang", MIGRATION_PATHS)
    assert_taken(report, (COMPLETIONS_PATH,))
    assert report["chat_refuses_streamed_ids"]  # why chat is not among its paths
