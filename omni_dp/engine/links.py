"""The links between the stage processes of one replica: pyzmq PUSH → PULL over ipc://.

Each process binds one Inbox (a PULL socket) at `endpoint(directory, its name)`, in a private
directory of the replica's (`socket_dir`); every process sends through one Outbox, which
connects a PUSH socket per (thread, destination) on first use. Messages are wire.encode frames.

Ordering, which the pipeline relies on: the messages of ONE sending thread to one endpoint
arrive in the order sent (one socket, one pipe). Messages of different threads or processes to
the same endpoint are fair-queued: each sender's order is kept, there is none between senders.

Nothing here blocks or drops a message: the send high-water mark is 0 (no limit), so a slow
receiver cannot stall the sender (the talker's step loop must never wait on a vocoder's queue),
and messages sent before the receiver bound are kept and delivered once it has (connects are
not `immediate`). The bound is memory: what is queued is what the receiver has not read yet,
which the talker's running batch caps (one StepOutputs per step, a bounded set of requests).
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import tempfile
import threading
from pathlib import Path

import zmq

from omni_dp.engine import wire

IPC_PATH_MAX = 107  # bytes: Linux's sun_path is 108 with its terminating NUL
SEND_LINGER_S = 1.0  # how long a closed Outbox socket still tries to deliver what it queued


def socket_dir(prefix: str = "omni-dp-stages-") -> Path:
    """A fresh directory for one replica's sockets, mode 0700: only its own user can connect.
    The caller removes it (shutil.rmtree) when the replica stops."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    path.chmod(0o700)  # mkdtemp's mode already; said again, since the socket's safety rests on it
    return path


def endpoint(directory: str | os.PathLike[str], process_name: str) -> str:
    """`ipc://<directory>/<process_name>.sock`, the directory made absolute (the processes may
    not share a working directory); ValueError when the path is too long for a unix socket."""
    if not process_name or "/" in process_name or "\0" in process_name:
        raise ValueError(f"process name {process_name!r}: not usable as a socket file name")
    path = Path(directory).absolute() / f"{process_name}.sock"
    size = len(os.fsencode(path))
    if size > IPC_PATH_MAX:
        raise ValueError(f"ipc socket path {str(path)!r} is {size} bytes: a unix socket path has "
                         f"at most {IPC_PATH_MAX} bytes on Linux; use a shorter directory "
                         "(TMPDIR) or process name")
    return f"ipc://{path}"


def _ipc_path(endpoint_: str) -> str:
    if not endpoint_.startswith("ipc://"):
        raise ValueError(f"{endpoint_!r}: not an ipc:// endpoint")
    return endpoint_.removeprefix("ipc://")


class Inbox:
    """One process's receiving end: a PULL socket bound at its endpoint.

    Use it from one thread only (zmq sockets are not thread-safe): the thread that reads it.
    """

    def __init__(self, endpoint_: str) -> None:
        self.endpoint = endpoint_
        self._path = _ipc_path(endpoint_)
        _refuse_live_socket(self._path)
        sock = zmq.Context.instance().socket(zmq.PULL)
        try:
            sock.setsockopt(zmq.RCVHWM, 0)  # no limit, as on the sending side
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(endpoint_)  # (a stale file of a dead process is replaced by libzmq)
        except BaseException:
            sock.close(linger=0)
            raise
        self._sock: zmq.Socket | None = sock

    def recv(self, timeout_s: float | None = None) -> object | None:
        """The next message, or None when none came within `timeout_s` (None: wait for one).

        Its tensors are views of the received frames (zero-copy, see wire.decode). Frames that
        are not a message raise wire.WireError (the message is consumed; the next recv goes on).
        """
        sock = self._open()
        timeout_ms = None if timeout_s is None else max(0, math.ceil(timeout_s * 1000))
        if not sock.poll(timeout_ms, zmq.POLLIN):
            return None
        return wire.decode(sock.recv_multipart(copy=False))

    def close(self) -> None:
        """Close the socket at once (linger 0: what was not read is dropped) and remove its
        file, which libzmq leaves behind."""
        if self._sock is None:
            return
        self._sock.close(linger=0)
        self._sock = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path)

    def _open(self) -> zmq.Socket:
        if self._sock is None:
            raise RuntimeError(f"Inbox {self.endpoint} is closed")
        return self._sock

    def __enter__(self) -> Inbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _refuse_live_socket(path: str) -> None:
    """libzmq binds over an existing socket file without a word, taking the endpoint from a
    live process that still listens there: refuse that (a stale file of a dead one is fine)."""
    if not os.path.exists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        return  # nobody listens: stale
    finally:
        probe.close()
    raise ValueError(f"ipc://{path}: already bound by a live process")


class Outbox:
    """The sending end of one process: `send(endpoint, message)` from any of its threads.

    Each thread gets its own PUSH socket per endpoint (threading.local), made on its first send
    there and only ever used by that thread. Frames go with copy=False: a tensor or PCM frame of
    64 KiB or more is not copied by pyzmq, and must not be modified after the send.

    Sockets use zmq.Context.instance(). Closing one returns at once; zmq's I/O thread still
    delivers what it queued, for up to `linger_s`, as long as the process lives. To wait for
    that before exiting, terminate the context once every socket of it is closed:
    `zmq.Context.instance().destroy(linger=ms)` closes them all (the Inbox too) and waits.
    """

    def __init__(self, linger_s: float = SEND_LINGER_S) -> None:
        self._linger_ms = max(0, math.ceil(linger_s * 1000))
        self._local = threading.local()
        self._lock = threading.Lock()
        self._all: list[zmq.Socket] = []  # every thread's sockets, for close_all
        self._closed = False

    def send(self, endpoint_: str, message: object) -> None:
        """Encode `message` (wire.encode: WireError before anything is sent) and queue it for
        `endpoint_`. Never blocks and never drops, whether or not the receiver is up yet."""
        frames = wire.encode(message)
        if self._closed:
            raise RuntimeError("Outbox is closed")
        self._socket(endpoint_).send_multipart(frames, copy=False)

    def _socket(self, endpoint_: str) -> zmq.Socket:
        sockets: dict[str, zmq.Socket] | None = getattr(self._local, "sockets", None)
        if sockets is None:
            sockets = self._local.sockets = {}
        sock = sockets.get(endpoint_)
        if sock is None:
            _ipc_path(endpoint_)
            with self._lock:
                if self._closed:
                    raise RuntimeError("Outbox is closed")
                sock = zmq.Context.instance().socket(zmq.PUSH)
                sock.setsockopt(zmq.SNDHWM, 0)  # never block, never drop (see the module)
                sock.setsockopt(zmq.LINGER, self._linger_ms)
                sock.connect(endpoint_)
                self._all.append(sock)
            sockets[endpoint_] = sock
        return sock

    def close(self) -> None:
        """Close the calling thread's sockets (a thread that stops sending for good)."""
        sockets: dict[str, zmq.Socket] = getattr(self._local, "sockets", {})
        with self._lock:
            for sock in sockets.values():
                sock.close()
                self._all.remove(sock)
        sockets.clear()

    def close_all(self) -> None:
        """Close every thread's sockets, at process exit: call it once the sending threads
        have stopped (a socket must not be closed while its thread uses it). Later sends fail."""
        with self._lock:
            self._closed = True
            for sock in self._all:
                sock.close()
            self._all.clear()
