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
