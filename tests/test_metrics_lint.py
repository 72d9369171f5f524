"""Both /metrics endpoints pass `promtool check metrics`, and the replica's carry model_name.

promtool is Prometheus's own linter (counters end in _total and nothing else does, base units,
HELP on every family, no reserved suffixes…): scripts/test puts Debian's build in .cache/promtool
and exports OMNI_DP_PROMTOOL. Without it these tests skip, except under CI, where they fail.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import threading
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from support.http_client import get, post_json
from support.router import make_config, serve
from support.wait import until, wait_for

SPEECH = "/v1/audio/speech"
_CACHED = Path(__file__).resolve().parents[1] / ".cache/promtool/usr/bin/promtool"


def promtool() -> str:
    found = os.environ.get("OMNI_DP_PROMTOOL") or shutil.which("promtool")
    if found is None and _CACHED.is_file():
        found = str(_CACHED)
    if found is None:
        message = "promtool not found (scripts/test installs it into .cache/promtool)"
        if os.environ.get("CI", "") not in ("", "0", "false"):
            pytest.fail(message)
        pytest.skip(message)
    return found


def lint(text: str) -> str:
    """promtool's complaints about an exposition; empty when clean."""
    done = subprocess.run([promtool(), "check", "metrics"], input=text, capture_output=True,
                          text=True, timeout=60)
    problems = (done.stdout + done.stderr).strip()
    assert (done.returncode == 0) == (not problems), (done.returncode, problems)
    return problems


def scrape(url: str) -> str:
    status, _, body = get(url + "/metrics")
    assert status == 200
    return body.decode()


def test_lint_catches_a_gauge_named_like_a_counter():
    """The linter itself: what it reported on the replica before the rename."""
    bad = "# HELP x_total Pages.\n# TYPE x_total gauge\nx_total 1\n"
    assert "_total" in lint(bad)


def test_replica_metrics_are_promtool_clean(replica):
    assert post_json(replica.url + SPEECH, {"input": "Counted.", "stream": False})[0] == 200
    assert post_json(replica.url + SPEECH, {"input": ""})[0] == 400  # a labelled outcome
    assert lint(scrape(replica.url)) == ""


def test_router_metrics_are_promtool_clean(replica):
    async def run() -> str:
        async with serve(make_config([replica.url], interval=0.2)) as served, \
                aiohttp.ClientSession() as session:
            await until(lambda: bool(served.router.replicas.routable()), 10, "replica routable")
            async with session.post(served.url + SPEECH, json={"input": "Routed."}) as resp:
                assert resp.status == 200
                await resp.read()
            async with session.get(served.url + "/metrics") as resp:
                return await resp.text()

    text = asyncio.run(asyncio.wait_for(run(), 60))
    assert "omni_dp_router_requests_total" in text
    # the audio SLOs of the answer relayed are linted too
    assert 'omni_dp_router_audio_continuity_ok_total{format="wav"' in text
    assert "omni_dp_router_audio_underrun_seconds_bucket" in text
    assert lint(text) == ""


def test_every_replica_series_names_its_model(start_replica):
    replica = start_replica("--served-model-name", "house-voice")
    assert post_json(replica.url + SPEECH, {"input": "Labelled.", "stream": False})[0] == 200
    families = list(text_string_to_metric_families(scrape(replica.url)))
    assert {f.name for f in families} >= {
        "omni_dp_requests_running", "omni_dp_requests_waiting", "omni_dp_kv_pages_used",
        "omni_dp_kv_pages_capacity", "omni_dp_kv_cache_usage_ratio", "omni_dp_preemptions",
        "omni_dp_generated_tokens", "omni_dp_speech_requests", "omni_dp_audio_seconds",
        "omni_dp_request_latency_seconds", "omni_dp_time_to_first_audio_seconds",
        # the audio SLOs (engine/metrics.py, audio_slo_metrics.py)
        "omni_dp_audio_ttfa_seconds", "omni_dp_audio_e2e_latency_seconds",
        "omni_dp_audio_duration_seconds", "omni_dp_audio_real_time_factor",
        "omni_dp_audio_chunk_interval_seconds", "omni_dp_audio_underrun_seconds",
        "omni_dp_audio_continuity_ok", "omni_dp_audio_streams",
    }
    assert "omni_dp_kv_pages_total" not in {f.name for f in families}
    for family in families:
        for sample in family.samples:
            assert sample.labels.get("model_name") == "house-voice", sample


def test_kv_usage_ratio_is_used_over_capacity(start_replica):
    replica = start_replica("--max-total-tokens", "1024")
    assert replica.metric("omni_dp_kv_cache_usage_ratio") == 0
    body = {"input": "Hold some pages.", "max_new_tokens": 1000, "seed": 1, "stream": False}
    worker = threading.Thread(target=post_json, args=(replica.url + SPEECH, body))
    worker.start()
    try:
        wait_for("pages held", lambda: replica.metric("omni_dp_kv_pages_used") >= 8, 30, 0.02)
        samples = {s.name: s.value for f in text_string_to_metric_families(scrape(replica.url))
                   for s in f.samples}
        used, capacity = samples["omni_dp_kv_pages_used"], samples["omni_dp_kv_pages_capacity"]
        assert capacity == 1024 // 16
        assert samples["omni_dp_kv_cache_usage_ratio"] == pytest.approx(used / capacity)
        assert 0 < samples["omni_dp_kv_cache_usage_ratio"] <= 1
    finally:
        worker.join(120)
    assert replica.metric("omni_dp_kv_cache_usage_ratio") == 0
