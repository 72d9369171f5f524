"""`python -m omni_dp.launcher.processes.pin CPUS -- PROGRAM ARGS…`: pin, then become PROGRAM.

The replica must be on its CPU block before it executes anything (a thread pool sized at import
would otherwise spread over every core), and Python's subprocess cannot set the child's affinity
without a preexec_fn (unsafe once the supervisor has threads). Hand-written because taskset and
numactl are not on every machine; exec keeps the pid, so the launcher's record stays valid.
"""

from __future__ import annotations

import os
import sys

from omni_dp.contract import ExitCode
from omni_dp.cpulist import parse_cpu_list

EXEC_FAILED = 127  # the shell's "command not found / not executable"


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m omni_dp.launcher.processes.pin CPUS -- PROGRAM [ARGS…]",
              file=sys.stderr)
        return ExitCode.USAGE
    try:
        os.sched_setaffinity(0, parse_cpu_list(argv[0]))
    except (ValueError, OSError) as exc:
        print(f"omni-dp pin: cannot pin to CPUs {argv[0]}: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    try:
        os.execvp(argv[2], argv[2:])
    except OSError as exc:
        print(f"omni-dp pin: cannot run {argv[2]}: {exc}", file=sys.stderr)
        return EXEC_FAILED


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
