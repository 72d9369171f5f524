"""Validation of `POST /v1/audio/speech` bodies: every problem named by its field, as a 4xx."""

from __future__ import annotations

import json
from dataclasses import dataclass

from omni_dp.engine.preprocess import DEFAULT_VOICE

RESPONSE_FORMATS = ("wav", "pcm")
STREAM_FORMATS = ("audio", "sse")
MAX_SEED = 2**63 - 1
# Accepted for OpenAI compatibility and not used: the model is chosen when the server starts.
_IGNORED_FIELDS = ("model", "instructions")
_FIELDS = (
    "input", "voice", "response_format", "stream", "stream_format", "seed", "max_new_tokens",
    *_IGNORED_FIELDS,
)


class ApiError(Exception):
    def __init__(self, status: int, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.field = field

    def body(self) -> dict:
        error = {"message": self.message, "type": "invalid_request_error", "param": self.field}
        if self.status >= 500:
            error["type"] = "server_error"
        return {"error": error}


@dataclass(frozen=True)
class SpeechParams:
    input: str
    voice: str
    response_format: str
    stream: bool
    stream_format: str
    seed: int | None
    max_new_tokens: int | None


def parse_speech_body(raw: bytes, *, max_new_tokens_limit: int) -> SpeechParams:
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

    text = body.get("input")
    if not isinstance(text, str):
        raise ApiError(400, "input is required and must be a string", "input")
    voice = _choice(body, "voice", None, DEFAULT_VOICE)
    response_format = _choice(body, "response_format", RESPONSE_FORMATS, "wav")
    stream_format = _choice(body, "stream_format", STREAM_FORMATS, "audio")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be true or false", "stream")
    seed = _integer(body, "seed", 0, MAX_SEED)
    max_new_tokens = _integer(body, "max_new_tokens", 1, max_new_tokens_limit)
    return SpeechParams(text, voice, response_format, stream, stream_format, seed, max_new_tokens)


def _choice(body: dict, name: str, allowed: tuple[str, ...] | None, default: str) -> str:
    value = body.get(name, default)
    if not isinstance(value, str):
        raise ApiError(400, f"{name} must be a string", name)
    if allowed is not None and value not in allowed:
        raise ApiError(400, f"{name} {value!r} is not supported; use one of {', '.join(allowed)}",
                       name)
    return value


def _integer(body: dict, name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"{name} must be an integer", name)
    if not low <= value <= high:
        raise ApiError(400, f"{name} must be between {low} and {high}, got {value}", name)
    return value
