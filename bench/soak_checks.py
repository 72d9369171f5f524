"""The soak's invariants (bench/soak.py): pure functions over what the load, the nemesis and the
sampler recorded — tests call them on records made by hand. Each gives a Verdict.

1. answers: every request answered whole and right, or refused with a clear status (429/503
   with Retry-After) before any byte, or cut with an error (a broken body, an SSE error event:
   the voice is not resumable); never a wrong answer, a cut without an error, another status.
   A request the router could not take at all (connection refused or dropped before a status)
   only while a router-kill fault has the router down: failed between the fault's start and
   the run whole again (+ SLACK_S).
2. bounds: no request took longer than its class's bound.
3. whole: the run whole again after every fault (soak_run.RunView.problems), within the bound.
4. commands: every day-two command (restart, scale) exited 0 within the bound, and every fault
   could be struck.
5. flat: each role's RSS, open descriptors and threads (every process of the role summed),
   sampled while no fault was going on: the median of its last samples no more than that of
   its first after warm-up, plus the tolerance.
6. down: `omni-dp down` exited 0 and left no process, port or file.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from soak_load import CUT, OK, OUTCOMES, REFUSED, TIMEOUT, UNREACHABLE

SLACK_S = 2.0
MiB = 1 << 20


@dataclass
class Verdict:
    name: str
    ok: bool
    detail: str


@dataclass(frozen=True)
class Tolerance:
    rss_fraction: float = 0.25
    rss_bytes: int = 32 * MiB
    fds: int = 16
    threads: int = 8

    def describe(self) -> str:
        return (f"RSS +{self.rss_fraction:.0%} + {self.rss_bytes // MiB} MiB, "
                f"+{self.fds} descriptors, +{self.threads} threads")


def by_outcome(done) -> dict[str, dict[str, int]]:
    """Requests per class, by outcome (every outcome named, zeros too)."""
    table: dict[str, dict[str, int]] = {}
    for d in done:
        row = table.setdefault(d.cls, dict.fromkeys(OUTCOMES, 0))
        row[d.outcome] += 1
    return table


def router_down(faults, bound: float) -> list[tuple[float, float]]:
    """When a router fault may have had the router unreachable."""
    return [(f.at, f.at + (f.whole_s if f.whole_s is not None else bound) + SLACK_S)
            for f in faults if f.kind == "router-kill"]


def answers(done, faults, bound: float) -> Verdict:
    windows = router_down(faults, bound)
    bad = []
    for d in done:
        if d.outcome in (OK, REFUSED, CUT):
            continue
        if d.outcome == UNREACHABLE and any(a <= d.end <= b for a, b in windows):
            continue
        bad.append(d)
    detail = "; ".join(f"{d.cls} {d.form} at {d.start:.1f} s: {d.outcome} {d.status or ''} "
                       f"{d.detail[:120]}".strip() for d in bad[:8])
    cut = [d for d in done if d.outcome == CUT]
    by_router = sum(any(a <= d.end <= b for a, b in windows) for d in cut)
    return Verdict("answers", not bad, detail or
                   f"{len(done)} requests: each ok, refused with Retry-After, cut with an error "
                   f"or (router down) unreachable; of the {len(cut)} cut, {by_router} while a "
                   "router fault had the router down")


def bounds(done, limits: dict[str, float]) -> Verdict:
    over = [d for d in done if d.outcome == TIMEOUT or d.seconds > limits[d.cls]]
    detail = "; ".join(f"{d.cls} {d.form} at {d.start:.1f} s took {d.seconds:.1f} s "
                       f"(bound {limits[d.cls]:g})" for d in over[:8])
    return Verdict("bounds", not over, detail or "every request within its class's bound ("
                   + ", ".join(f"{c} {b:g} s" for c, b in limits.items()) + ")")


def whole(faults, bound: float) -> Verdict:
    broken = [f for f in faults if f.whole_s is None or f.whole_s > bound]
    detail = "; ".join(f"fault {f.number} {f.kind}: {'; '.join(f.problems)[:300]}"
                       for f in broken[:5])
    return Verdict("whole", bool(faults) and not broken, detail or (
        f"after each of {len(faults)} faults, within {bound:g} s" if faults else "no fault"))


def commands(faults) -> Verdict:
    failed = [f for f in faults if f.rc not in (None, 0)]
    return Verdict("commands", not failed, "; ".join(
        f"fault {f.number} {f.kind}: {f.detail[:300]}" for f in failed)
        or "every restart and scale exited 0 (and every fault could be struck)")


def coverage(faults, kinds: list[str]) -> Verdict:
    seen = {f.kind for f in faults}
    overlaps = {f.number for f in faults if f.overlap}
    missing = [k for k in kinds if k not in seen]
    return Verdict("coverage", not missing and bool(overlaps),
                   f"missing {missing}" if missing else
                   f"{len(kinds)} kinds, {len(overlaps)} overlap(s)" if overlaps else
                   "no overlap")


def quiet(faults, end: float) -> list[tuple[float, float]]:
    """When no fault was in progress: between an event's last fault whole again and the next
    event's first strike (an event never whole: busy to the end)."""
    events: dict[int, tuple[float, float]] = {}
    for f in faults:
        until = end if f.whole_s is None else f.at + f.whole_s
        a, b = events.get(f.number, (f.at, until))
        events[f.number] = (min(a, f.at), max(b, until))
    spans, t = [], 0.0
    for a, b in sorted(events.values()):
        if a > t:
            spans.append((t, a))
        t = max(t, b)
    if t < end:
        spans.append((t, end))
    return spans


def drift(samples, roles: list[str], warmup: float, count: int, tolerance: Tolerance,
          spans: list[tuple[float, float]] | None = None) -> list[dict]:
    """Per role: the medians of its first `count` quiet samples after warm-up and of its last
    `count` (quiet: in `spans`, the run whole and no fault going on — a restart's cold
    process is no baseline), the peak over all, how many processes the role went through,
    and whether it stayed within the tolerance."""
    rows = []
    for role in roles:
        mine = [s for s in samples if s.role == role]
        calm = [s for s in mine if s.t >= warmup
                and (spans is None or any(a <= s.t <= b for a, b in spans))]
        row: dict = {"role": role, "samples": len(calm),
                     "processes": len({s.pids[0] for s in mine})}
        if len(calm) < 2 * count:
            row["judged"] = False
            rows.append(row)
            continue
        first, last = calm[:count], calm[-count:]
        for name in ("rss", "fds", "threads"):
            row[name] = (statistics.median(getattr(s, name) for s in first),
                         statistics.median(getattr(s, name) for s in last),
                         max(getattr(s, name) for s in mine))
        rss0, rss1, _ = row["rss"]
        row["judged"] = True
        row["ok"] = (rss1 <= rss0 * (1 + tolerance.rss_fraction) + tolerance.rss_bytes
                     and row["fds"][1] <= row["fds"][0] + tolerance.fds
                     and row["threads"][1] <= row["threads"][0] + tolerance.threads)
        rows.append(row)
    return rows


def flat(rows: list[dict], tolerance: Tolerance) -> Verdict:
    judged = [r for r in rows if r["judged"]]
    grown = [r for r in judged if not r["ok"]]
    detail = "; ".join(
        f"{r['role']}: RSS {r['rss'][0] / MiB:.0f} → {r['rss'][1] / MiB:.0f} MiB, fds "
        f"{r['fds'][0]:g} → {r['fds'][1]:g}, threads {r['threads'][0]:g} → {r['threads'][1]:g}"
        for r in grown)
    unjudged = [r["role"] for r in rows if not r["judged"]]
    return Verdict("flat", bool(judged) and not grown and not unjudged, detail or (
        f"{len(judged)} roles within {tolerance.describe()}"
        + (f"; too few samples to judge {unjudged}" if unjudged else "")))


def down(result: dict) -> Verdict:
    problems = []
    if result.get("down_rc") != 0:
        problems.append(f"down exit {result.get('down_rc')}: {str(result.get('down'))[:300]}")
    for name in ("left_behind", "ports_taken", "files_left"):
        if result.get(name):
            problems.append(f"{name.replace('_', ' ')}: {result[name]}")
    if result.get("run_dir_left"):
        problems.append("the run directory is still there")
    return Verdict("down", not problems, "; ".join(problems)
                   or "no process, port or file left")


def references(problems: list[str]) -> Verdict:
    return Verdict("references", not problems, "; ".join(problems[:4])
                   or "every ask answered twice before any fault")
