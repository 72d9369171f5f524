"""The replica contract as the launcher reads it (docs/contracts.md): `/get_server_info`, and the
error a replica that does not pass a gate raises, whichever engine serves it."""

from __future__ import annotations

from omni_dp.blocking_http import http_json


class GateFailed(Exception):
    """A replica did not pass a gate; the message says which and why (with its log tail)."""


def server_info(url: str) -> dict:
    status, info = http_json("GET", url + "/get_server_info", timeout=5.0)
    if status != 200 or not isinstance(info, dict):
        raise GateFailed(f"GET {url}/get_server_info answered {status or 'nothing'}")
    for key in ("max_total_num_tokens", "processes"):
        if key not in info:
            raise GateFailed(f"GET {url}/get_server_info has no {key!r}: the engine does not "
                             "follow the replica contract (docs/contracts.md)")
    return info
