"""Loopback ports that were free a moment ago, and whether one is free or listened on.

"Free" means what the launcher and the servers mean (omni_dp.net): bindable with SO_REUSEADDR,
so a port in TIME_WAIT counts as free, and nothing accepts connections on it.

Under pytest-xdist each worker takes its ports from a band of its own, below the kernel's
ephemeral range: a port one worker found free is then never handed to another worker's test
between the check and the bind (bind to port 0 gives both workers the same range to race in).
"""

from __future__ import annotations

import collections
import os
import random
import socket

LOOPBACK = "127.0.0.1"
# The workers' bands share 12000-32767, below Linux's default ephemeral range (32768-60999) where
# the kernel puts outgoing connections and every bind to port 0: 2 workers get 10000 ports each.
BANDS = range(12000, 32768)
# Ports this process handed out lately: a test may take several before anything binds them.
_handed: collections.deque[int] = collections.deque(maxlen=512)


def worker_band() -> range | None:
    """This pytest-xdist worker's own ports, or None outside xdist."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "").removeprefix("gw")  # "gw0", "gw1", ...
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not (worker.isdigit() and workers.isdigit()):
        return None
    width = len(BANDS) // int(workers)
    start = BANDS.start + int(worker) * width
    return range(start, start + width)


def free_ports(n: int) -> list[int]:
    """n distinct loopback ports that were free a moment ago."""
    band = worker_band()
    if band is not None:
        return _free_in(band, n)
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


def _free_in(band: range, n: int) -> list[int]:
    picked: list[int] = []
    for port in random.sample(band, len(band)):
        if port not in _handed and port_free(port):
            picked.append(port)
            if len(picked) == n:
                _handed.extend(picked)
                return picked
    raise RuntimeError(f"no {n} free loopback ports in {band.start}-{band.stop - 1}")


def free_port() -> int:
    """One loopback port that was free a moment ago."""
    return free_ports(1)[0]


def free_port_block(n: int, avoid: tuple[int, ...] = (), attempts: int = 200) -> int:
    """A base port such that base .. base+n-1 are all free on loopback (and not in avoid)."""
    band = worker_band()
    for _ in range(attempts):
        base = random.randrange(band.start, band.stop - n) if band is not None else free_port()
        if base + n - 1 > 65535:
            continue
        block = range(base, base + n)
        if any(p in avoid or (band is not None and p in _handed) for p in block):
            continue
        if all(port_free(p) for p in block):
            if band is not None:
                _handed.extend(block)
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
