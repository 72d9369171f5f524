"""The blocking HTTP calls to a gateway's control API (urllib, like omni_dp.launcher.bringup.gates).

Blocking on purpose: the launcher registers and deregisters from plain threads, a handful of
calls per replica. Unlike gates.http_json, an error answer keeps its text, because a gateway
that refuses says why in plain text or JSON, and that is what the person reading must see.
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from dataclasses import dataclass

# Straight to the gateway: an http_proxy meant for the outside world must not see (or answer
# for) calls to a gateway on the cluster's network, as for every other omni-dp HTTP call.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
_WORDS_MAX = 400  # characters of a gateway's answer quoted in a message


@dataclass(frozen=True)
class Answer:
    """status 0: nothing answered, `error` says why; `body` is the parsed JSON or None."""

    status: int
    body: object
    text: str
    error: str = ""

    def words(self) -> str:
        """What the gateway said, for a message: its JSON error/message, else the text."""
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
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json",
                                              "Accept": "application/json", **(headers or {})})
    try:
        with _OPENER.open(request, timeout=timeout) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    except urllib.error.URLError as exc:
        return Answer(0, None, "", _reason(exc.reason))
    except (OSError, ValueError) as exc:  # reset, timed out mid-answer; a malformed URL
        return Answer(0, None, "", _reason(exc))
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
