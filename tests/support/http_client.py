"""The one HTTP client of the tests, for loopback servers: blocking requests (urllib, never
via a proxy) and, inside a test's event loop, `fetch` on an aiohttp session from `client()`.

Every helper answers (status, headers, body). The blocking ones give status 0 when there was no
HTTP answer at all (refused, reset, timed out); a body cut off mid-transfer still raises
(urllib's ValueError or http.client.HTTPException), for the tests that expect exactly that.
`fetch` raises aiohttp's errors as they come: the router tests assert on them.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import aiohttp

# No proxy may see loopback requests (nor turn a refused connection into a proxy's 502).
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def request(method: str, url: str, body=None, *, headers: dict[str, str] | None = None,
            timeout: float = 30.0) -> tuple[int, dict[str, str], bytes]:
    """One request; `body` is sent as is when bytes, as JSON when anything else but None."""
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with _OPENER.open(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()
    except OSError:  # refused, reset, timed out (URLError is an OSError too)
        return 0, {}, b""


def get(url: str, timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    return request("GET", url, timeout=timeout)


def post_json(url: str, body, timeout: float = 120.0) -> tuple[int, dict[str, str], bytes]:
    return request("POST", url, body, timeout=timeout)


def speech(base_url: str, text: str = "Hello there.",
           timeout: float = 30.0) -> tuple[int, dict[str, str], bytes]:
    """POST /v1/audio/speech with just an input text."""
    return post_json(base_url + "/v1/audio/speech", {"input": text}, timeout=timeout)


def is_wav(body: bytes) -> bool:
    return len(body) > 44 and body[:4] == b"RIFF" and body[8:12] == b"WAVE"


# --- inside an event loop -------------------------------------------------------------------


def client(**kwargs) -> aiohttp.ClientSession:
    """An aiohttp session, bounded to 10 s a request unless told otherwise."""
    kwargs.setdefault("timeout", aiohttp.ClientTimeout(total=10))
    return aiohttp.ClientSession(**kwargs)


async def fetch(session: aiohttp.ClientSession, method: str, url: str, **kwargs):
    """(status, headers, body) of one request, the body read whole."""
    async with session.request(method, url, **kwargs) as resp:
        return resp.status, resp.headers, await resp.read()
