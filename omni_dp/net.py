"""Listening sockets: binding one, and asking whether a port or host can be bound.

Every server of omni-dp (replica, router) binds before it loads anything, so a taken port is a
usage error; the launcher asks the same question, with the same SO_REUSEADDR (a port in
TIME_WAIT is free), before it starts anything.
"""

from __future__ import annotations

import errno
import socket


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def bind_listening(host: str, port: int, *, backlog: int, reuse_port: bool = False
                   ) -> socket.socket:
    """A bound, listening, non-blocking socket; the OSError of a failed bind propagates."""
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def port_taken(host: str, port: int) -> bool:
    """Is host:port bound by someone now? An address that is not usable, or a port out of
    range, is not "taken": the callers' own checks name those."""
    if not 0 < port < 65536:
        return False
    with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except (socket.gaierror, ValueError):  # ValueError: a name idna cannot encode
            return False
        except OSError as exc:
            return exc.errno in (errno.EADDRINUSE, errno.EACCES)
    return False


def bind_error(host: str) -> str | None:
    """Why nothing can listen on host (None if it can)."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, 0))
        except (OSError, ValueError) as exc:  # ValueError: too long, or a NUL in it
            return str(getattr(exc, "strerror", None) or exc)
    return None
