"""The gates a replica passes before it takes traffic: health and equal KV (attachment is the
MPS package's verdict, `omni_dp.mps.runs.verify_and_record`).

Bring-up and every restart use the same gates, so a restarted replica is held to exactly the
standard the first one was. Talks to replicas and the router over HTTP only.
"""

from __future__ import annotations

import json
import signal
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from omni_dp.procs import ProcessIdentity, is_alive

# Loopback only: an http_proxy in the environment must never see these requests.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class GateFailed(Exception):
    """A replica did not pass a gate; the message says which and why (with its log tail)."""


def http_json(method: str, url: str, body: dict | None = None, timeout: float = 3.0,
              headers: dict[str, str] | None = None) -> tuple[int, dict | None]:
    """(status, parsed JSON body or None); status 0 when nothing answered.

    Blocking urllib on purpose: the launcher makes a handful of calls per second from plain
    threads, and needs no event loop for that."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json",
                                              **(headers or {})})
    status, raw, _ = _send(request, timeout)
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, None


def http_text(url: str, timeout: float = 3.0) -> tuple[int, str | None]:
    """GET url: (status, body as text); status 0 when nothing answered; no text for an error
    status."""
    status, raw, ok = _send(urllib.request.Request(url), timeout)
    return status, raw.decode("utf-8", "replace") if ok and raw is not None else None


def _send(request: urllib.request.Request, timeout: float) -> tuple[int, bytes | None, bool]:
    """(status, body, whether the status was a success); (0, None, False) when nothing
    answered (refused, reset, timed out)."""
    try:
        with _OPENER.open(request, timeout=timeout) as response:
            return response.status, response.read(), True
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), False
    except (OSError, ValueError):
        return 0, None, False


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


def server_info(url: str) -> dict:
    status, info = http_json("GET", url + "/get_server_info", timeout=5.0)
    if status != 200 or not isinstance(info, dict):
        raise GateFailed(f"GET {url}/get_server_info answered {status or 'nothing'}")
    for key in ("max_total_num_tokens", "processes"):
        if key not in info:
            raise GateFailed(f"GET {url}/get_server_info has no {key!r}: the engine does not "
                             "follow the replica contract (docs/contracts.md)")
    return info


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
