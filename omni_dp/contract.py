"""The contracts every part of omni-dp shares, spelled once (docs/contracts.md).

- the environment a launcher gives each child: which run and replica it belongs to and the
  run's secret token (how teardown and verify-mps recognise our processes);
- exit codes: 0 ok, 1 a check said no, 2 bad input (nothing was created), 3 a runtime
  failure, 4 a weight-sharing follower whose leader is gone;
- `Problems`: every problem found in a piece of input, raised at once.
"""

from __future__ import annotations

import enum

RUN_ID_ENV = "OMNI_DP_RUN_ID"
REPLICA_ENV = "OMNI_DP_REPLICA"
TOKEN_ENV = "OMNI_DP_RUN_TOKEN"
API_KEY_ENV = "OMNI_DP_API_KEY"  # the router's key: given to the router and supervisor only
# What marks a process as one of a run's: never inherited from the caller's environment.
RUN_IDENTITY_ENVS = (TOKEN_ENV, REPLICA_ENV, RUN_ID_ENV)


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
