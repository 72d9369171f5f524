"""A loopback HTTP server whose every answer a test chooses, recording what it was sent: for
the launcher's calls to a router or a replica where the real one would be beside the point."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Callable

# (method, path, Authorization header, body) -> (status, response body)
Answer = Callable[[str, str, str | None, bytes], tuple[int, bytes]]


class StubHttp:
    def __init__(self, answer: Answer) -> None:
        seen = self.seen = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length", 0))
                request = (self.command, self.path, self.headers.get("Authorization"),
                           self.rfile.read(length))
                seen.append(request)
                status, body = answer(*request)
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_PUT = do_POST = do_DELETE = _answer

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)
