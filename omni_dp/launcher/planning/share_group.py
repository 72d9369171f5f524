"""A weight-sharing run's group, in one place: who leads, in which waves its replicas start and
stop, and what makes a leader's publication and a follower's attachment the run's.

With --share-weights replica 0 is the leader: it loads the weights and publishes them (the
manifest, omni_dp/sharefile.py) in the run's share/ directory before its /health turns 200;
every other replica is a follower and maps them. So the leader starts alone, in a first wave,
and the followers only once its manifest is checked; they stop in the reverse order, followers
before the leader. Bring-up, the MPS group restart, the supervisor's restarts and teardown all
ask these functions; none decides an order of its own. The checks are pure (the callers read
the manifest and /get_server_info).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from omni_dp.procs import ProcessIdentity
from omni_dp.runfile import RunRecord, ShareRecord
from omni_dp.sharefile import ShareManifest

LEADER = 0
LEADER_ROLE = "leader"
FOLLOWER_ROLE = "follower"


def share_role(share_weights: bool, index: int) -> str | None:
    """The replica's --share-weights role; None without sharing."""
    if not share_weights:
        return None
    return LEADER_ROLE if index == LEADER else FOLLOWER_ROLE


def followers(share_weights: bool, indices: Iterable[int]) -> list[int]:
    """The weight-share followers among these replicas, in their order (none without
    sharing): every replica but the leader."""
    return [i for i in indices if share_weights and i != LEADER]


def start_waves(record: RunRecord, indices: Iterable[int]) -> list[list[int]]:
    """These replicas in the order they start: the leader (if among them) alone first, then
    the followers; without sharing one wave of all."""
    wanted = sorted(set(indices))
    if not record.plan.share_weights:
        return [wanted] if wanted else []
    leader = [i for i in wanted if i == LEADER]
    return [wave for wave in (leader, followers(True, wanted)) if wave]


def stop_waves(record: RunRecord, indices: Iterable[int]) -> list[list[int]]:
    """The reverse: followers first (they hold the leader's memory), then the leader."""
    return start_waves(record, indices)[::-1]


def _same_path(a: str | Path, b: str | Path) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def manifest_problem(manifest: ShareManifest, leader: ProcessIdentity | None, run_id: str,
                     gpu: str) -> str | None:
    """Why a manifest is not the one this run's leader published now; None when it is."""
    if leader is None:
        return "the leader has no recorded process"
    if manifest.leader != leader:
        return (f"the manifest was published by pid {manifest.leader.pid} (created "
                f"{manifest.leader.create_time}), not by the leader now running (pid "
                f"{leader.pid}, created {leader.create_time}): it is stale")
    if manifest.run_id != run_id:
        return f"the manifest is of run {manifest.run_id!r}, not of {run_id!r}"
    # the run names its GPU by UUID (or "cpu"), as the manifest does; an index says nothing
    if (gpu == "cpu" or gpu.startswith("GPU-")) and manifest.device != gpu:
        return f"the manifest's weights are on {manifest.device}, the run's on {gpu}"
    if not manifest.shared:
        return "the manifest shares no tensor"
    return None


def follower_problem(weight_share: object, leader: ProcessIdentity | None,
                     directory: Path) -> str | None:
    """Why a follower's /get_server_info weight_share does not show it attached to this run's
    leader through this run's share directory; None when it does."""
    if not isinstance(weight_share, dict):
        return (f"/get_server_info reports weight_share {weight_share!r}: it is not sharing "
                "(docs/contracts.md)")
    if weight_share.get("role") != FOLLOWER_ROLE:
        return f"it reports the role {weight_share.get('role')!r}, not {FOLLOWER_ROLE!r}"
    said = weight_share.get("share_dir")
    if not isinstance(said, str) or not _same_path(said, directory):
        return f"it reads the share directory {said!r}, not the run's {str(directory)!r}"
    attached = weight_share.get("leader")
    if not isinstance(attached, dict) or leader is None or (
            attached.get("pid"), attached.get("create_time")) != (leader.pid,
                                                                  leader.create_time):
        expected = f"pid {leader.pid}, created {leader.create_time}" if leader else "none"
        return f"it is attached to the leader {attached!r}, not to replica {LEADER} ({expected})"
    return None


def share_record(manifest: ShareManifest, directory: Path) -> ShareRecord:
    """What run.json keeps as proof of the sharing, from the checked manifest; no follower is
    proven attached to this leader yet: each is added when its own share gate passes."""
    return ShareRecord(
        leader=LEADER, followers=(), directory=str(directory),
        policy=manifest.policy, shared_bytes=manifest.shared_bytes,
        private_bytes=manifest.private_bytes, tensors=len(manifest.shared),
        leader_pid=manifest.leader.pid, published_at=manifest.created_at)


def segment_mapping_problem(maps: str, device: tuple[int, int], inode: int,
                            segment: Path) -> str | None:
    """Why a process's /proc/PID/maps does not show the run's CPU segment (that file: device
    and inode) mapped read-only and shared; None when it does. The launcher's own look at the
    process, beside the replica's word on /get_server_info: a replica that computed from a copy
    of its own would not map the segment at all."""
    read_only = writable = False
    real = os.path.realpath(segment)
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
        if len(fields) < 5 or fields[4] != str(inode):
            continue
        # The device maps shows is not always stat's (btrfs subvolumes; overlayfs before
        # Linux 6.8 shows the upper layer's): the file's path then names it instead.
        path = fields[5].removesuffix(" (deleted)") if len(fields) > 5 else ""
        if _maps_device(fields[3]) != device and path != real:
            continue
        perms = fields[1]
        writable |= "w" in perms
        read_only |= perms.startswith("r-") and perms.endswith("s")
    if writable:
        return f"it maps the weight-share segment {segment} writable"
    if not read_only:
        return (f"/proc/PID/maps shows no read-only shared mapping of the weight-share segment "
                f"{segment}: the replica does not compute from the run's shared weights as far "
                "as its mappings show")
    return None


def _maps_device(field: str) -> tuple[int, int] | None:
    """ "fd:01" (hex major:minor, as /proc/PID/maps prints it) → (253, 1)."""
    major, _, minor = field.partition(":")
    try:
        return int(major, 16), int(minor, 16)
    except ValueError:
        return None


def attachment_basis(device: str) -> str:
    """What a follower's attachment rests on, for the lines that claim it: the launcher's own
    look on the CPU, the replica's word on CUDA (IPC memory shows in no CPU mapping)."""
    if device == "cpu":
        return "seen mapped read-only in their /proc/PID/maps"
    return "as they report it (CUDA IPC memory shows in no CPU mapping)"

