"""Token-exact migration of LLM streams: which requests may migrate, and how the continuation
is asked for (the answer's side, tracking and relaying the tokens, is token_stream.py).

An LLM's sampled text cannot be regenerated on another replica the way the built-in engine's
audio can, but its tokens can be continued: the prompt's token ids plus the ids generated so
far go back in as a prompt, and the engine goes on from there as the uncut request would have
(exactly so for greedy decoding). Under --migration-limit N, a streamed POST to a migration
path (vLLM: /v1/completions and /v1/chat/completions; sglang streams token ids on
completions only) is read as JSON before it goes upstream:

- one that can migrate goes upstream with `"return_token_ids": true`, so that every chunk of
  its answer carries the ids (the first one the prompt's); the router removes them from what
  the client reads unless the client asked for them itself;
- one that cannot is named with why (`NotMigratable.why`, the label of
  `omni_dp_router_streams_cut_total{why}` when such a stream is cut): several choices (`n`,
  `best_of`, several prompts), beam search, guided or structured decoding, logprobs (their
  text offsets and chat shape are the first replica's), stop strings (the engine holds back
  text that might start one, and a continuation never sends it), presence or frequency
  penalties (they count the output tokens, which a continuation takes as prompt), tools,
  images or other non-text input, prompt embeddings, and no stated `max_tokens` (the engine's
  default budget, which differs by endpoint and by model, is not known here).

The continuation is always a completions request whose prompt is token ids, also for a chat
request (its chunks are turned back into chat chunks): the same sampling fields, `max_tokens`
(and `min_tokens`) less what was generated.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from omni_dp.router.resume import NOT_RESUMABLE, Resume, not_resumable
from omni_dp.router.token_stream import COMPLETIONS_PATH, SSE_TYPE, TOKEN_IDS_FIELD, TokenStream

CHAT_PATH = "/v1/chat/completions"
MIGRATION_PATHS = (COMPLETIONS_PATH, CHAT_PATH)

# Fields that describe the prompt or the shape of the output, not the sampling: a continuation
# sets its own (prompt, max_tokens, stream, ...) or has none of these (chat's messages, tools,
# template; echo, which the first answer already did; a prompt truncation already applied to
# the ids the engine returned).
_NOT_CONTINUED = frozenset({
    "prompt", "messages", "echo", "suffix", "max_tokens", "max_completion_tokens",
    "min_tokens", "stream", TOKEN_IDS_FIELD, "tools", "tool_choice", "parallel_tool_calls",
    "functions", "function_call", "chat_template", "chat_template_kwargs",
    "add_generation_prompt", "continue_final_message", "documents", "mm_processor_kwargs",
    "add_special_tokens", "truncate_prompt_tokens", "truncation_side", "request_id",
    "logprobs", "top_logprobs", "return_prompt_text",
})
# Guided or structured decoding: its grammar state is the first replica's.
_STRUCTURED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
               "structured_outputs", "json_schema", "regex", "ebnf", "structural_tag")


def _number(value, default: float) -> float:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def budget(request: dict) -> int | None:
    """The request's stated output budget (chat's max_completion_tokens wins, as in vLLM)."""
    for name in ("max_completion_tokens", "max_tokens"):
        value = request.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _structured(request: dict) -> bool:
    form = request.get("response_format")
    if isinstance(form, dict) and form.get("type") not in (None, "text"):
        return True
    return any(request.get(name) not in (None, False, "", [], {}) for name in _STRUCTURED)


def _several_prompts(request: dict) -> bool:
    prompt = request.get("prompt")
    return isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int) \
        and len(prompt) > 1


def _non_text_input(request: dict) -> bool:
    """A chat message with a part that is not text (an image, audio, video, a file)."""
    for message in request.get("messages") or ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(
                not isinstance(part, dict) or part.get("type") != "text" for part in content):
            return True
    return False


# Each rule: (why not, the request has it). The first that holds names the request.
_RULES: tuple[tuple[str, Callable[[dict], bool]], ...] = (
    ("n", lambda r: _number(r.get("n"), 1) > 1),
    ("best_of", lambda r: _number(r.get("best_of"), 1) > 1),
    ("several_prompts", _several_prompts),
    ("beam_search", lambda r: bool(r.get("use_beam_search"))),
    ("structured_output", _structured),
    ("logprobs", lambda r: r.get("logprobs") not in (None, False)
     or r.get("prompt_logprobs") is not None or bool(r.get("top_logprobs"))),
    ("stop_strings", lambda r: bool(r.get("stop"))),
    ("output_penalties", lambda r: _number(r.get("presence_penalty"), 0) != 0
     or _number(r.get("frequency_penalty"), 0) != 0),
    ("tools", lambda r: bool(r.get("tools")) and r.get("tool_choice") != "none"),
    ("non_text_input", _non_text_input),
    ("prompt_embeds", lambda r: r.get("prompt_embeds") is not None),
    ("no_max_tokens", lambda r: budget(r) is None),
)


@dataclass(frozen=True)
class NotMigratable:
    """A streamed LLM request that cannot migrate, and why (a bounded metric label)."""

    why: str

    def upstream_body(self, body: bytes) -> bytes:
        return body

    def strategy(self, status: int, headers) -> Resume:
        return not_resumable(status, headers, self.why) if _streaming(status, headers) \
            else NOT_RESUMABLE


@dataclass(frozen=True)
class MigrationPlan:
    """A streamed LLM request that can migrate: what the continuation is made of."""

    request: dict  # the client's request, as parsed
    chat: bool
    max_tokens: int  # its stated budget
    client_wants_ids: bool  # it asked for the token ids itself: they stay in its chunks
    include_usage: bool  # it asked for a usage chunk (stream_options.include_usage)
    max_seq_len: int | None  # --migration-max-seq-len

    def upstream_body(self, body: bytes) -> bytes:
        """The client's body asking for token ids: the field put in front of the others,
        nothing else touched (re-serialised only where the client set it to something else)."""
        if self.client_wants_ids:
            return body
        start = len(body) - len(body.lstrip())
        if TOKEN_IDS_FIELD in self.request or body[start:start + 1] != b"{":
            return json.dumps({**self.request, TOKEN_IDS_FIELD: True}).encode()
        return body[:start + 1] + b'"' + TOKEN_IDS_FIELD.encode() + b'":true,' + \
            body[start + 1:]

    def strategy(self, status: int, headers) -> Resume:
        return TokenStream(self) if _streaming(status, headers) else NOT_RESUMABLE

    def continuation(self, token_ids: list[int], generated: int) -> bytes:
        """The completions request that goes on after `generated` tokens: `token_ids` (the
        prompt's and the generated ones) as its prompt, the rest of the budget, the same
        sampling."""
        body = {name: value for name, value in self.request.items()
                if name not in _NOT_CONTINUED}
        body.update(prompt=token_ids, max_tokens=self.max_tokens - generated, stream=True)
        body[TOKEN_IDS_FIELD] = True
        min_tokens = self.request.get("min_tokens")
        if isinstance(min_tokens, int) and not isinstance(min_tokens, bool) and min_tokens:
            body["min_tokens"] = max(min_tokens - generated, 0)
        return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


def plan_migration(method: str, path: str, body: bytes, limit: int, paths: tuple[str, ...],
                   max_seq_len: int | None) -> MigrationPlan | NotMigratable | None:
    """The migration plan of one request: None unless it is a streamed POST to one of `paths`
    with migration on (limit > 0) and a JSON object for a body."""
    if limit <= 0 or method != "POST" or path not in paths:
        return None
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(request, dict) or request.get("stream") is not True:
        return None
    for why, has in _RULES:
        if has(request):
            return NotMigratable(why)
    options = request.get("stream_options")
    return MigrationPlan(request, chat=path == CHAT_PATH, max_tokens=budget(request) or 0,
                         client_wants_ids=request.get(TOKEN_IDS_FIELD) is True,
                         include_usage=isinstance(options, dict)
                         and options.get("include_usage") is True,
                         max_seq_len=max_seq_len)


def _streaming(status: int, headers) -> bool:
    """An answer the router can read chunk by chunk: SSE, not compressed."""
    return (status == 200 and headers.get("Content-Type", "").startswith(SSE_TYPE)
            and headers.get("Content-Encoding", "identity") == "identity")
