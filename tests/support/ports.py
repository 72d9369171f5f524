"""Loopback ports that were free a moment ago, and whether one is free or listened on.

"Free" means what the launcher and the servers mean (omni_dp.net): bindable with SO_REUSEADDR,
so a port in TIME_WAIT counts as free, and nothing accepts connections on it.
"""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"


def free_ports(n: int) -> list[int]:
    """n distinct loopback ports that were free a moment ago (bound to port 0 together)."""
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((LOOPBACK, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def free_port() -> int:
    """One loopback port that was free a moment ago."""
    return free_ports(1)[0]


def free_port_block(n: int, avoid: tuple[int, ...] = (), attempts: int = 200) -> int:
    """A base port such that base .. base+n-1 are all free on loopback (and not in avoid)."""
    for _ in range(attempts):
        base = free_port()
        if base + n - 1 > 65535:
            continue
        block = range(base, base + n)
        if any(p in avoid for p in block):
            continue
        if all(port_free(p) for p in block):
            return base
    raise RuntimeError(f"no block of {n} free loopback ports found")


def port_free(port: int) -> bool:
    """Nothing listens on 127.0.0.1:port and it can be bound."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((LOOPBACK, port))
        except OSError:
            return False
    return not port_listening(port)


def port_listening(port: int, timeout: float = 0.5) -> bool:
    """Something accepts connections on 127.0.0.1:port."""
    try:
        with socket.create_connection((LOOPBACK, port), timeout=timeout):
            return True
    except OSError:
        return False
