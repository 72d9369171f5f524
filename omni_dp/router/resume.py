"""Resuming an answer whose replica failed after its first byte reached the client.

One small strategy per request, chosen from its first answer (`choose`). It sees what is
relayed to the client, says what may go out now (`take`), and how to ask another replica to
go on from there (`resend`, then `check` of that replica's answer). The proxy knows no more
than that, so another way of resuming is one more class and a line in `choose`:

- `AudioBytes`: the built-in engine's wav and pcm answers, raw or SSE, streamed or not. Their
  bytes are a function of the request and its seed (X-Seed), so another replica regenerates
  the same answer and sends it from the byte the client has (X-Omni-DP-Resume-From). An SSE
  stream is relayed whole event by whole event, and its offset counts the decoded audio of
  the `speech.audio.delta` events relayed: the other replica re-emits events from that audio
  byte on, and the client reads one well-formed stream.
- `TokenStream` (token_stream.py, planned per request by migration.py): an LLM engine's
  streamed completions and chat answers (vLLM, sglang) under --migration-limit, continued
  token-exactly on another replica from the token ids the client has.
- `NotResumable`: everything else (opus, flac, mp3, LLM streams without --migration-limit or
  that cannot migrate, `why_not` says why): a cut stream ends as documented (an SSE error
  event, or no terminating chunk). `WholeEvents`, its SSE form, relays whole events only, so
  that the router's error event after a cut is an event of its own, never glued onto half of
  the replica's last one.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass, field
from typing import Protocol

from omni_dp.contract import (
    RESUMABLE_BY_BYTES,
    RESUMABLE_HEADER,
    RESUME_FROM_HEADER,
    RESUMED_FROM_HEADER,
    SEED_HEADER,
)

SEED_RESPONSE_HEADER = "X-Seed"  # the seed the replica sampled with (the replica contract)
_EVENT_END = b"\n\n"
# The built-in replica's delta events, as engine/audio.py writes them (compact JSON): their
# audio is counted from the base64's length alone; any other event is parsed.
_DELTA_HEAD = b'data: {"type":"speech.audio.delta","audio":"'
_DELTA_TAIL = b'"}\n\n'


class ReplicaErrorEvent(Exception):
    """The replica ended its SSE stream with an error event: it failed mid-stream."""


class ContinuationRefused(Exception):
    """What another replica sent to continue an answer is not its rest (it went another way):
    nothing of it may reach the client."""


@dataclass(frozen=True)
class Resend:
    """How another replica is asked to go on: headers added to the request's own, and where a
    continuation is another request (a migration), its path and body."""

    headers: dict[str, str]
    path: str | None = None  # None: the request's own
    body: bytes | None = None  # None: the request's own


class Resume:
    """Not resumable: every byte passes as it comes, nothing is counted."""

    name = "none"
    resumable = False
    migrates = False  # continued by a new request (--migration-limit), not a resume
    why_not = "not_resumable"  # why a cut stream of this kind is not continued (a metric label)
    complete = False  # the answer's last event reached the client (nothing is left to send)
    offset = 0  # where the next replica goes on from (bytes; tokens for a migration)

    def take(self, chunk: bytes) -> bytes:
        """What of `chunk` may go to the client now (the rest is held for later)."""
        return chunk

    def sent(self) -> None:
        """What the last `take` returned reached the client."""

    def flush(self) -> bytes:
        """At the answer's clean end: whatever is still held."""
        return b""

    def at_end(self) -> str | None:
        """At the upstream body's clean end: why the answer is not whole after all (it ended
        before its last event), or None."""
        return None

    def ending(self) -> bytes:
        """Once `complete`, what the client still needs when the replica is lost: the end of
        the stream, made here."""
        return b""

    def resend(self) -> Resend:
        raise NotImplementedError(f"{self.name} answers cannot be resumed")

    def check(self, status: int, headers) -> str | None:
        """What is wrong with another replica's answer to `resend`; None if nothing."""
        raise NotImplementedError(f"{self.name} answers cannot be resumed")


class NotResumable(Resume):
    """Not resumable, for a reason the metrics name (`streams_cut_total{why}`)."""

    def __init__(self, why_not: str) -> None:
        self.why_not = why_not


NOT_RESUMABLE = Resume()
# Past this much without an event's end, WholeEvents passes what it holds: an upstream whose
# events end otherwise (a lone "\r\r") must still stream.
MAX_HELD_EVENT_BYTES = 1 << 20


class WholeEvents(NotResumable):
    """Not resumable, and an SSE answer: only whole events reach the client (the tail of a
    chunk that ends mid-event is held for the next one). A cut then leaves the client at an
    event's end, where the router's error event is one a parser reads; the held half event is
    lost with the replica either way. Events come whole in one chunk as replicas write them,
    so nothing waits in the usual case."""

    def __init__(self, why_not: str = "not_resumable") -> None:
        super().__init__(why_not)
        self._held = b""

    def take(self, chunk: bytes) -> bytes:
        data = self._held + chunk
        end = max((at + len(mark) for mark in (b"\n\n", b"\r\n\r\n")
                   if (at := data.rfind(mark)) >= 0), default=0)
        if end == 0 and len(data) > MAX_HELD_EVENT_BYTES:
            end = len(data)
        self._held = data[end:]
        return data[:end]

    def flush(self) -> bytes:
        held, self._held = self._held, b""
        return held


def not_resumable(status: int, headers, why_not: str = "not_resumable") -> Resume:
    """The strategy of an answer no replica can go on with: whole events for an SSE stream
    the router can read event by event (200, not compressed), else every byte as it comes."""
    sse = headers.get("Content-Type", "").startswith("text/event-stream")
    if status == 200 and sse and headers.get("Content-Encoding", "identity") == "identity":
        return WholeEvents(why_not)
    return NotResumable(why_not) if why_not != "not_resumable" else NOT_RESUMABLE


class Continuable(Protocol):
    """A request's own plan for its answer (migration.py): the strategy its first answer
    gets, from that answer's status and headers."""

    def strategy(self, status: int, headers) -> Resume: ...


@dataclass
class AudioBytes(Resume):
    """Resume by byte offset and seed (the built-in engine's wav and pcm answers)."""

    seed: str
    content_type: str
    sse: bool
    base: int = 0  # the byte the first answer started at (a router in front asked for it)
    end: int | None = None  # the byte the answer ends at, when its length is known
    relayed: int = 0  # answer bytes (SSE: decoded audio bytes) the client has beyond `base`
    complete: bool = False
    _pending: int = 0
    _pending_done: bool = False
    _held: bytearray = field(default_factory=bytearray)
    name = "audio_bytes"
    resumable = True

    @property
    def offset(self) -> int:
        """The byte of the whole answer the next replica starts from."""
        return self.base + self.relayed

    def take(self, chunk: bytes) -> bytes:
        if not self.sse:
            self._pending = len(chunk)
            return chunk
        self._held += chunk
        cut = self._held.rfind(_EVENT_END)
        if cut < 0:
            return b""
        events = bytes(self._held[:cut + len(_EVENT_END)])
        del self._held[:cut + len(_EVENT_END)]
        self._pending, self._pending_done = _count_events(events)
        return events

    def sent(self) -> None:
        self.relayed += self._pending
        self._pending = 0
        self.complete = self.complete or self._pending_done

    def flush(self) -> bytes:
        rest = bytes(self._held)
        self._held.clear()
        return rest

    def resend(self) -> Resend:
        self._held.clear()  # a part of an event that never went out: the next replica resends it
        return Resend({RESUME_FROM_HEADER: str(self.offset), SEED_HEADER: self.seed})

    def check(self, status: int, headers) -> str | None:
        if status != 200:
            return f"it answered {status}"
        if headers.get(RESUMED_FROM_HEADER) != str(self.offset):
            return (f"it did not say it resumed from byte {self.offset} "
                    f"({RESUMED_FROM_HEADER}: {headers.get(RESUMED_FROM_HEADER)})")
        if headers.get(SEED_RESPONSE_HEADER) != self.seed:
            return f"it sampled with seed {headers.get(SEED_RESPONSE_HEADER)}, not {self.seed}"
        if headers.get("Content-Type") != self.content_type:
            return f"its Content-Type is {headers.get('Content-Type')}, not {self.content_type}"
        length = headers.get("Content-Length")
        if self.end is not None and length != str(self.end - self.offset):
            return f"its Content-Length is {length}, not the {self.end - self.offset} left"
        return None


def choose(status: int, headers, request_headers,
           migration: Continuable | None = None) -> Resume:
    """The strategy of a request, from its first answer's status and headers (and the request's
    own resume offset, when a router in front of this one resumes through it; and its
    migration plan, for an LLM stream under --migration-limit)."""
    if migration is not None:
        return migration.strategy(status, headers)
    seed = headers.get(SEED_RESPONSE_HEADER)
    if status != 200 or headers.get(RESUMABLE_HEADER) != RESUMABLE_BY_BYTES or seed is None:
        return not_resumable(status, headers)
    asked = request_headers.get(RESUME_FROM_HEADER, "0")
    if not (asked.isascii() and asked.isdigit()):
        return not_resumable(status, headers)
    content_type = headers.get("Content-Type", "")
    length = headers.get("Content-Length")
    sse = content_type.startswith("text/event-stream")
    end = int(asked) + int(length) if length is not None and length.isdigit() and not sse else None
    return AudioBytes(seed=seed, content_type=content_type, sse=sse, base=int(asked), end=end)


def _count_events(events: bytes) -> tuple[int, bool]:
    """(decoded audio bytes in these whole events, whether the last one was the answer's end).

    An error event raises ReplicaErrorEvent: the replica failed, and its message must not
    reach the client as the end of a stream another replica can still finish."""
    audio, done = 0, False
    for event in events.split(_EVENT_END)[:-1]:
        event += _EVENT_END
        if event.startswith(_DELTA_HEAD) and event.endswith(_DELTA_TAIL):
            size = len(event) - len(_DELTA_HEAD) - len(_DELTA_TAIL)
            padding = (event[-5:-4] == b"=") + (event[-6:-5] == b"=")
            audio += size // 4 * 3 - padding
            continue
        kind, size = _parse_event(event)
        if kind == "error":
            raise ReplicaErrorEvent(event.decode(errors="replace").strip())
        audio += size
        done = kind == "speech.audio.done"
    return audio, done


def _parse_event(event: bytes) -> tuple[str | None, int]:
    """(the event's type, its decoded audio bytes) for any event the fast path did not take."""
    for line in event.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        try:
            payload = json.loads(line[5:])
        except ValueError:
            return None, 0
        if not isinstance(payload, dict):
            return None, 0
        kind = payload.get("type") or ("error" if "error" in payload else None)
        audio = payload.get("audio")
        if kind == "speech.audio.delta" and isinstance(audio, str):
            try:
                return kind, len(base64.b64decode(audio, validate=True))
            except binascii.Error:
                return kind, 0
        return kind, 0
    return None, 0
