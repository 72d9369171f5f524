"""`serve --dry-run`'s `weights` field, the claim behind the words launch prints about the model
its replicas serve (engines/builtin.model_words): a preset's weights are seeded (a test vehicle
whose audio is noise), a model directory's and a voice's are loaded, and only a voice is called
trained. The real dry run's JSON, not a hand-made one; nothing here starts a process."""

from __future__ import annotations

import json

from click.testing import CliRunner

from omni_dp.cli.commands.serve import serve
from omni_dp.engine.config import CONFIG_FILE, PRESETS, WEIGHTS_FILE
from omni_dp.engine.options import ServeOptions
from omni_dp.engine.plan import plan_serve, plan_summary
from omni_dp.engine.voice import plan as voice_plan
from omni_dp.launcher.engines.builtin import model_words

from support.voice_dir import write_voice

NOISE = "tiny (seeded random weights: a test vehicle, its audio is noise)"


def test_a_presets_dry_run_says_seeded_and_launch_calls_its_audio_noise():
    result = CliRunner().invoke(serve, ["--dry-run", "--device", "cpu", "--threads", "1",
                                        "--model", "tiny"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["weights"] == "seeded"
    assert model_words(summary) == NOISE


def test_a_model_directorys_dry_run_says_loaded_and_claims_no_more(tmp_path):
    directory = tmp_path / "mine"
    directory.mkdir()
    (directory / CONFIG_FILE).write_text(json.dumps(PRESETS["tiny"].to_json()))
    (directory / WEIGHTS_FILE).write_bytes(b"")  # the plan reads the config only
    summary = plan_summary(plan_serve(ServeOptions(model=str(directory), device="cpu",
                                                   threads=1)))
    assert summary["weights"] == "loaded"
    assert model_words(summary) == "tiny"  # its config's name: neither noise nor trained


def test_a_voices_dry_run_says_loaded_and_launch_calls_it_trained(tmp_path, monkeypatch):
    monkeypatch.setattr(voice_plan, "espeak_problem", lambda: None)
    monkeypatch.setattr(voice_plan, "runtime_problem", lambda device: None)
    voice = tmp_path / "voice"
    write_voice(voice)
    summary = plan_summary(plan_serve(ServeOptions(model=str(voice), device="cpu", threads=1)))
    assert summary["weights"] == "loaded"
    assert model_words(summary) == f"{summary['model']} (a trained voice)"
