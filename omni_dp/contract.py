"""The contracts every part of omni-dp shares, spelled once (docs/contracts.md).

- the environment a launcher gives each child: which run and replica it belongs to and the
  run's secret token (how teardown and verify-mps recognise our processes);
- exit codes: 0 ok, 1 a check said no, 2 bad input (nothing was created), 3 a runtime
  failure, 4 a weight-sharing follower whose leader is gone;
- `Problems`: every problem found in a piece of input, raised at once;
- the HTTP headers the router and the built-in replica exchange to retry and resume a request
  (docs/contracts.md, "Retry and resume").
"""

from __future__ import annotations

import enum

RUN_ID_ENV = "OMNI_DP_RUN_ID"
REPLICA_ENV = "OMNI_DP_REPLICA"
TOKEN_ENV = "OMNI_DP_RUN_TOKEN"
API_KEY_ENV = "OMNI_DP_API_KEY"  # the router's key: given to the router and supervisor only
# What marks a process as one of a run's: never inherited from the caller's environment.
RUN_IDENTITY_ENVS = (TOKEN_ENV, REPLICA_ENV, RUN_ID_ENV)


# Router → replica: the seed to sample with when the body names none (the first answer's X-Seed,
# so that a resumed request samples exactly what the cut one did).
SEED_HEADER = "X-Omni-DP-Seed"
# Router → replica: send the answer from this byte of its audio on (the bytes of the
# response_format; with stream_format sse, the decoded bytes of its deltas).
RESUME_FROM_HEADER = "X-Omni-DP-Resume-From"
# Replica → router: this answer can be resumed by byte offset ("bytes"); absent: it cannot.
RESUMABLE_HEADER = "X-Omni-DP-Resumable"
# Client → router → replica: the request's class, interactive | default | bulk (docs/contracts.md,
# "Priority classes"). Both read it alike: case and surrounding spaces ignored.
PRIORITY_HEADER = "X-Omni-DP-Priority"


class Priority(enum.IntEnum):
    """A request's class; the lower value is served first (the router's queues, a replica's
    scheduler). It crosses to a stage process by its value."""

    INTERACTIVE = 0
    DEFAULT = 1
    BULK = 2

    @property
    def label(self) -> str:
        """Its name on the wire, in flags and in metric labels."""
        return self.name.lower()

    @property
    def vllm_priority(self) -> int:
        """vLLM's `priority` request field (lower runs first, 0 its default): -1 / 0 / 1."""
        return int(self) - 1


PRIORITY_NAMES = tuple(p.label for p in Priority)  # in service order
_BY_LABEL = {p.label: p for p in Priority}


class BadPriority(ValueError):
    """X-Omni-DP-Priority names no class: a 400 naming the header and the accepted values."""


def parse_priority(text: str) -> Priority:
    """A class name (case and surrounding spaces ignored) → its class; else BadPriority."""
    found = _BY_LABEL.get(text.strip().lower())
    if found is None:
        raise BadPriority(f"{PRIORITY_HEADER} must be one of {', '.join(PRIORITY_NAMES)}; "
                          f"got {text[:64]!r}")
    return found
RESUMABLE_BY_BYTES = "bytes"
# Replica → router: the offset this answer starts at (echoes RESUME_FROM_HEADER, so a replica
# that ignored it is never spliced into a stream).
RESUMED_FROM_HEADER = "X-Omni-DP-Resumed-From"
# Replica (or router) → router, on a 5xx: the server is going away (starting, draining,
# failed) and did no part of the request: another replica may take it.
GOING_AWAY_HEADER = "X-Omni-DP-Going-Away"


class ExitCode(enum.IntEnum):
    OK = 0
    CHECK_FAILED = 1  # a check ran and said no: status not healthy, verify-mps FAIL, a failed stop
    USAGE = 2  # bad input: named, and nothing was created
    RUNTIME = 3  # something failed (or was left behind) after start
    LEADER_GONE = 4  # a weight-sharing follower stopped serving: the leader it maps is gone


class Problems(ValueError):
    """Every problem found in one piece of input, in the order found; str() is one per line."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems
