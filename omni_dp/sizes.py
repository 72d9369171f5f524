"""Byte sizes as people write them (`2GiB`, `512MiB`, `1.5G`, `4096`).

Shared by the engine (KV budget), the MPS package (pinned memory limit) and the launcher (GPU
memory fit), so that `2GiB` means the same number everywhere.
"""

from __future__ import annotations

import re
from decimal import Decimal

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Return the number of bytes in `text`; raise ValueError with the accepted forms otherwise.

    Decimal units (`K`, `MB`, `G`) are powers of 1000 and binary units (`KiB`, `MiB`, `GiB`)
    powers of 1024, as in IEC 80000-13. A fractional result is rounded down to whole bytes.
    """
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must not be negative, got {text}")
        return text
    match = _SIZE_RE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"{text!r} is not a size; write a number of bytes with an optional unit, "
            "e.g. 4096, 512MiB, 2GiB or 1.5GB"
        )
    # Decimal, not float: 2.01K is 2010 bytes, not 2009.999… truncated to 2009.
    return int(Decimal(match.group(1)) * _UNITS[unit])


GiB = 1024**3


def format_size(num_bytes: int) -> str:
    """Render bytes with the largest binary unit that keeps the number >= 1 (`1.50 GiB`)."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"
