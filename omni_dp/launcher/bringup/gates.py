"""The gates a replica passes before it takes traffic: health and equal KV (attachment is the
MPS package's verdict, `omni_dp.mps.runs.verify_and_record`).

Bring-up and every restart use the same gates, so a restarted replica is held to exactly the
standard the first one was. Talks to replicas and the router over HTTP only.
"""

from __future__ import annotations

import signal
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from omni_dp.blocking_http import http_json
from omni_dp.launcher.engines.replica_api import GateFailed
from omni_dp.procs import ProcessIdentity, is_alive


def describe_exit(code: int | None) -> str:
    """How a process ended, in words: Popen's negative return codes are signals."""
    if code is None:
        return "died"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join("    " + line for line in text.splitlines()[-lines:])


def wait_healthy(url: str, identity: ProcessIdentity, log: Path, timeout_s: float,
                 exit_code: Callable[[], int | None] = lambda: None,
                 on_poll: Callable[[], None] = lambda: None) -> float:
    """Poll GET /health until 200: fast at first, backing off to 1 s. Early death is reported
    at once with the log tail. on_poll runs before every probe (the launcher records the
    replica's processes as they appear). Returns the seconds it took."""
    started = time.monotonic()
    delay = 0.05
    while True:
        on_poll()
        code = exit_code()
        if code is not None or not is_alive(identity):
            raise GateFailed(f"{describe_exit(code)} before it was healthy; last lines of "
                             f"{log}:\n{log_tail(log)}")
        status, _ = http_json("GET", url + "/health", timeout=2.0)
        if status == 200:
            return time.monotonic() - started
        if time.monotonic() - started > timeout_s:
            raise GateFailed(f"not healthy within {timeout_s:.0f} s (last /health: "
                             f"{status or 'no answer'}); last lines of {log}:\n{log_tail(log)}")
        time.sleep(delay)
        delay = min(delay * 1.5, 1.0)


def kv_problems(tokens: dict[int, int], expected: int | None) -> list[str]:
    """Every replica must hold exactly the planned KV capacity (or, where the engine derives
    the count itself, the same as every other); a table when one does not, each replica off
    the plan (or off the count most hold) marked."""
    if expected is None:
        ranked = Counter(tokens.values()).most_common()
        if len(ranked) <= 1:
            return []
        if ranked[0][1] > ranked[1][1]:
            expected = ranked[0][0]
            what = f"every replica must hold the same; most hold {expected} tokens"
        else:
            what = "every replica must hold the same; no count is held by most"
    elif all(value == expected for value in tokens.values()):
        return []
    else:
        what = f"expected {expected} tokens each"
    rows = [f"    replica {i}: {value} tokens"
            + ("  ← differs" if expected is not None and value != expected else "")
            for i, value in sorted(tokens.items())]
    return [f"KV capacity differs between replicas ({what}):\n" + "\n".join(rows)]
