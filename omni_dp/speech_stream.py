"""The WebSocket speech session's messages (GET /v1/audio/speech/stream), decoded where they
arrive: the replica reads a client's (or the router's) messages with the same decoder the router
reads the client's, so both keep the same text, piece for piece (docs/contracts.md, "Speech
session").

The shape is vllm-omni's streaming speech session (session.config, input.text, input.done in;
audio.start, audio frames, audio.done, session.done, error out); what omni-dp adds is the
sentence's span in the session's text (text_start, text_end), the field an error is about,
`resent` on a sentence sent again after the router moved the session, and the close codes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import IntEnum

SPEECH_STREAM_PATH = "/v1/audio/speech/stream"

# Client → server
CONFIG = "session.config"
TEXT = "input.text"
DONE = "input.done"
# Server → client
AUDIO_START = "audio.start"
AUDIO_DONE = "audio.done"
SESSION_DONE = "session.done"
ERROR = "error"

# A message's largest size on the wire (vllm-omni bounds input.text the same); the router
# sends a long resend in pieces under it: a character is at most 12 bytes of JSON (one outside
# the BMP is two \uXXXX escapes), so 8 Ki characters are at most 96 KiB.
MAX_MESSAGE_BYTES = 128 * 1024
RESEND_PIECE_CHARS = 8 * 1024
# Seconds the server waits for session.config, then for each next message until input.done
# (vllm-omni's 10 and 30 s).
CONFIG_TIMEOUT_S = 10.0
IDLE_TIMEOUT_S = 30.0


class CloseCode(IntEnum):
    """Why a session's WebSocket closed (RFC 6455 §7.4 and the IANA registry)."""

    NORMAL = 1000  # session.done was sent: every sentence spoken
    GOING_AWAY = 1001  # the replica is stopping (or the router): the router moves the session
    POLICY = 1008  # a fatal client error: no/bad session.config, idle timeout; error says which
    TOO_BIG = 1009  # a message, a sentence or the buffered text over its bound
    INTERNAL = 1011  # the replica's engine failed: the router moves the session
    TRY_AGAIN = 1013  # the router has no replica for the session now
    BAD_GATEWAY = 1014  # the replica was lost and the router may move the session no more


# The closes after which the router moves a session to another replica: the replica's fault,
# not the client's. (1006, a connection lost without a close, is a move too; it is never sent.)
MOVABLE_CLOSES = frozenset({CloseCode.GOING_AWAY, CloseCode.INTERNAL})


class StreamMessageError(ValueError):
    """A client message the session cannot take; `field` names what is wrong in it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class StreamConfig:
    """session.config: the POST body's fields less `input`, plus `stream_audio` (one binary
    frame per encoder chunk rather than one per sentence). Checked by the replica, against
    its model, exactly as POST's body is."""

    fields: dict
    stream_audio: bool = False
    raw: str = ""  # as it came: what the router sends again to a new replica


@dataclass(frozen=True)
class TextPiece:
    text: str
    raw: str = ""


@dataclass(frozen=True)
class InputDone:
    raw: str = ""


ClientMessage = StreamConfig | TextPiece | InputDone


def decode_client(raw: str) -> ClientMessage:
    """One client text frame, or StreamMessageError naming the field at fault."""
    try:
        message = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise StreamMessageError("message", f"not valid JSON: {exc}") from None
    if not isinstance(message, dict):
        raise StreamMessageError("message", "a message must be a JSON object")
    kind = message.get("type")
    if kind == TEXT:
        text = message.get("text")
        if not isinstance(text, str):
            raise StreamMessageError("text", "input.text needs `text`, a string")
        unknown = sorted(set(message) - {"type", "text"})
        if unknown:
            raise StreamMessageError(unknown[0], f"input.text takes type and text; unknown: "
                                                 f"{', '.join(unknown)}")
        return TextPiece(text, raw)
    if kind == DONE:
        unknown = sorted(set(message) - {"type"})
        if unknown:
            raise StreamMessageError(unknown[0], f"input.done takes only type; unknown: "
                                                 f"{', '.join(unknown)}")
        return InputDone(raw)
    if kind == CONFIG:
        fields = {k: v for k, v in message.items() if k not in ("type", "stream_audio")}
        if "input" in fields:
            raise StreamMessageError("input", "session.config takes no input: send the text "
                                              "in input.text messages")
        stream_audio = message.get("stream_audio", False)
        if not isinstance(stream_audio, bool):
            raise StreamMessageError("stream_audio", "stream_audio must be true or false")
        return StreamConfig(fields, stream_audio, raw)
    raise StreamMessageError("type", f"unknown message type {kind!r}; send {CONFIG}, {TEXT} "
                                     f"or {DONE}")


def error_event(message: str, field: str | None = None, **extra: object) -> str:
    """The server's error message: vllm-omni's {"type": "error", "message"}, plus the field."""
    return json.dumps({"type": ERROR, "message": message, "field": field, **extra})


@dataclass(frozen=True)
class SentenceEvent:
    """audio.start or audio.done as the router reads it from a replica, to renumber it."""

    kind: str
    index: int
    text_end: int | None  # audio.start: where the sentence ends in the replica's text
    body: dict


def decode_server(raw: str) -> SentenceEvent | dict | None:
    """A replica's text frame: a SentenceEvent for audio.start/audio.done, the dict for any
    other well-formed message, None for one that is not a JSON object."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(body, dict):
        return None
    kind = body.get("type")
    index = body.get("sentence_index")
    if kind in (AUDIO_START, AUDIO_DONE) and isinstance(index, int):
        end = body.get("text_end")
        return SentenceEvent(kind, index, end if isinstance(end, int) else None, body)
    return body
