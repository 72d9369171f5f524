"""An LLM stream relayed so that another replica can go on with it (the request's side, what
may migrate and the continuation request, is migration.py).

The answer (OpenAI-style SSE chunks, `"return_token_ids": true` asked) is relayed whole event
by whole event. The prompt's token ids (first chunk) and every chunk's generated ids are kept,
and removed from what the client reads (null, as vLLM writes them unasked) unless it asked for
them. Cut, the answer goes on as a completions request from the prompt ids plus generated ids
(`resend`), and that replica's chunks are relayed as the first one's: its `id`, `created`,
`model`, choice index and chunk kind (a chat request's chunks are made chat chunks again), the
usage counting the first prompt and every completion token, one `[DONE]`.

Where the continuation starts matters for its text. The engine's incremental detokenizer,
given a prompt that ends in the middle of a character, writes the whole prompt's text at its
first step (vLLM 0.32 with tokenizers 0.23: measured). So the continuation starts at a token
boundary known to be clean:
- a chunk that carries tokens but no text yet (in the middle of a character, or a token that
  shows nothing) is held until a chunk with text or the finish comes, so a one-token chunk with
  text always ends on a clean boundary;
- a chunk of several tokens (the engine merges them when its reader lags) may end inside a
  character; the boundary before a chunk whose text starts with an ASCII character is clean
  (bytes left pending there would have come out first, as a non-ASCII character);
- cut after an unproven boundary, the continuation starts at the last clean one, and the
  tokens and text the client already has from there are checked against what it sends and
  skipped (`_past_overlap`); greedy decoding sends them again exactly, a sampled request
  whose continuation goes another way is refused (cut, never spliced).

A replica that fails shows as a read error, a stall, an error event, a finish reason `abort`,
or a body that ends before its `[DONE]` (`at_end`): each is a failure the proxy may migrate.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from typing import Protocol

from omni_dp.router.resume import ContinuationRefused, ReplicaErrorEvent, Resend, Resume

COMPLETIONS_PATH = "/v1/completions"
SSE_TYPE = "text/event-stream"
TOKEN_IDS_FIELD = "return_token_ids"
_EVENT_END = b"\n\n"
# An event longer than this is no engine's chunk (their separators are "\n\n"): past it the
# stream is relayed as it comes, untracked, rather than held.
_MAX_EVENT = 1024 * 1024
_DONE = b"data: [DONE]\n\n"
# What a chat delta may hold for its text to be the whole output; reasoning or tool-call
# deltas come from a parser a completions continuation does not run.
_PLAIN_DELTA = frozenset({"role", "content"})
_IDENTITY = ("id", "object", "created", "model", "choices")
# The ids the client did not ask for, nulled in the chunk's own bytes as vLLM writes them
# unasked (its and sglang's chunks are compact JSON): a key followed by `":` cannot occur
# inside a JSON string, whose quotes are escaped.
def _nulling(key: bytes):
    return functools.partial(re.compile(b'"' + key + rb'":\[[0-9, ]*\]').sub,
                             b'"' + key + b'":null')


_null_token_ids, _null_prompt_ids = _nulling(b"token_ids"), _nulling(b"prompt_token_ids")
_decode = json.JSONDecoder().decode
_encode = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


class StreamPlan(Protocol):
    """What the stream needs of its request's plan (migration.MigrationPlan)."""

    chat: bool
    client_wants_ids: bool
    include_usage: bool
    max_seq_len: int | None

    def continuation(self, token_ids: list[int], generated: int) -> bytes: ...


@dataclass
class _Event:
    """One SSE event as it goes to the client, and what it says of the answer."""

    data: bytes
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    usage: bool = False
    done: bool = False


@dataclass(frozen=True)
class _Identity:
    """What every chunk the client reads says of the answer: the first replica's."""

    id: object
    object: object
    created: object
    model: object
    index: object


def _token_ids(value) -> list[int] | None:
    if isinstance(value, list) and all(isinstance(t, int) for t in value):
        return value
    return None


def _text(choice: dict, chat: bool) -> str:
    if not chat:
        text = choice.get("text")
    else:
        delta = choice.get("delta")
        text = delta.get("content") if isinstance(delta, dict) else None
    return text if isinstance(text, str) else ""


def _dumps(chunk: dict) -> bytes:
    return b"data: " + _encode(chunk).encode() + _EVENT_END


class TokenStream(Resume):
    """Migration by token ids (see the module's docstring)."""

    name = "token_ids"
    migrates = True

    def __init__(self, plan: StreamPlan) -> None:
        self.plan = plan
        self._tracking = True  # false once the stream cannot migrate (`_why` says why)
        self._why = "no_token_ids"
        self.complete = False  # the finish reached the client: nothing is left to generate
        self.prompt_ids: list[int] | None = None
        self.generated: list[int] = []  # ids the client has (let go once not migratable)
        self.num_generated = 0
        self.base = 0  # generated tokens in the prompt of the replica answering now
        self.clean = 0  # the last token boundary known to be clean (see the docstring)
        self.continuing = False
        self.identity: _Identity | None = None
        self.usage_sent = False
        self.done_sent = False
        self._since_clean: list[str] = []  # the text the client has after `clean`
        self._skip_ids: list[int] = []  # a continuation's overlap, still to be checked
        self._skip_text = ""
        self._buffer = bytearray()
        self._passthrough = False  # relayed as it comes (`_untracked`)
        self._held: list[_Event] = []
        self._pending: list[_Event] = []

    @property
    def resumable(self) -> bool:
        return self._tracking and self.prompt_ids is not None and self.identity is not None

    @property
    def why_not(self) -> str:
        return self._why if not self._tracking else "no_token_ids"

    @property
    def offset(self) -> int:
        """Tokens the client has."""
        return self.num_generated

    # --- relaying --------------------------------------------------------------------------
    def take(self, chunk: bytes) -> bytes:
        if self._passthrough:
            return chunk
        if self._buffer:
            self._buffer += chunk
            chunk = bytes(self._buffer)
            self._buffer.clear()
        end = chunk.rfind(_EVENT_END)
        if end < 0 and len(chunk) > _MAX_EVENT:
            return self._untracked(chunk)
        cut = end + len(_EVENT_END) if end >= 0 else 0
        self._buffer += chunk[cut:]  # part of an event: held until its end comes
        ready: list[_Event] = []
        for raw in chunk[:cut].split(_EVENT_END)[:-1]:
            event = self._read(raw + _EVENT_END)
            if event is None:
                continue
            if self.resumable and event.tokens and not event.text and not event.finished:
                self._held.append(event)
                continue
            ready += self._held
            ready.append(event)
            self._held.clear()
        if not self.resumable:  # nothing is held for a stream that cannot migrate
            ready += self._held
            self._held.clear()
        self._pending += ready
        return b"".join(event.data for event in ready)

    def _untracked(self, data: bytes) -> bytes:
        """No event's end within _MAX_EVENT bytes: these are no engine's chunks; from here on
        they go out as they come, and the stream cannot migrate."""
        self._stop("unreadable_chunk")
        self._passthrough = True
        ready = [*self._held, _Event(data)]
        self._held.clear()
        self._pending += ready
        return b"".join(event.data for event in ready)

    def sent(self) -> None:
        for event in self._pending:
            self._count(event)
            # a [DONE] ends the answer for the client, its finish seen or not: nothing may
            # follow it (a continuation would be read after the end)
            self.complete = self.complete or event.finished or event.done
            self.usage_sent = self.usage_sent or event.usage
            self.done_sent = self.done_sent or event.done
        self._pending.clear()
        self._check_length()

    def _count(self, event: _Event) -> None:
        """The client has `event`: its tokens, and what it proves of the boundaries."""
        if event.text and event.text[0].isascii():  # nothing was pending before it
            self.clean, self._since_clean = self.num_generated, []
        self.num_generated += len(event.tokens)
        if not self._tracking:
            return
        self.generated += event.tokens
        if event.text and len(event.tokens) == 1:  # one token that wrote its text
            self.clean, self._since_clean = self.num_generated, []
        elif event.text:
            self._since_clean.append(event.text)

    def at_end(self) -> str | None:
        if self.done_sent or self._passthrough:
            return None
        return "the stream ended before its [DONE]"

    def ending(self) -> bytes:
        """The end of an answer whose finish the client has: its usage (when asked for and
        not sent yet) and [DONE]."""
        if self.done_sent:
            return b""
        tail = b""
        if self.plan.include_usage and not self.usage_sent and self.identity is not None \
                and self.prompt_ids is not None:
            ident = self.identity
            prompt = len(self.prompt_ids)
            usage = {"prompt_tokens": prompt, "total_tokens": prompt + self.num_generated,
                     "completion_tokens": self.num_generated}
            tail = _dumps({"id": ident.id, "object": ident.object, "created": ident.created,
                           "model": ident.model, "choices": [], "usage": usage})
        return tail + _DONE

    # --- migrating ---------------------------------------------------------------------------
    def resend(self) -> Resend:
        """A completions request going on from the last clean boundary; what the client has
        beyond it is checked and skipped."""
        self._buffer.clear()
        self._held.clear()
        self._pending.clear()
        self.continuing = True
        self.base = self.clean
        self._skip_ids = self.generated[self.clean:]
        self._skip_text = "".join(self._since_clean)
        prompt = (self.prompt_ids or []) + self.generated[:self.clean]
        return Resend({"Content-Type": "application/json"}, path=COMPLETIONS_PATH,
                      body=self.plan.continuation(prompt, self.base))

    def check(self, status: int, headers) -> str | None:
        if status != 200:
            return f"it answered {status}"
        content_type = headers.get("Content-Type", "")
        if not content_type.startswith(SSE_TYPE):
            return f"its Content-Type is {content_type}, not {SSE_TYPE}"
        if headers.get("Content-Encoding", "identity") != "identity":
            return f"it is compressed ({headers.get('Content-Encoding')})"
        return None

    # --- one event -------------------------------------------------------------------------
    def _read(self, raw: bytes) -> _Event | None:
        if not raw.startswith(b"data:"):
            return _Event(raw)  # a comment or another kind of event: as it came
        payload = raw[len(b"data:"):].strip()
        if payload == b"[DONE]":
            return _Event(raw, done=True)
        try:
            chunk = _decode(payload.decode())
        except ValueError:
            chunk = None
        if not isinstance(chunk, dict):
            self._stop("unreadable_chunk")
            return _Event(raw)
        if "error" in chunk:  # the replica failed: another may go on
            raise ReplicaErrorEvent(raw.decode(errors="replace").strip())
        choices = chunk.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices \
            and isinstance(choices[0], dict) else None
        if self.resumable and choice is not None and choice.get("finish_reason") == "abort":
            raise ReplicaErrorEvent("the replica aborted the request")
        if self.continuing:
            return self._continued(chunk, choice)
        return self._first(chunk, choice, raw)

    def _first(self, chunk: dict, choice: dict | None, raw: bytes) -> _Event:
        """A chunk of the first replica's answer: kept as it is but for the ids."""
        if self.identity is None and "id" in chunk:
            self.identity = _Identity(chunk.get("id"), chunk.get("object"),
                                      chunk.get("created"), chunk.get("model"),
                                      (choice or {}).get("index", 0))
        where = chunk if self.plan.chat else (choice or {})
        prompt_ids = _token_ids(where.get("prompt_token_ids"))
        if self.prompt_ids is None and prompt_ids:
            self.prompt_ids = list(prompt_ids)
            self._check_length()
        event = self._event(chunk, choice)
        event.data = raw
        if not self.plan.client_wants_ids:
            if prompt_ids is not None:
                event.data = _null_prompt_ids(event.data)
            if choice is not None and choice.get("token_ids") is not None:
                event.data = _null_token_ids(event.data)
        return event

    def _continued(self, chunk: dict, choice: dict | None) -> _Event | None:
        """A chunk of a continuation (a completions answer), made one of the first answer's;
        None when all of it is what the client already has."""
        event = self._event(chunk, choice)
        if self._skip_ids or self._skip_text:
            self._past_overlap(event)
            if not (event.tokens or event.text or event.finished or event.usage):
                return None
        ident = self.identity
        out = {"id": ident.id, "object": ident.object, "created": ident.created,
               "model": ident.model, "choices": []}
        if choice is not None:
            out["choices"] = [self._client_choice(choice, event)]
        out.update((key, value) for key, value in chunk.items() if key not in _IDENTITY)
        usage = out.get("usage")
        if isinstance(usage, dict) and self.prompt_ids is not None:
            completion = self.base + int(usage.get("completion_tokens") or 0)
            prompt = len(self.prompt_ids)
            usage.update(prompt_tokens=prompt, total_tokens=prompt + completion,
                         completion_tokens=completion)
            usage.pop("prompt_tokens_details", None)  # the continuation's cache, not the answer's
        event.data = _dumps(out)
        return event

    def _past_overlap(self, event: _Event) -> None:
        """Check the part of `event` the client already has against what it has, and drop
        it: a continuation that went another way is refused."""
        n = min(len(self._skip_ids), len(event.tokens))
        m = min(len(self._skip_text), len(event.text))
        if event.tokens[:n] != self._skip_ids[:n] or event.text[:m] != self._skip_text[:m]:
            raise ContinuationRefused("the continuation did not repeat the tokens the client "
                                      "has beyond the last clean boundary (sampled otherwise)")
        self._skip_ids, event.tokens = self._skip_ids[n:], event.tokens[n:]
        self._skip_text, event.text = self._skip_text[m:], event.text[m:]
        if event.finished and (self._skip_ids or self._skip_text):
            raise ContinuationRefused("the continuation finished before the client's tokens")

    def _client_choice(self, choice: dict, event: _Event) -> dict:
        ids = event.tokens if self.plan.client_wants_ids else None
        if not self.plan.chat:
            return {**choice, "index": self.identity.index, "text": event.text,
                    **({"prompt_token_ids": None} if "prompt_token_ids" in choice else {}),
                    "token_ids": ids}
        finish = choice.get("finish_reason")
        made = {"index": self.identity.index, "delta": {"content": event.text},
                "logprobs": None, "finish_reason": finish}
        if finish is not None:
            made["stop_reason"] = choice.get("stop_reason")
        made["token_ids"] = ids
        return made

    def _event(self, chunk: dict, choice: dict | None) -> _Event:
        """What a chunk says of the answer: its tokens and text, whether it finishes."""
        event = _Event(b"", usage=isinstance(chunk.get("usage"), dict))
        if choice is None:
            return event
        chat = self.plan.chat and not self.continuing
        if chat and not _PLAIN_DELTA.issuperset(choice.get("delta") or {}):
            self._stop("parsed_output")  # reasoning or tool calls: a parser's, not the text
        event.text = _text(choice, chat)
        tokens = _token_ids(choice.get("token_ids"))
        if tokens is None or (tokens and self.prompt_ids is None):
            if event.text or "token_ids" in choice:
                self._stop("no_token_ids")  # the engine did not give them
            tokens = []
        event.tokens = list(tokens)
        event.finished = choice.get("finish_reason") is not None
        return event

    def _check_length(self) -> None:
        limit = self.plan.max_seq_len
        if limit is not None and self.prompt_ids is not None \
                and len(self.prompt_ids) + self.num_generated > limit:
            self._stop("max_seq_len")

    def _stop(self, why: str) -> None:
        """This stream cannot migrate any more: its ids are let go, nothing is held."""
        if self._tracking:
            self._tracking, self._why = False, why
            self.generated, self._since_clean = [], []

