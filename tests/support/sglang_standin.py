"""A stand-in for an sglang server's HTTP answers, for read-back tests that need no GPU.

Shapes as sglang 0.5.22 builds them (srt/entrypoints/http_server.py, srt/utils/common.py
build_server_info): /server_info is the resolved server args (among them the *requested*
`max_total_tokens`), the launch command, then the scheduler's start-up info with the *allocated*
`max_total_num_tokens`, then `internal_states`, `version`, `frontend`. /get_server_info is the
deprecated name of the same answer. An unknown path gets FastAPI's 404.
"""

from __future__ import annotations

import json

from support.stub_http import StubHttp

NOT_FOUND = (404, {"detail": "Not Found"})


def server_info(allocated: int | None, requested: int | None = None) -> dict:
    """/server_info's answer; `allocated` None leaves the scheduler's field out."""
    info: dict = {
        "model_path": "/models/m", "host": "127.0.0.1", "port": 30000,
        "max_total_tokens": requested, "mem_fraction_static": 0.273, "page_size": 1,
        "dp_size": 1, "tp_size": 1,
        "launch_command": "python -m sglang.launch_server --model-path /models/m",
        "status": "ready", "max_req_input_len": 8186, "startup_time": 1764590000.0,
        "kv_events": None,
        "internal_states": [{"last_gen_throughput": 0.0, "memory_usage": {"kvcache": 12.2}}],
        "version": "0.5.22", "frontend": "python",
    }
    if allocated is not None:
        info["max_total_num_tokens"] = allocated
    return info


class SglangStandin:
    """Answers `routes` (path → (status, JSON-able body or raw bytes)); records every request
    in `seen` as (method, path)."""

    def __init__(self, routes: dict[str, tuple[int, object]]) -> None:
        self.routes = routes
        self.stub = StubHttp(self._answer)
        self.url = self.stub.url

    @property
    def seen(self) -> list[tuple[str, str]]:
        return [(method, path) for method, path, _, _ in self.stub.seen]

    def _answer(self, method: str, path: str, auth: str | None,
                body: bytes) -> tuple[int, bytes]:
        status, answer = self.routes.get(path, NOT_FOUND)
        raw = answer if isinstance(answer, bytes) else json.dumps(answer).encode()
        return status, raw

    def close(self) -> None:
        self.stub.close()
