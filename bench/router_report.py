"""The router benchmark's results: one RunResult per (target, scenario, repetition), the
summary by scenario and target, the goals read from it, and the markdown recorded in
bench/results/router.md (between generated markers; what is written around them by hand stays).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from router_targets import EVENTS, PACE_S

GEN_START, GEN_END = "<!-- router_overhead.py: generated -->", "<!-- end generated -->"

@dataclass
class RunResult:
    scenario: str
    concurrency: int
    target: str
    repetition: int
    requests: int
    errors: int
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    cpu_ms_per_req: float
    ttfb_ms: float | None = None  # paced-ttfb only: median time to the first body byte
    stream_ms: float | None = None  # paced-ttfb only: median time to the end of the stream


@dataclass(frozen=True)
class Scenario:
    name: str  # json, sse, paced-ttfb
    concurrency: int

    @property
    def key(self) -> str:
        return f"{self.name} c={self.concurrency}"


SCENARIOS = [Scenario("json", 1), Scenario("json", 32), Scenario("sse", 1), Scenario("sse", 32),
             Scenario("paced-ttfb", 1)]


LABELS = {
    "direct": "direct (one backend)",
    "omni-w1": "omni-dp --workers 1",
    "omni-w2": "omni-dp --workers 2",
    "omni-w1-info": "omni-dp --workers 1, log info",
    "sglang": "sglang-router",
}


def _fmt(values: list[float], digits: int) -> str:
    return " / ".join(f"{v:.{digits}f}" for v in values)


def _median(results: list[RunResult], attr: str) -> float:
    return statistics.median(getattr(r, attr) for r in results)


def summarise(results: list[RunResult], targets: list[str]) -> dict:
    """Per (scenario key, target): the runs, in repetition order."""
    table: dict[str, dict[str, list[RunResult]]] = {}
    for r in results:
        key = f"{r.scenario} c={r.concurrency}"
        table.setdefault(key, {}).setdefault(r.target, []).append(r)
    return {k: {t: sorted(v[t], key=lambda r: r.repetition) for t in targets if t in v}
            for k, v in table.items()}


def goals(summary: dict) -> list[str]:
    lines = []
    cpu_rows = [(key, t, _median(summary[key][t], "cpu_ms_per_req"))
                for key in ("json c=1", "json c=32") if key in summary
                for t in ("omni-w1", "omni-w2") if t in summary[key]]
    if cpu_rows:
        worst = max(c for *_, c in cpu_rows)
        detail = "; ".join(f"{LABELS[t]} {key}: {c:.3f}" for key, t, c in cpu_rows)
        sgl = [f"sglang-router {key}: {_median(summary[key]['sglang'], 'cpu_ms_per_req'):.3f}"
               for key in ("json c=1", "json c=32") if "sglang" in summary.get(key, {})]
        lines.append(
            f"- **Router CPU ≤ 0.15 ms per small request: {'MET' if worst <= 0.15 else 'NOT MET'}"
            f"** (median ms/req — {detail}{'; for comparison ' + '; '.join(sgl) if sgl else ''})."
        )
    paced = summary.get("paced-ttfb c=1", {})
    if "direct" in paced:
        parts, ok = [], True
        for t in ("omni-w1", "omni-w2", "sglang"):
            if t not in paced:
                continue
            over = [r.ttfb_ms - d.ttfb_ms for r, d in zip(paced[t], paced["direct"], strict=False)]
            over_med = statistics.median(over)
            if t != "sglang":
                ok = ok and over_med <= 1.0
            parts.append(f"{LABELS[t]} +{_fmt(over, 2)} ms")
        direct = _fmt([r.ttfb_ms for r in paced["direct"]], 2)
        lines.append(
            f"- **Streamed TTFB overhead ≤ 1 ms (omni-dp): {'MET' if ok else 'NOT MET'}** "
            f"(direct {direct} ms; overhead per repetition: {'; '.join(parts)})."
        )
    rows = []
    for key in ("json c=1", "json c=32", "sse c=1", "sse c=32"):
        cell = summary.get(key, {})
        if "omni-w2" in cell and "sglang" in cell:
            w2, sg = _median(cell["omni-w2"], "requests_per_s"), _median(cell["sglang"],
                                                                         "requests_per_s")
            rows.append((key, w2, sg))
    if rows:
        met = [k for k, w2, sg in rows if w2 >= sg]
        missed = [k for k, w2, sg in rows if w2 < sg]
        detail = "; ".join(f"{k}: {w2:.0f} vs {sg:.0f} req/s" for k, w2, sg in rows)
        verdict = "MET" if not missed else ("NOT MET" if not met else "PARTLY MET")
        lines.append(
            f"- **`--workers 2` throughput ≥ sglang-router's: {verdict}** (medians, omni-dp "
            f"--workers 2 vs sglang-router — {detail}"
            + (f"; met for {', '.join(met)}, missed for {', '.join(missed)}" if missed and met
               else "") + ")."
        )
    elif summary:
        lines.append("- **`--workers 2` throughput ≥ sglang-router's: not evaluated** "
                     "(sglang-router was not measured in this run).")
    return lines


HOW_TO_READ = """\
How to read: every target runs on this same 2-core machine as the two backends and the load
generator, so req/s at c=32 is mostly a measure of who gets the CPU and swings between runs;
compare **CPU ms/req** (Δ user+system of the hop's process tree ÷ requests; for "direct" it is
the backend's own cost, i.e. what one extra aiohttp hop roughly costs) and the **TTFB** rows.
Values separated by "/" are the repetitions, in order; runs were interleaved (target order
rotated per scenario and repetition). "log info" is `--workers 1` with the per-request JSON route
line written to stderr (a file here), to show what that line costs. sglang-router's unpaced
SSE at c=1 and its TTFB are dominated by a ~40 ms delayed-ACK stall (it does not set TCP_NODELAY
on client sockets; see router-facts.md §4 in the project's shared notes), not by CPU."""


def markdown(summary: dict, header: dict, goal_lines: list[str]) -> str:
    lines = [
        f"### {header['date']} — {header['machine']}",
        "",
        f"Python {header['python']} · aiohttp {header['aiohttp']} · uvloop {header['uvloop']} "
        f"(routers and backends use it) · load generator: {header['loadgen']} · "
        f"{header['duration']:g} s per run · {header['repetitions']} repetitions · "
        f"TTFB: median of {header['ttfb_requests']} paced requests (aiohttp client, first body "
        "byte)",
        "",
        "Targets:",
        "",
    ]
    for name, command in header["targets"].items():
        lines.append(f"- {LABELS.get(name, name)}: `{command}`")
    for name, why in header["skipped"].items():
        lines.append(f"- {LABELS.get(name, name)}: **not measured** — {why}")
    lines += ["", "| load | conc | target | req/s | p50 ms | p99 ms | CPU ms/req | errors |",
              "|---|---:|---|---|---:|---:|---|---:|"]
    for key, cells in summary.items():
        if key.startswith("paced"):
            continue
        name, conc = key.split(" c=")
        for target, runs in cells.items():
            lines.append(
                f"| {name} | {conc} | {LABELS.get(target, target)} | "
                f"{_fmt([r.requests_per_s for r in runs], 0)} | "
                f"{_median(runs, 'p50_ms'):.2f} | {_median(runs, 'p99_ms'):.2f} | "
                f"{_fmt([r.cpu_ms_per_req for r in runs], 3)} | {sum(r.errors for r in runs)} |"
            )
    paced = summary.get("paced-ttfb c=1")
    if paced:
        lines += ["", f"Streamed TTFB: {EVENTS} SSE events {PACE_S * 1000:g} ms apart, "
                  "concurrency 1, one keep-alive connection.", "",
                  "| target | TTFB ms (median) | overhead vs direct ms | stream ms (median) "
                  "| CPU ms/req (schedstat) |", "|---|---|---|---:|---|"]
        direct = paced.get("direct")
        for target, runs in paced.items():
            over = ("—" if direct is None or target == "direct" else _fmt(
                [r.ttfb_ms - d.ttfb_ms for r, d in zip(runs, direct, strict=False)], 2))
            lines.append(
                f"| {LABELS.get(target, target)} | {_fmt([r.ttfb_ms for r in runs], 2)} | "
                f"{over} | {_median(runs, 'stream_ms'):.1f} | "
                f"{_fmt([r.cpu_ms_per_req for r in runs], 3)} |"
            )
    lines += ["", "Goals (from the issue):", "", *goal_lines, "", HOW_TO_READ]
    return "\n".join(lines) + "\n"


def record(path: Path, text: str) -> None:
    """Replace the generated block; keep whatever was written around it by hand."""
    block = f"{GEN_START}\n{text}{GEN_END}\n"
    if path.exists():
        old = path.read_text()
        if GEN_START in old and GEN_END in old:
            head, rest = old.split(GEN_START, 1)
            tail = rest.split(GEN_END, 1)[1].lstrip("\n")
            path.write_text(head + block + ("\n" + tail if tail else ""))
            return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("# Router overhead: loopback, 2 trivial backends\n\n"
                    "Reproduce: `.venv/bin/python bench/router_overhead.py --record "
                    f"{path}`\n\n{block}")
