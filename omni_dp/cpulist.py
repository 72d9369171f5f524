"""Linux's CPU list syntax (`0-3,8,10-11`), read and written: what /sys, taskset and the
affinity of a process use, and what omni-dp records and passes to its pin wrapper."""

from __future__ import annotations

import re

_RANGE = re.compile(r"^([0-9]+)(?:-([0-9]+))?$")
MAX_CPUS = 1 << 16  # Linux's NR_CPUS is at most 8192


def parse_cpu_list(text: str) -> list[int]:
    """Linux cpulist syntax: `0-3,8,10-11` → [0, 1, 2, 3, 8, 10, 11]; ValueError if malformed."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        match = _RANGE.match(part.strip())
        if match is None:
            raise ValueError(f"{text.strip()!r} is not a CPU list like 0-3,8,10-11")
        low = int(match.group(1))
        high = int(match.group(2) or low)
        if high < low:
            raise ValueError(f"CPU range {part.strip()!r} runs backwards")
        if high >= MAX_CPUS:  # checked before the range is made: 0-99999999999 fills memory
            raise ValueError(f"CPU {high} is beyond any machine's CPUs (Linux numbers at most "
                             f"{MAX_CPUS})")
        cpus.extend(range(low, high + 1))
    return sorted(set(cpus))


def format_cpu_list(cpus) -> str:
    """[0, 1, 2, 3, 8] → `0-3,8`."""
    ordered = sorted(cpus)
    parts, start = [], None
    for i, cpu in enumerate(ordered):
        if start is None:
            start = cpu
        if i + 1 == len(ordered) or ordered[i + 1] != cpu + 1:
            parts.append(str(start) if start == cpu else f"{start}-{cpu}")
            start = None
    return ",".join(parts)
