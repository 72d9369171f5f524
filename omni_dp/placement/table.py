"""A resolved placement shown to people (a text table) and to programs (JSON).

The table is formatted by hand, not with rich: it is printed at start-up and piped into logs,
where plain aligned text reads best and no terminal codes leak.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from omni_dp.placement.config import PLACEMENT
from omni_dp.placement.model import Placement, ProcessPlan, Provenance, Source, StageConfig
from omni_dp.sizes import format_size


def _plain(value: Any) -> Any:
    """Tuples (devices, fused_stages) as JSON lists."""
    return [_plain(v) for v in value] if isinstance(value, (tuple, list)) else value


def _fields(owner: str, config: Any, placement: Placement) -> dict[str, dict[str, Any]]:
    return {f.name: {"value": _plain(getattr(config, f.name)),
                     "source": str(placement.request.source_of(owner, f.name))}
            for f in dataclasses.fields(config)}


def placement_json(placement: Placement) -> dict:
    """Every process with where its name and stages came from ("derived (fused_stages [talker,
    vocoder])": why a stage runs where its own `process` does not say), and every configured
    value with where it came from."""
    request = placement.request
    return {
        "pipeline": placement.pipeline.name,
        "processes": [{"name": p.name, "stages": list(p.stages), "device": p.device,
                       "gpu_memory_fraction": p.gpu_memory_fraction,
                       "budget_bytes": p.budget_bytes, "tp_rank": p.tp_rank,
                       "tp_size": p.tp_size, "replica": p.replica,
                       "source": str(p.provenance)}
                      for p in placement.processes],
        "stages": {s.name: _fields(s.name, request.stages.get(s.name, StageConfig()), placement)
                   for s in placement.pipeline.stages},
        PLACEMENT: _fields(PLACEMENT, request.placement, placement),
    }


def _budget(plan: ProcessPlan, placement: Placement) -> str:
    if plan.gpu_memory_fraction is None or plan.budget_bytes is None:
        return "undeclared"
    total = format_size(placement.device_total_bytes[plan.device])
    return (f"{round(plan.gpu_memory_fraction, 6):g} × {total} = "
            f"{format_size(plan.budget_bytes)}")


def _stages_cell(plan: ProcessPlan) -> str:
    stages = ", ".join(plan.stages) or "-"
    if plan.tp_rank is not None:
        return f"{stages} (TP rank {plan.tp_rank} of {plan.tp_size})"
    return f"{stages} (replica {plan.replica})" if plan.replica is not None else stages


def _shown(value: Any) -> str:
    """A value as it would be written on the command line (devices 0,1; groups a,b;c,d)."""
    if isinstance(value, tuple):
        joiner = ";" if value and isinstance(value[0], tuple) else ","
        return joiner.join(_shown(v) for v in value)
    return str(value)


def _origin(provenance: Provenance) -> str:
    return provenance.source.value + (f": {provenance.detail}" if provenance.detail else "")


def _derived(placement: Placement) -> list[str]:
    """A line per derivation: the processes it named (a TP stage's ranks on one line), ← why."""
    by_origin: dict[Provenance, list[str]] = {}
    for plan in placement.processes:
        if plan.provenance.source == Source.DERIVED:
            by_origin.setdefault(plan.provenance, []).append(plan.name)
    return [f"  {', '.join(names)} ← {provenance.detail or provenance.source.value}"
            for provenance, names in by_origin.items()]


def render_table(placement: Placement) -> str:
    """process → stages → device → memory budget, then the processes that were derived (TP
    ranks, replicas, fused groups) and why, then each value that is not a default."""
    rows = [("process", "stages", "device", "memory budget")]
    rows += [(p.name, _stages_cell(p), p.device, _budget(p, placement))
             for p in placement.processes]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [f"placement of {placement.pipeline.name}: {len(placement.processes)} process(es)"]
    lines += ["  " + "".join(cell.ljust(w + 2) for cell, w in zip(row[:3], widths, strict=True))
              + row[3] for row in rows]
    derived = _derived(placement)
    lines += ["derived:", *derived] if derived else []
    request = placement.request
    order = [s.name for s in placement.pipeline.stages] + [PLACEMENT]
    chosen = sorted(((key, p) for key, p in request.provenance.items()
                     if p.source != Source.DEFAULT and key[0] in order),
                    key=lambda item: (order.index(item[0][0]), item[0][1]))
    lines += ["set:"] if chosen else []
    for (owner, name), provenance in chosen:
        config = (request.placement if owner == PLACEMENT
                  else request.stages.get(owner, StageConfig()))
        lines.append(f"  {owner}.{name} = {_shown(getattr(config, name))}  "
                     f"({_origin(provenance)})")
    return "\n".join(lines)
