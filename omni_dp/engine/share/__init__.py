"""Shared backbone weights (issue 12): N replicas of one run on one device hold one copy of
the big read-only matrices instead of N.

A leader (`serve --share-weights leader`) builds its models as usual, packs every tensor its
architecture's policy names into flat buffers (a read-only file mapping on CPU, CUDA IPC
storages on a GPU), rebinds its own parameters to views of them, and publishes a manifest
(omni_dp/sharefile.py). A follower builds its models on the meta device, checks the manifest
field by field against its own plan and fails closed on any difference, then binds views of the
leader's buffers (no copy) for the shared tensors and copies of its own for the private ones.

    policy.py    which tensors are shared and which private, per architecture
    identity.py  the model identity and run id both sides compute from their plans
    tensors.py   naming, binding and checking a model's tensors; the meta-device model
    layout.py    where each tensor lies in the flat buffers
    segment.py   the CPU segment file: written once, mapped read-only
    cuda_ipc.py  the CUDA buffers: exported and opened by IPC handle
    export.py    the leader's side
    verify.py    a follower's checks of the manifest against its own plan
    attach.py    the follower's side
    watch.py     a follower stops when its leader is gone
"""

from __future__ import annotations

from dataclasses import dataclass

from omni_dp.procs import ProcessIdentity
from omni_dp.records import Record


class ShareError(Exception):
    """Weights that cannot be shared or attached, with the reason; the replica exits 3."""


@dataclass(frozen=True)
class ShareInfo(Record):
    """What a sharing replica reports on /get_server_info (`weight_share`)."""

    role: str  # leader | follower
    share_dir: str
    policy: str
    shared_bytes: int
    private_bytes: int
    tensors_shared: int
    leader: ProcessIdentity
