"""A stand-in for a multi-process engine (vLLM's API server → EngineCore → Worker), for tests.

    python orphaning_engine.py PIDFILE [--stubborn ROLE] [--token-in ROLE] [--lifetime S]

The leader (what omni-dp spawns, in a session of its own) forks a `core`, which forks a
`worker`. Each child execs itself again with the run's identity variables REMOVED from its
environment (as a renamed vLLM child shows none in /proc/PID/environ), unless --token-in names
it (the token travels down under another name for that), and renames itself (/proc/self/comm:
StandinCore, StandinWorker). Every process appends "ROLE PID" to PIDFILE once it is set up. A
--stubborn role ignores SIGTERM (only SIGKILL ends it). Nothing here outlives --lifetime
seconds (default 60), so a failed test leaves nothing running for long. The children do not
die with their parent: a SIGKILLed leader leaves them running as orphans in its session and
process group.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

TOKEN_ENV = "OMNI_DP_RUN_TOKEN"
IDENTITY_ENVS = (TOKEN_ENV, "OMNI_DP_REPLICA", "OMNI_DP_RUN_ID")
HIDDEN_TOKEN_ENV = "ORPHANING_ENGINE_TOKEN"
CHILD = {"leader": "core", "core": "worker", "worker": None}
NAMES = {"core": "StandinCore", "worker": "StandinWorker"}


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("pidfile")
    parser.add_argument("--role", default="leader", choices=tuple(CHILD))
    parser.add_argument("--stubborn", action="append", default=[])
    parser.add_argument("--token-in", action="append", default=[])
    parser.add_argument("--lifetime", type=float, default=60.0)
    return parser.parse_args(argv)


def _spawn(role: str, args: argparse.Namespace) -> None:
    """fork + execve of this script as `role`, the identity variables filtered out."""
    env = {k: v for k, v in os.environ.items() if k not in IDENTITY_ENVS}
    if TOKEN_ENV in os.environ:  # kept out of sight, for a descendant named by --token-in
        env[HIDDEN_TOKEN_ENV] = os.environ[TOKEN_ENV]
    if role in args.token_in and HIDDEN_TOKEN_ENV in env:
        env[TOKEN_ENV] = env[HIDDEN_TOKEN_ENV]
    argv = [sys.executable, __file__, args.pidfile, "--role", role,
            "--lifetime", str(args.lifetime)]
    for flag, roles in (("--stubborn", args.stubborn), ("--token-in", args.token_in)):
        for name in roles:
            argv += [flag, name]
    if os.fork() == 0:
        try:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # an ignored signal survives exec
            os.execve(sys.executable, argv, env)
        finally:
            os._exit(127)


def main(argv: list[str]) -> int:
    args = _args(argv)
    if args.role in NAMES:
        with open("/proc/self/comm", "w") as comm:
            comm.write(NAMES[args.role])
    if args.role in args.stubborn:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = CHILD[args.role]
    if child is not None:
        _spawn(child, args)
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children reaped as they exit
    with open(args.pidfile, "a") as pidfile:
        pidfile.write(f"{args.role} {os.getpid()}\n")
    time.sleep(args.lifetime)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
