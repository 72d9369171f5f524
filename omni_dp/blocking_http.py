"""Blocking HTTP calls from plain threads: the launcher's and the supervisor's to replicas and
routers (a handful a second), and the fleet-gateway registration's.

Blocking urllib on purpose: these callers need no event loop for a few calls, and none of them
goes through a proxy. `call` keeps an error answer's text (a gateway that refuses says why in
it); `http_json` and `http_text` are the short forms the gates use.
"""

from __future__ import annotations

import http.client
import json
import socket
import urllib.error
import urllib.request
from dataclasses import dataclass

# Straight to the peer: an http_proxy meant for the outside world must never see (or answer for)
# calls to a replica, a router on loopback or a gateway on the cluster's network.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
_WORDS_MAX = 400  # characters of an answer quoted in a message


@dataclass(frozen=True)
class Answer:
    """status 0: nothing answered, `error` says why; `body` is the parsed JSON or None."""

    status: int
    body: object
    text: str
    error: str = ""

    def words(self) -> str:
        """What the peer said, for a message: its JSON error/message, else the text."""
        if isinstance(self.body, dict):
            said = [str(self.body[k]) for k in ("error", "message", "detail") if self.body.get(k)]
            if said:
                code = self.body.get("code")
                return "; ".join(said) + (f" ({code})" if code else "")
        text = self.text.strip()
        if not text:
            return "no explanation"
        return text if len(text) <= _WORDS_MAX else text[:_WORDS_MAX] + "..."


def call(method: str, url: str, body: object = None, *, timeout: float,
         headers: dict[str, str] | None = None) -> Answer:
    """One request; JSON in and out."""
    data = json.dumps(body).encode() if body is not None else None
    sent = {"Accept": "application/json",
            **({"Content-Type": "application/json"} if data is not None else {}),
            **(headers or {})}
    request = urllib.request.Request(url, data=data, method=method, headers=sent)
    try:
        with _OPENER.open(request, timeout=timeout) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    except urllib.error.URLError as exc:
        return Answer(0, None, "", _reason(exc.reason))
    except (OSError, ValueError) as exc:  # reset, timed out mid-answer; a malformed URL
        return Answer(0, None, "", _reason(exc))
    except http.client.HTTPException as exc:  # something not HTTP on the port, or cut short
        return Answer(0, None, "", f"not an HTTP answer ({type(exc).__name__}: {exc})")
    text = raw.decode("utf-8", "replace")
    try:
        parsed = json.loads(text) if text else None
    except ValueError:
        parsed = None
    return Answer(status, parsed, text)


def _reason(exc: object) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, socket.gaierror):
        return f"unknown host ({exc.strerror or exc})"
    return str(getattr(exc, "strerror", None) or exc)


def http_json(method: str, url: str, body: dict | None = None, timeout: float = 3.0,
              headers: dict[str, str] | None = None) -> tuple[int, dict | None]:
    """(status, parsed JSON body or None); status 0 when nothing answered."""
    answer = call(method, url, body, timeout=timeout, headers=headers)
    return answer.status, answer.body if isinstance(answer.body, (dict, list)) else None


def http_text(url: str, timeout: float = 3.0) -> tuple[int, str | None]:
    """GET url: (status, body as text); status 0 when nothing answered; no text for an error
    status."""
    answer = call("GET", url, timeout=timeout, headers={"Accept": "*/*"})
    return answer.status, answer.text if 200 <= answer.status < 300 else None
