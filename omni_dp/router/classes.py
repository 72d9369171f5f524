"""Priority classes of requests (issue 42): which class a request is in, from its headers and
the router's defaults. Pure: headers and settings in, a class or the reason for a 400 out.

Three classes, served in this order: `interactive` (a person waits on the answer), `default`,
`bulk` (batch work that may wait). The client names its class with `X-Omni-DP-Priority`, or
with the header of smg (the SGLang model gateway), `x-smg-priority`, so that requests a
gateway in front of us classed keep their class; ours wins when both are sent. A request with
neither gets its route's class (--route-priority), else the router's (--default-priority).
There is one API key per router (--api-key), so there is no per-key class.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from omni_dp.contract import (
    PRIORITY_HEADER,
    PRIORITY_NAMES,
    BadPriority,
    Priority,
    parse_priority,
)

SMG_PRIORITY_HEADER = "x-smg-priority"
# Where vLLM reads a `priority` field (--priority-field): its completions and chat requests.
PRIORITY_FIELD_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


# smg's levels (bulk < default < interactive < system): `system` is our interactive, and an
# unknown value is `default`, as smg itself takes it.
_SMG_LEVELS = {"bulk": Priority.BULK, "default": Priority.DEFAULT,
               "interactive": Priority.INTERACTIVE, "system": Priority.INTERACTIVE}


def parse_route_priority(text: str) -> tuple[str, Priority]:
    """`PATH=CLASS` of --route-priority; ValueError naming what is wrong."""
    path, sep, name = text.rpartition("=")
    if not sep or not path.startswith("/"):
        raise ValueError(f"--route-priority must be PATH=CLASS with PATH starting with /, "
                         f"got {text!r}")
    try:
        return path, parse_priority(name)
    except BadPriority:
        raise ValueError(f"--route-priority {text!r}: the class must be one of "
                         f"{', '.join(PRIORITY_NAMES)}") from None


@dataclass(frozen=True)
class PriorityRules:
    """The classes of requests that name none: the router's, and per route (exact path)."""

    default: Priority = Priority.DEFAULT
    routes: Mapping[str, Priority] | None = None

    def resolve(self, headers: Mapping[str, str], path: str) -> Priority:
        """The request's class; BadPriority when X-Omni-DP-Priority is not a class name."""
        ours = headers.get(PRIORITY_HEADER)
        if ours is not None and ours.strip():  # case and spaces ignored, as the engine does
            return parse_priority(ours)
        smg = headers.get(SMG_PRIORITY_HEADER)
        if smg is not None:
            return _SMG_LEVELS.get(smg.strip().lower(), Priority.DEFAULT)
        if self.routes:
            return self.routes.get(path, self.default)
        return self.default


def with_priority_field(body: bytes, priority: Priority, *, low_first: bool = True) -> bytes:
    """The JSON object `body` with the engine's `priority` field for the class added (-1 / 0 /
    1 for interactive / default / bulk where lower runs first; negated where higher runs
    first), unless it has one (the client's wins) or is no JSON object (the replica answers
    that as it would).

    vLLM: `priority: int` on CompletionRequest and ChatCompletionRequest, lower runs first,
    default 0, and any other value is an error unless the engine runs with
    --scheduling-policy priority (vllm/entrypoints/openai/chat_completion/protocol.py and
    completion/protocol.py, `priority: int = Field(default=0, ...)`;
    vllm/config/scheduler.py, `SchedulerPolicy = Literal["fcfs", "priority"]`).
    sglang: `priority: Optional[int]` on the same requests, honoured under
    --enable-priority-scheduling, higher first unless --schedule-low-priority-values-first
    (sglang/srt/entrypoints/openai/protocol.py; srt/managers/scheduler.py
    `_set_or_validate_priority`).
    The field is spliced in before the closing brace: the client's bytes stay as they were.
    """
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return body
    if not isinstance(parsed, dict) or "priority" in parsed:
        return body
    end = body.rstrip().rfind(b"}")
    before = body[:end].rstrip()
    comma = b"" if before.endswith(b"{") else b","
    value = priority.vllm_priority if low_first else -priority.vllm_priority
    return before + comma + b'"priority":' + str(value).encode() + body[end:]
