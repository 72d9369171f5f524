"""Test stand-ins for the workers a fleet gateway routes to: tiny aiohttp servers on loopback
that answer what the SGLang gateway probes when it registers one, and a tiny completion.

Not an omni-dp engine (the end-to-end test registers real replicas): only enough for the
gateway to take it (/health, /server_info, /get_server_info, /model_info, /get_model_info,
/v1/models) and to route to it (/v1/completions, counted). The info answers name no
`model_path` or `tokenizer_path`, as omni-dp's own do not: either would send the gateway off
to download a tokenizer from a model hub (see omni_dp/gateway/sglang.py).

Each runs its own event loop in a thread, because the gateway client under test blocks.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage

from support.ports import LOOPBACK

INFO_PATHS = ("/server_info", "/get_server_info", "/model_info", "/get_model_info")


class _DropPriProbes(logging.Filter):
    """The gateway opens two HTTP/2 prior-knowledge connections per registration (its gRPC
    detection); aiohttp refuses each with a 400 and logs a traceback. Counted, not logged."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, BadHttpMessage) and "PRI" in str(exc):
            self.count += 1
            return False
        return True


class GatewayWorkerStandin:
    """A stand-in worker: `healthy` decides /health (200 or 503) and may be flipped at any
    time; `hits` counts requests by path; `completions` counts /v1/completions answered."""

    def __init__(self, name: str = "standin", *, healthy: bool = True) -> None:
        self.name = name
        self.healthy = healthy
        self.hits: Counter[str] = Counter()
        self._probes = _DropPriProbes()
        self._logger = logging.getLogger(f"support.gateway_standin.{id(self)}")
        self._logger.addFilter(self._probes)
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._failed: BaseException | None = None
        self._runner: web.AppRunner | None = None
        self.port = 0
        self._thread = threading.Thread(target=self._serve, name=f"standin-{name}", daemon=True)
        self._thread.start()
        if not self._ready.wait(10) or self._failed is not None:
            self.close()
            raise RuntimeError(f"stand-in {name} did not start: {self._failed!r}")

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def completions(self) -> int:
        return self.hits["/v1/completions"]

    @property
    def http2_probes(self) -> int:
        return self._probes.count

    # --- the server ----------------------------------------------------------------------------
    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._start())
        except BaseException as exc:  # reported by __init__
            self._failed = exc
            self._ready.set()
            return
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())
        self._loop.close()

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._answer)
        self._runner = web.AppRunner(app, access_log=None, logger=self._logger,
                                     handle_signals=False)
        await self._runner.setup()
        await web.TCPSite(self._runner, LOOPBACK, 0).start()
        self.port = self._runner.addresses[0][1]

    async def _answer(self, request: web.Request) -> web.Response:
        path = request.path
        self.hits[path] += 1
        if path == "/health":
            return web.json_response({"status": "ready" if self.healthy else "starting"},
                                     status=200 if self.healthy else 503)
        if path in INFO_PATHS:
            return web.json_response({"served_model_name": self.name, "version": "standin"})
        if path == "/v1/models":
            return web.json_response({"object": "list", "data": [
                {"id": self.name, "object": "model", "owned_by": "standin"}]})
        if path == "/v1/completions" and request.method == "POST":
            body = await request.json()
            return web.json_response({
                "id": f"cmpl-{self.name}-{self.hits[path]}", "object": "text_completion",
                "model": body.get("model", self.name),
                "choices": [{"index": 0, "text": f" from {self.name}", "logprobs": None,
                             "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
            })
        return web.json_response({"detail": "Not Found"}, status=404)

    def close(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def __enter__(self) -> GatewayWorkerStandin:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
