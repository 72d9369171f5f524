"""The pipeline as stages, each with the name of the process it runs in.

`process` is the single source of truth for process topology (docs/design.md, placement model):
stages with the same process name share a process. This build runs placement form ① only — every
stage in one process — but stages talk through channels, not calls, so a later placement layer
can put a process boundary (pyzmq) between them without rewriting any stage.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageSpec:
    name: str
    process: str
    uses_accelerator: bool  # runs on the replica's device (cuda:N or cpu); else always cpu


DEFAULT_STAGES: tuple[StageSpec, ...] = (
    StageSpec("preprocess", process="main", uses_accelerator=False),
    StageSpec("talker", process="main", uses_accelerator=True),
    StageSpec("vocoder", process="main", uses_accelerator=True),
)


class PlacementError(ValueError):
    pass


def validate_placement(stages: tuple[StageSpec, ...]) -> None:
    names = [s.name for s in stages]
    if names != ["preprocess", "talker", "vocoder"]:
        raise PlacementError(f"the built-in pipeline is preprocess → talker → vocoder, got {names}")
    processes = sorted({s.process for s in stages})
    if len(processes) != 1:
        raise PlacementError(
            f"stages name the processes {processes}; this build runs every stage in one process "
            "(placement form ①) — give them one process name"
        )


def process_table(stages: tuple[StageSpec, ...], pid: int, device: str) -> list[dict]:
    """The `processes` entry of /get_server_info: one row per OS process of this replica."""
    rows: dict[str, dict] = {}
    for stage in stages:
        row = rows.setdefault(
            stage.process, {"pid": pid, "role": stage.process, "device": "cpu", "stages": []}
        )
        row["stages"].append(stage.name)
        if stage.uses_accelerator:
            row["device"] = device
    return list(rows.values())
