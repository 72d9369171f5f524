"""The leader's side: publish the models it built (cast and moved: what followers get is what
it computes with) and hold them itself as views of what it published.

CPU: every tensor of the policy, shared and private, in one segment file mapped read-only; the
leader's own parameters become views of that mapping and the originals are dropped, so the
leader holds one copy too and cannot write what its followers read. CUDA: one flat buffer per
dtype, the leader's parameters views of it, each buffer exported by IPC handle. Then the
manifest, atomically: a follower sees all of it or none.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from omni_dp.engine.config import ARCHITECTURE
from omni_dp.engine.plan import ServePlan, dtype_name
from omni_dp.engine.share import ShareError, ShareInfo
from omni_dp.engine.share.cuda_ipc import device_name, export, new_buffer
from omni_dp.engine.share.identity import model_identity, run_id
from omni_dp.engine.share.layout import buffer_per_dtype, lay_out, one_buffer
from omni_dp.engine.share.policy import policy_for
from omni_dp.engine.share.segment import map_segment, remove_ours, write_segment
from omni_dp.engine.share.tensors import bind, named_tensors, view_of
from omni_dp.engine.weights import PipelineModels
from omni_dp.files import PrivateDirError, make_private_dir
from omni_dp.procs import identify
from omni_dp.sharefile import (
    SEGMENT_FILE,
    Buffer,
    ShareManifest,
    TensorEntry,
    manifest_path,
    write_manifest,
)

log = logging.getLogger("omni_dp.serve")

Placed = list[tuple[TensorEntry, torch.Tensor]]
# The exported CUDA buffers, never released: the leader holds them for its whole life. The
# ref counter torch keeps per export (the leader would free a block once it reads zero) is
# decremented by each follower's exit as well, so it says nothing here; holding the buffers
# for the leader's lifetime is what makes that harmless.
_KEEP: list[torch.Tensor] = []


def publish(plan: ServePlan, models: PipelineModels, share_dir: Path) -> ShareInfo:
    policy = policy_for(ARCHITECTURE)
    tensors = named_tensors(models)
    shared_names, private_names = policy.split(tensors)
    # A CUDA leader's allocator was checked by plan_serve (exportable_problem), in this process.
    try:
        make_private_dir(share_dir)
    except PrivateDirError as exc:
        raise ShareError(str(exc)) from None
    # First the old manifest: no follower may pair it with the segment written next.
    remove_ours(manifest_path(share_dir), "weight-share manifest")
    shared = [(n, tensors[n]) for n in shared_names]
    private = [(n, tensors[n]) for n in private_names]
    del tensors
    cuda = plan.device.type == "cuda"
    sizes, shared_entries, private_entries = lay_out(
        shared, private, buffer_per_dtype if cuda else one_buffer)
    placed = list(zip((*shared_entries, *private_entries), (t for _, t in shared + private),
                      strict=True))
    del shared, private
    if cuda:
        buffers = _publish_cuda(models, sizes, placed, plan.device)
    else:
        buffers = _publish_cpu(models, sizes[0], placed, share_dir)
    del placed  # the original tensors: the models hold views of the buffers now
    leader = identify(os.getpid())
    assert leader is not None  # this very process
    manifest = ShareManifest(
        architecture=ARCHITECTURE, policy=policy.name, model=model_identity(plan),
        dtype=dtype_name(plan.dtype), device=device_name(plan.device), run_id=run_id(),
        leader=leader, buffers=tuple(buffers), shared=tuple(shared_entries),
        private=tuple(private_entries), created_at=time.time(),
    )
    write_manifest(share_dir, manifest)
    log.info("weight share: leader published %d tensors, %d bytes shared (%d private) in %s",
             len(manifest.shared) + len(manifest.private), manifest.shared_bytes,
             manifest.private_bytes, share_dir)
    return ShareInfo("leader", str(share_dir), policy.name, manifest.shared_bytes,
                     manifest.private_bytes, len(manifest.shared), leader)


def _publish_cpu(models: PipelineModels, nbytes: int, placed: Placed,
                 share_dir: Path) -> list[Buffer]:
    write_segment(share_dir, nbytes, placed)
    mapping = map_segment(share_dir, nbytes)
    for entry, _ in placed:
        bind(models, entry.name, view_of(mapping.flat, entry))
    return [Buffer("segment", nbytes, file=SEGMENT_FILE, sha256=mapping.sha256())]


def _publish_cuda(models: PipelineModels, sizes: list[int], placed: Placed,
                  device: torch.device) -> list[Buffer]:
    flats = [new_buffer(n, device) for n in sizes]
    for entry, tensor in placed:
        view = view_of(flats[entry.buffer], entry)
        view.copy_(tensor)
        bind(models, entry.name, view)
    torch.cuda.synchronize(device)  # the copies are done before anyone opens a handle
    _KEEP.extend(flats)
    return [Buffer("cuda_ipc", n, ipc=export(flat)) for n, flat in zip(sizes, flats,
                                                                          strict=True)]
