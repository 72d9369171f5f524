"""Validation of `POST /v1/audio/speech` bodies: every problem named by its field, as a 4xx."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from omni_dp.contract import RESUME_FROM_HEADER, SEED_HEADER
from omni_dp.engine.audio import RESPONSE_FORMATS, aac_unavailable
from omni_dp.engine.preprocess import DEFAULT_VOICE, VOICES, unknown_voice_message

STREAM_FORMATS = ("audio", "sse")
# The formats whose bytes are a function of the request and its seed alone, so that an answer
# cut off can be sent again from any byte (the router's resume). An Ogg stream's serial number
# is random, and flac and mp3 are encoded whole: none of those.
RESUMABLE_FORMATS = ("wav", "pcm")
MAX_SEED = 2**63 - 1
SPEED_RANGE = (0.25, 4.0)  # OpenAI's bounds
# OpenAI's TTS model names, accepted as aliases of the served model: the OpenAI SDK requires a
# `model` and existing client code names one of these, which must work unchanged.
OPENAI_MODEL_ALIASES = (
    "tts-1", "tts-1-hd", "gpt-4o-mini-tts", "gpt-4o-mini-tts-2025-03-20",
    "gpt-4o-mini-tts-2025-12-15",
)
# Accepted for OpenAI compatibility and not used.
_IGNORED_FIELDS = ("instructions",)
_LONE_SURROGATES = re.compile("[\ud800-\udfff]")
_FIELDS = (
    "input", "voice", "response_format", "stream", "stream_format", "speed", "seed",
    "max_new_tokens", "model", *_IGNORED_FIELDS,
)


class ApiError(Exception):
    def __init__(self, status: int, message: str, field: str | None = None,
                 error_type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.field = field
        self.error_type = error_type

    def body(self) -> dict:
        kind = self.error_type or ("server_error" if self.status >= 500 else
                                   "invalid_request_error")
        error: dict = {"message": self.message, "type": kind, "param": self.field}
        if self.error_type is not None:
            error["code"] = self.status  # vLLM's shape for its named errors (NotFoundError)
        return {"error": error}


def model_not_found(name: str) -> ApiError:
    """vLLM's answer to a model it does not serve, so clients handle both alike."""
    return ApiError(404, f"The model `{name}` does not exist.", "model", "NotFoundError")


@dataclass(frozen=True)
class SpeechParams:
    input: str
    voice: str
    response_format: str
    # Streaming is the default, as OpenAI does it; `stream: false` asks for one buffered body.
    stream: bool
    stream_format: str
    seed: int | None
    max_new_tokens: int | None
    speed: float | None = None
    model: str | None = None  # None: the served model


def parse_speech_body(raw: bytes, *, max_new_tokens_limit: int,
                      voices: Sequence[str] = VOICES) -> SpeechParams:
    """`voices`: the names the served model answers to (OpenAI's, and a Piper voice's own
    speakers)."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise ApiError(400, "body is not valid JSON: nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, over-long integers
        raise ApiError(400, f"body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "body must be a JSON object")
    unknown = sorted(set(body) - set(_FIELDS))
    if unknown:
        raise ApiError(
            400, f"unknown field(s) {', '.join(unknown)}; accepted: {', '.join(_FIELDS)}",
            unknown[0],
        )
    for name in _IGNORED_FIELDS:
        if name in body and not isinstance(body[name], str):
            raise ApiError(400, f"{name} must be a string", name)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "model must be a string", "model")

    text = body.get("input")
    if not isinstance(text, str):
        raise ApiError(400, "input is required and must be a string", "input")
    # JSON may carry lone surrogates ("\ud800"), which are not text: normalisation would drop
    # them anyway; dropped here, before the preprocess stage, whichever process it runs in
    # (UTF-8, the wire between processes, cannot carry them).
    text = _LONE_SURROGATES.sub("", text)
    voice = _voice(body, voices)
    response_format = _choice(body, "response_format", RESPONSE_FORMATS, "wav")
    if response_format == "aac" and (why := aac_unavailable()) is not None:
        raise ApiError(400, f"response_format aac cannot be encoded by this replica: {why}",
                       "response_format")
    stream_format = _choice(body, "stream_format", STREAM_FORMATS, "audio")
    stream = body.get("stream", True)
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be true or false", "stream")
    if not stream and stream_format == "sse":
        raise ApiError(400, "stream_format sse is a stream: drop stream: false, or use "
                       "stream_format audio for one buffered body", "stream")
    speed = _speed(body)
    seed = _integer(body, "seed", 0, MAX_SEED)
    max_new_tokens = _integer(body, "max_new_tokens", 1, max_new_tokens_limit)
    return SpeechParams(text, voice, response_format, stream, stream_format, seed,
                        max_new_tokens, speed, model)


def _choice(body: dict, name: str, allowed: tuple[str, ...] | None, default: str) -> str:
    value = body.get(name, default)
    if not isinstance(value, str):
        raise ApiError(400, f"{name} must be a string", name)
    if _LONE_SURROGATES.search(value):
        raise ApiError(400, f"{name} holds a lone surrogate, which is not text", name)
    if allowed is not None and value not in allowed:
        raise ApiError(400, f"{name} {value!r} is not supported; use one of {', '.join(allowed)}",
                       name)
    return value


def _voice(body: dict, voices: Sequence[str]) -> str:
    """One of the model's voice names; OpenAI's custom voices (`{"id": "voice_…"}`) are made
    from audio samples this engine has not got, so they are a 400 that says so."""
    value = body.get("voice", DEFAULT_VOICE)
    if isinstance(value, dict):
        raise ApiError(400, "voice: custom voices ({\"id\": ...}) are not supported here; use "
                       f"one of the built-in voices: {', '.join(voices)}", "voice")
    value = _choice(body, "voice", None, DEFAULT_VOICE)
    if value not in voices:
        raise ApiError(400, unknown_voice_message(value, voices), "voice")
    return value


def _speed(body: dict) -> float | None:
    value = body.get("speed")
    if value is None:
        return None
    low, high = SPEED_RANGE
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError(400, f"speed must be a number from {low} to {high}", "speed")
    # NaN and infinities (which Python's json accepts) fail the range check too.
    if not (math.isfinite(value) and low <= value <= high):
        raise ApiError(400, f"speed must be from {low} to {high}, got {value}", "speed")
    return float(value)


def _integer(body: dict, name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"{name} must be an integer", name)
    if not low <= value <= high:
        raise ApiError(400, f"{name} must be between {low} and {high}, got {value}", name)
    return value


@dataclass(frozen=True)
class ResumeAsk:
    """What the router's internal headers ask of an answer (docs/contracts.md, "Retry and
    resume"): the seed to use when the body names none, and the byte to start from."""

    seed: int | None = None
    offset: int | None = None


def parse_resume_headers(headers, params: SpeechParams) -> ResumeAsk:
    """The router's seed and resume offset, checked like body fields (a 400 naming the header)."""
    seed = _header_integer(headers, SEED_HEADER, MAX_SEED)
    offset = _header_integer(headers, RESUME_FROM_HEADER, 2**62)
    if offset is not None and params.response_format not in RESUMABLE_FORMATS:
        raise ApiError(400, f"{RESUME_FROM_HEADER}: an answer in {params.response_format} cannot "
                       f"be resumed; only {', '.join(RESUMABLE_FORMATS)} can", RESUME_FROM_HEADER)
    return ResumeAsk(seed, offset)


def _header_integer(headers, name: str, high: int) -> int | None:
    text = headers.get(name)
    if text is None:
        return None
    if not (text.isascii() and text.isdigit() and len(text) <= 19 and int(text) <= high):
        raise ApiError(400, f"{name} must be an integer from 0 to {high}, got {text[:40]!r}",
                       name)
    return int(text)
