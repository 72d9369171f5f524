"""The soak's record (bench/soak.py): a markdown section and the resource curves as a PNG."""

from __future__ import annotations

import os
import platform
import statistics
import time
from pathlib import Path

from soak_checks import MiB
from soak_load import OUTCOMES


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def latency(done, limits: dict[str, float]) -> dict[str, dict]:
    """Per class, of the requests answered 200 and whole: p50, p99, max; and the bound."""
    table = {}
    for cls, bound in limits.items():
        secs = [d.seconds for d in done if d.cls == cls and d.outcome == "ok"]
        first = [d.first_byte for d in done if d.cls == cls and d.outcome == "ok"
                 and d.first_byte is not None]
        table[cls] = {"p50_s": round(percentile(secs, 0.5), 2),
                      "p99_s": round(percentile(secs, 0.99), 2),
                      "max_s": round(max(secs, default=0.0), 2),
                      "first_byte_p50_s": round(percentile(first, 0.5), 2),
                      "first_byte_p99_s": round(percentile(first, 0.99), 2), "bound_s": bound}
    return table


def plot(samples, faults, path: Path) -> None:
    """RSS, open descriptors and threads of each role over the run; a grey line per fault."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    roles = sorted({s.role for s in samples}, key=lambda r: (r.startswith("replica"), r))
    fig, axes = plt.subplots(3, 1, figsize=(8, 6.5), sharex=True)
    for ax, (name, scale, label) in zip(axes, (("rss", MiB, "RSS MiB"), ("fds", 1, "open fds"),
                                               ("threads", 1, "threads")), strict=True):
        for role in roles:
            mine = [s for s in samples if s.role == role]
            ax.plot([s.t / 60 for s in mine], [getattr(s, name) / scale for s in mine],
                    label=role, linewidth=1)
        for f in faults:
            ax.axvline(f.at / 60, color="0.8", linewidth=0.6, zorder=0)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, ncol=4, loc="upper left")
    axes[-1].set_xlabel("minutes (grey lines: faults)")
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)


def _cell(value) -> str:
    return "—" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def requests_table(result: dict) -> list[str]:
    seen = [o for o in OUTCOMES if any(row.get(o) for row in result["requests"].values())]
    lines = ["| class | requests | " + " | ".join(seen) + " | p50 s | p99 s | max s | "
             "first byte p50 / p99 s | bound s |",
             "|---|---:|" + "---:|" * len(seen) + "---:|---:|---:|---|---:|"]
    for cls, row in result["requests"].items():
        lat = result["latency"][cls]
        lines.append(f"| {cls} | {sum(row.values())} | "
                     + " | ".join(str(row[o]) for o in seen)
                     + f" | {lat['p50_s']} | {lat['p99_s']} | {lat['max_s']} | "
                       f"{lat['first_byte_p50_s']} / {lat['first_byte_p99_s']} | "
                       f"{lat['bound_s']:g} |")
    return lines


def faults_table(result: dict) -> list[str]:
    lines = ["| # | at min | fault | target | overlapping | its own s | whole again s | "
             "exit | note |", "|---:|---:|---|---|---|---:|---:|---:|---|"]
    for f in result["faults"]:
        note = (f["detail"] + ("; NOT WHOLE: " + "; ".join(f["problems"]) if f["problems"]
                               else "")).strip("; ")
        lines.append(f"| {f['number']} | {f['at'] / 60:.1f} | {f['kind']} | {f['target']} | "
                     f"{f['overlap'] or ''} | {_cell(f['action_s'])} | {_cell(f['whole_s'])} | "
                     f"{_cell(f['rc'])} | {note[:300]} |")
    return lines


def whole_by_kind(result: dict) -> list[str]:
    kinds: dict[str, list[float]] = {}
    for f in result["faults"]:
        if f["whole_s"] is not None:
            kinds.setdefault(f["kind"], []).append(f["whole_s"])
    return [f"{kind} {statistics.median(v):.1f} s (max {max(v):.1f}, {len(v)}×)"
            for kind, v in sorted(kinds.items())]


def drift_table(result: dict) -> list[str]:
    lines = ["| role | processes | RSS MiB first → last (peak) | fds first → last (peak) | "
             "threads first → last (peak) | within |", "|---|---:|---|---|---|---|"]
    for r in result["drift"]:
        if not r["judged"]:
            lines.append(f"| {r['role']} | {r['processes']} | too few samples | | | — |")
            continue
        rss = " → ".join(f"{v / MiB:.0f}" for v in r["rss"][:2]) + f" ({r['rss'][2] / MiB:.0f})"
        fds = " → ".join(f"{v:g}" for v in r["fds"][:2]) + f" ({r['fds'][2]:g})"
        thr = " → ".join(f"{v:g}" for v in r["threads"][:2]) + f" ({r['threads'][2]:g})"
        lines.append(f"| {r['role']} | {r['processes']} | {rss} | {fds} | {thr} | "
                     f"{'yes' if r['ok'] else 'NO'} |")
    return lines


def not_ok_table(result: dict, most: int = 40) -> list[str]:
    """Each request neither ok nor unreachable (the router down), with what its client got:
    a cut or a refusal is allowed, but each one is shown so it can be explained."""
    rows = result.get("not_ok") or []
    if not rows:
        return []
    return (["", f"Requests neither ok nor unreachable ({len(rows)}"
             + (f", the first {most}" if len(rows) > most else "") + "):", "",
             "| at s | class | form | outcome | status | replica | took s | detail |",
             "|---:|---|---|---|---:|---|---:|---|"]
            + [f"| {r['start']} | {r['cls']} | {r['form']} | {r['outcome']} | "
               f"{r['status'] or '—'} | {r['replica'] or '—'} | {r['took']} | "
               f"{r['detail'].replace('|', '/')} |" for r in rows[:most]])


def markdown(result: dict, png: str | None) -> str:
    run = result["run"]
    head = [f"### {time.strftime('%Y-%m-%d %H:%M', time.localtime(run['started']))} — "
            f"{run['engine']}, {run['replicas']} replicas, {run['duration_s'] / 60:.1f} min, "
            f"seed {run['seed']} — {'PASS' if result['ok'] else 'FAIL'}", "",
            f"`{run['command']}` on {os.cpu_count()} CPUs ({platform.machine()}), Python "
            f"{platform.python_version()}; engine arguments `{' '.join(run['engine_args'])}`, "
            f"model update to `{' '.join(run['update_args'])}` and back; launch "
            f"`{' '.join(run['launch_args'])}`; clients {run['clients']}; answers compared "
            f"byte for byte: {', '.join(k for k, v in result['exact'].items() if v) or 'none'}"
            f" (others checked for form and length); resources sampled every "
            f"{run['sample_every']:g} s; judged on the samples taken while no fault was going "
            f"on, after a warm-up of {run['warmup']:g} s: the median of the last "
            f"{run['count']} against that of the first {run['count']}, tolerance "
            f"{run['tolerance']}.", ""]
    if result.get("stopped_early"):
        head += [f"**Stopped early:** {result['stopped_early']}", ""]
    verdicts = ["| invariant | holds | detail |", "|---|---|---|"] + [
        f"| {v['name']} | {'yes' if v['ok'] else '**NO**'} | {v['detail'][:600]} |"
        for v in result["verdicts"]]
    body = (head + ["Requests by outcome:", ""] + requests_table(result)
            + not_ok_table(result)
            + ["", "Faults (times from each fault's start; an overlap's two share the moment "
               "the run was whole again):", ""] + faults_table(result)
            + ["", "Whole again, median by kind: " + "; ".join(whole_by_kind(result)) + ".",
               "", "Resources (each role's processes summed; medians of its first and last "
               "samples taken while no fault was going on; the peak over all):", ""]
            + drift_table(result)
            + (["", f"![resource curves]({png})"] if png else [])
            + ["", "Invariants:", ""] + verdicts + [""])
    return "\n".join(body)
