"""The launcher's and the supervisor's blocking HTTP calls: whatever answers on the port, a call
returns an Answer — never raises — so a gate polling a replica's /health reads "no answer" and
goes on polling, instead of ending `launch` in a traceback."""

from __future__ import annotations

import socket
import threading

import pytest

from omni_dp.blocking_http import call, http_json


@pytest.fixture
def not_http():
    """A loopback server that answers every connection with a line that is not HTTP (as another
    process's request line did, a port reused between two tests), then closes it."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)  # the loop looks at `stop` this often
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.recv(4096)
                conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    server.close()
    thread.join(10)


def test_an_answer_that_is_not_http_is_no_answer_with_its_reason(not_http):
    answer = call("GET", not_http + "/health", timeout=5)
    assert answer.status == 0
    assert "not an HTTP answer" in answer.error and "BadStatusLine" in answer.error
    assert http_json("GET", not_http + "/health", timeout=5) == (0, None)
