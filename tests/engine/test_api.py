import dataclasses
import json
import sys
from typing import get_args

import pytest

from omni_dp.engine.api import (
    MAX_SEED,
    OPENAI_MODEL_ALIASES,
    ApiError,
    model_not_found,
    parse_speech_body,
)
from omni_dp.engine.audio import aac_unavailable
from omni_dp.engine.config import PRESETS
from omni_dp.engine.preprocess import (
    VOICES,
    PreprocessError,
    build_prompt,
    default_max_new_tokens,
    normalize_text,
    speaker_of,
)

CFG = PRESETS["tiny"]
LIMIT = 1024


def parse(body):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return parse_speech_body(raw, max_new_tokens_limit=LIMIT)


def rejected(body):
    with pytest.raises(ApiError) as info:
        parse(body)
    assert info.value.status == 400
    return info.value


# --- request bodies ----------------------------------------------------------------------


def test_minimal_body_gets_defaults():
    params = parse({"input": "Hello"})
    assert params.input == "Hello"
    assert params.voice == "alloy"
    assert params.response_format == "wav"
    assert params.stream is True  # streamed unless `stream: false`, as OpenAI does
    assert params.stream_format == "audio"
    assert params.seed is None
    assert params.max_new_tokens is None
    assert params.speed is None
    assert params.model is None


def test_lone_surrogates_are_no_text_in_any_process():
    """JSON can spell them ("\\ud800"); UTF-8 — and so the wire to a preprocess process —
    cannot. Dropped from the input (normalisation drops them too: the same audio in every
    placement); another field holding one is refused, naming it."""
    raw = json.dumps({"input": "a\ud800b\udfff"}).encode()
    assert parse_speech_body(raw, max_new_tokens_limit=100).input == "ab"
    raw = json.dumps({"input": "a", "voice": "\udc00"}).encode()
    with pytest.raises(ApiError) as info:
        parse_speech_body(raw, max_new_tokens_limit=100)
    assert (info.value.status, info.value.field) == (400, "voice")
    assert "lone surrogate" in info.value.message


def test_full_body_is_read():
    params = parse({
        "input": "Hi", "voice": "echo", "response_format": "pcm", "stream": True,
        "stream_format": "sse", "seed": 7, "max_new_tokens": LIMIT,
        "model": "anything", "instructions": "calmly",
    })
    assert (params.voice, params.response_format, params.stream) == ("echo", "pcm", True)
    assert (params.stream_format, params.seed, params.max_new_tokens) == ("sse", 7, LIMIT)


def test_seed_bounds_are_inclusive():
    assert parse({"input": "x", "seed": 0}).seed == 0
    assert parse({"input": "x", "seed": MAX_SEED}).seed == MAX_SEED
    assert parse({"input": "x", "max_new_tokens": 1}).max_new_tokens == 1


@pytest.mark.parametrize("raw", [b"{", b"", b"not json", b'{"input": "a",}', b"\xff\xfe\x00"])
def test_invalid_json_is_400(raw):
    error = rejected(raw)
    assert "JSON" in error.message
    assert error.field is None


@pytest.mark.parametrize("body", [[], "text", 3, None, [{"input": "a"}]])
def test_non_object_body_is_400(body):
    error = rejected(body)
    assert error.field is None
    assert "object" in error.message


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "input"),
        ({"voice": "alloy"}, "input"),
        ({"input": None}, "input"),
        ({"input": 5}, "input"),
        ({"input": ["a"]}, "input"),
        ({"input": "a", "speed": 0.2}, "speed"),
        ({"input": "a", "speed": 4.01}, "speed"),
        ({"input": "a", "speed": "fast"}, "speed"),
        ({"input": "a", "speed": True}, "speed"),
        ({"input": "a", "stream": False, "stream_format": "sse"}, "stream"),
        ({"input": "a", "zzz": 1, "aaa": 2}, "aaa"),
        ({"input": "a", "voice": 3}, "voice"),
        ({"input": "a", "model": 1}, "model"),
        ({"input": "a", "instructions": None}, "instructions"),
        ({"input": "a", "response_format": "m4a"}, "response_format"),
        ({"input": "a", "response_format": "WAV"}, "response_format"),
        ({"input": "a", "stream_format": "chunked"}, "stream_format"),
        ({"input": "a", "stream": "true"}, "stream"),
        ({"input": "a", "stream": 1}, "stream"),
        ({"input": "a", "seed": True}, "seed"),
        ({"input": "a", "seed": 1.0}, "seed"),
        ({"input": "a", "seed": "1"}, "seed"),
        ({"input": "a", "seed": -1}, "seed"),
        ({"input": "a", "seed": MAX_SEED + 1}, "seed"),
        ({"input": "a", "max_new_tokens": 0}, "max_new_tokens"),
        ({"input": "a", "max_new_tokens": LIMIT + 1}, "max_new_tokens"),
        ({"input": "a", "max_new_tokens": 10.5}, "max_new_tokens"),
    ],
)
def test_invalid_field_is_400_naming_the_field(body, field):
    error = rejected(body)
    assert error.field == field
    assert field in error.message


def test_unknown_field_message_lists_accepted_fields():
    message = rejected({"input": "a", "speedy": 1.0}).message
    for name in ("input", "voice", "response_format", "stream", "speed", "seed",
                 "max_new_tokens"):
        assert name in message


def test_bad_choice_message_lists_allowed_values():
    message = rejected({"input": "a", "response_format": "ogg"}).message
    for name in ("wav", "pcm", "flac", "opus", "mp3", "aac"):
        assert name in message


def test_error_body_is_openai_shaped():
    body = ApiError(400, "bad seed", "seed").body()
    assert body == {"error": {"message": "bad seed", "type": "invalid_request_error",
                              "param": "seed"}}
    assert ApiError(503, "busy").body()["error"]["type"] == "server_error"


def test_deeply_nested_json_is_400():
    rejected(b"[" * 100_000)


def test_integer_too_long_to_parse_is_400():
    rejected(b'{"input": "a", "seed": 1' + b"0" * 5000 + b"}")


# --- preprocess --------------------------------------------------------------------------


def test_build_prompt_layout():
    prompt = build_prompt(CFG, "Hi é", "echo", 100)
    speaker = VOICES.index("echo")
    assert prompt.speaker_id == speaker
    assert prompt.text == "Hi é"
    assert prompt.token_ids == [
        CFG.first_speaker_id + speaker, CFG.bos_text_id, *"Hi é".encode(),
        CFG.eos_text_id, CFG.bos_audio_id,
    ]
    assert all(0 <= t < CFG.vocab_size for t in prompt.token_ids)


@pytest.mark.parametrize("text", ["", " ", "\n\t  \n", "\x00\x07"])
def test_build_prompt_rejects_empty_text(text):
    with pytest.raises(PreprocessError) as info:
        build_prompt(CFG, text, "alloy", 100)
    assert info.value.field == "input"


def test_build_prompt_rejects_text_over_the_limit():
    assert build_prompt(CFG, "x" * 10, "alloy", 10).text == "x" * 10
    with pytest.raises(PreprocessError) as info:
        build_prompt(CFG, "x" * 11, "alloy", 10)
    assert info.value.field == "input"
    assert "10" in str(info.value) and "11" in str(info.value)


def test_limit_counts_characters_after_normalisation():
    assert build_prompt(CFG, "  a    b  ", "alloy", 3).text == "a b"
    assert build_prompt(CFG, "ééé", "alloy", 3).text == "ééé"  # 6 bytes, 3 characters


@pytest.mark.parametrize("voice", ["Alloy", "nobody", ""])
def test_build_prompt_rejects_unknown_voice(voice):
    with pytest.raises(PreprocessError) as info:
        build_prompt(CFG, "hello", voice, 100)
    assert info.value.field == "voice"
    assert "alloy" in str(info.value)


def test_each_voice_is_a_fixed_speaker_of_the_model():
    speakers = [build_prompt(CFG, "hi", voice, 100).speaker_id for voice in VOICES]
    # The first eight keep the speakers they always had (the same audio as before 13 voices);
    # the rest wrap around the model's speakers, so every one of them is a valid token.
    assert speakers == [i % CFG.num_speakers for i in range(len(VOICES))]
    assert len(set(speakers[:CFG.num_speakers])) == CFG.num_speakers
    few = dataclasses.replace(CFG, num_speakers=3)
    assert [speaker_of(few, v) for v in ("alloy", "ash", "coral", "echo", "cedar")] == \
        [0, 1, 2, 0, 12 % 3]


def test_every_openai_voice_and_model_is_accepted():
    """What OpenAI's SDK names (its `Voice` and `SpeechModel` literals) is what a replica takes:
    an SDK that adds one fails here until the tables follow."""
    from openai.types.audio import speech_create_params, speech_model

    sdk_voices = {a for arg in get_args(speech_create_params.Voice)
                  for a in get_args(arg) if isinstance(a, str)}
    assert {"alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage",
            "shimmer", "verse"} <= sdk_voices
    assert sdk_voices <= set(VOICES)
    for voice in sdk_voices:
        assert parse({"input": "a", "voice": voice}).voice == voice
    assert set(get_args(speech_model.SpeechModel)) <= set(OPENAI_MODEL_ALIASES)


def test_unknown_or_custom_voice_is_a_400_naming_the_accepted_ones():
    for voice in ("verses", "Alloy", {"id": "voice_1234"}):
        error = rejected({"input": "a", "voice": voice})
        assert error.field == "voice"
        assert "alloy, ash, coral" in error.message and "cedar" in error.message


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("  hello   world  ", "hello world"),
        ("line one\nline two\t end", "line one line two end"),
        ("bell\x07 and\x00 null", "bell and null"),
        ("zero\u200bwidth", "zerowidth"),
        ("cafe\u0301", "café"),  # NFC
    ],
)
def test_normalize_text(raw, expected):
    assert normalize_text(raw) == expected


@pytest.mark.parametrize("separator", ["\r", "\x0c", "\x0b"])
def test_whitespace_control_characters_separate_words(separator):
    assert normalize_text(f"one{separator}two") == "one two"


def test_default_max_new_tokens_grows_with_text_and_is_bounded():
    def default_for(n):
        return default_max_new_tokens(CFG, build_prompt(CFG, "a" * n, "alloy", 10**6))

    values = [default_for(n) for n in (1, 2, 10, 50, 100, 200, 255, 256, 1000, 5000)]
    assert values == sorted(values)
    assert values[0] == CFG.min_new_tokens_default
    assert default_for(50) > default_for(10)
    assert default_for(50) == 50 * CFG.new_tokens_per_input_byte
    assert values[-1] == CFG.max_new_tokens
    assert all(CFG.min_new_tokens_default <= v <= CFG.max_new_tokens for v in values)


def test_default_max_new_tokens_counts_bytes_not_characters():
    ascii_prompt = build_prompt(CFG, "aaaaaaaaaa", "alloy", 100)
    accented = build_prompt(CFG, "éééééééééé", "alloy", 100)
    assert default_max_new_tokens(CFG, accented) == 2 * default_max_new_tokens(CFG, ascii_prompt)


# --- OpenAI fields: speed, model, stream_format ------------------------------------------


def test_speed_bounds_are_openais_and_inclusive():
    assert parse({"input": "x", "speed": 0.25}).speed == 0.25
    assert parse({"input": "x", "speed": 4}).speed == 4.0
    assert parse({"input": "x", "speed": 1}).speed == 1.0


@pytest.mark.parametrize("raw", [b'{"input": "a", "speed": NaN}',
                                 b'{"input": "a", "speed": Infinity}'])
def test_speed_that_python_json_accepts_but_is_no_number_is_400(raw):
    error = rejected(raw)
    assert error.field == "speed"


def test_model_is_read_and_checked_by_the_server():
    assert parse({"input": "x", "model": "tts-1"}).model == "tts-1"
    assert parse({"input": "x"}).model is None


def test_model_not_found_is_vllm_shaped():
    assert model_not_found("x").status == 404
    assert model_not_found("x").body() == {"error": {
        "message": "The model `x` does not exist.", "type": "NotFoundError", "param": "model",
        "code": 404,
    }}


def test_every_openai_format_is_accepted():
    for name in ("mp3", "opus", "aac", "flac", "wav", "pcm"):  # OpenAI's list, in its order
        assert parse({"input": "a", "response_format": name}).response_format == name


def test_aac_without_pyav_is_a_400_that_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "av", None)  # `import av` raises ImportError
    aac_unavailable.cache_clear()
    try:
        error = rejected({"input": "a", "response_format": "aac"})
        assert parse({"input": "a", "response_format": "opus"}).response_format == "opus"
    finally:
        aac_unavailable.cache_clear()
    assert error.field == "response_format"
    assert "omni-dp[aac]" in error.message and "PyAV" in error.message


def test_sse_alone_asks_for_a_stream():
    params = parse({"input": "a", "stream_format": "sse"})
    assert (params.stream, params.stream_format) == (True, "sse")
    assert parse({"input": "a", "stream": False}).stream is False
