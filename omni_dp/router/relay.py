"""The admin changes one router process passes to its siblings (--workers K > 1): typed, so the
process that announces one and the processes that apply it agree on its fields. They travel
pickled over the parent's pipes (workers.py), between processes of one omni-dp."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReplicaAdded:
    id: str
    url: str
    disabled: bool


@dataclass(frozen=True)
class ReplicaUpdated:
    id: str
    disabled: bool


@dataclass(frozen=True)
class ReplicaRemoved:
    id: str


SiblingChange = ReplicaAdded | ReplicaUpdated | ReplicaRemoved
