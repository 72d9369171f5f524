"""What the benches say of the trained voice, held to its checks: the device call's voice step
runs only where the probe found the voice measurable (and says the probe's reasons where not,
or that the probe did not say), measures joe with no KV pin, and bench/voice.py names the voice
it reports rather than taking serve's default (the seeded tiny where joe is not installed).
Nothing here starts a process."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # the bench scripts import each other as top-level modules

import gpu_probe  # noqa: E402
import gpu_steps  # noqa: E402

from omni_dp.engine.voice import model as voice_model  # noqa: E402
from omni_dp.engine.voice import phonemes  # noqa: E402


def bench_script(name: str):
    """bench/NAME.py as a module of its own name (`voice` would be ambiguous on sys.path)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def skip_of(step_name: str, steps: list, probe: dict) -> str | None:
    step = next(s for s in steps if s.name == step_name)
    return step.skip([SimpleNamespace(name="probe", figures=probe)])


@pytest.fixture
def call_steps(tmp_path):
    settings = gpu_steps.Settings.from_env({"GPU": "0", "WORK": str(tmp_path),
                                            "OUT": str(tmp_path / "out")})
    return gpu_steps.steps(settings)


@pytest.mark.parametrize(("voice", "skipped"), [
    ([], None),
    (["no espeak-ng program", "onnxruntime has no CUDAExecutionProvider"],
     "the voice cannot run here: no espeak-ng program; onnxruntime has no "
     "CUDAExecutionProvider"),
    (None, "the voice cannot run here: the probe did not say"),  # an older or failed probe
])
def test_the_voice_step_runs_only_where_the_probe_found_it_measurable(call_steps, voice,
                                                                        skipped):
    probe = {"missing": []} if voice is None else {"missing": [], "voice_problems": voice}
    assert skip_of("voice", call_steps, probe) == skipped
    assert skip_of("headline", call_steps, probe) is None  # the seeded steps need no voice


def test_the_voice_step_measures_joe_with_no_kv_pin(call_steps):
    voice = next(s for s in call_steps if s.name == "voice").argv
    headline = next(s for s in call_steps if s.name == "headline").argv
    assert voice[-2:] == ["--model", "joe"] and "--max-total-tokens" not in voice
    assert "--max-total-tokens" in headline  # the seeded model's pool is pinned


def test_the_probe_says_measurable_only_when_every_check_passed(monkeypatch):
    """The voice found, espeak-ng there, and onnxruntime's provider for where the call runs:
    the CUDA one on a GPU."""
    asked: list[str] = []

    def runtime_problem(device):
        asked.append(device)
        return "onnxruntime has no CUDAExecutionProvider" if device == "cuda" else None

    monkeypatch.setattr(voice_model, "runtime_problem", runtime_problem)
    monkeypatch.setattr(voice_model, "find_voice", lambda name: None)
    monkeypatch.setattr(phonemes, "espeak_problem", lambda: None)
    assert gpu_probe.voice_problems(on_gpu=False) == []
    assert gpu_probe.voice_problems(on_gpu=True) == ["onnxruntime has no CUDAExecutionProvider"]
    assert asked == ["cpu", "cuda"]

    def not_installed(name):
        raise voice_model.VoiceError(f"no voice {name!r} installed")

    monkeypatch.setattr(voice_model, "find_voice", not_installed)
    monkeypatch.setattr(phonemes, "espeak_problem", lambda: "no espeak-ng program")
    assert gpu_probe.voice_problems(on_gpu=False) == ["no voice 'joe' installed",
                                                      "no espeak-ng program"]


def test_bench_voice_names_the_voice_it_reports():
    """Left to serve's default, a machine without joe would serve the seeded tiny and its
    figures be reported as the voice's; named, such a launch fails instead."""
    voice = bench_script("voice")
    assert voice.engine_args("2") == ["--", "--model", "joe"]
    assert voice.engine_args("1v2") == ["--", "--model", "joe", "--voice.process", "voice",
                                        "--voice.replicas", "2"]
