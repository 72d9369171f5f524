"""The follower's side: models whose shared tensors are the leader's, after every check.

Fail closed: anything unexpected — the manifest's file or fields, another model, dtype, device
or run, a gone leader, other tensor sets, dtypes or shapes, a segment of the wrong size or
bytes — is a ShareError naming it, and nothing is served. The model is built on the meta device
(no memory), so the shared tensors are never held twice, not even while attaching; its rotary
tables, which are neither parameters nor buffers, are built on the CPU with it, as every
replica's are.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from omni_dp.engine.config import ARCHITECTURE
from omni_dp.engine.plan import ServePlan
from omni_dp.engine.share import ShareError, ShareInfo
from omni_dp.engine.share.cuda_ipc import open_buffer
from omni_dp.engine.share.identity import model_identity
from omni_dp.engine.share.policy import policy_for
from omni_dp.engine.share.segment import map_segment
from omni_dp.engine.share.tensors import bind, check_materialized, view_of
from omni_dp.engine.share.verify import check_manifest, expected_of
from omni_dp.engine.weights import PipelineModels, meta_models
from omni_dp.procs import ProcessIdentity, is_alive
from omni_dp.sharefile import ShareFileError, ShareManifest, read_manifest, segment_path


def attach(plan: ServePlan, share_dir: Path,
           alive: Callable[[ProcessIdentity], bool] = is_alive,
           ) -> tuple[PipelineModels, ShareInfo]:
    """This follower's models, bound to what the leader published in `share_dir`, and what
    /get_server_info says of it; ShareError with the reason for anything unexpected."""
    try:
        manifest = read_manifest(share_dir)
    except ShareFileError as exc:
        raise ShareError(str(exc)) from None
    policy = policy_for(ARCHITECTURE)
    model = model_identity(plan)
    models = meta_models(plan.cfg, plan.dtype, model.source)
    check_manifest(manifest, expected_of(plan, models, policy, model), alive)
    if plan.device.type == "cuda":
        _bind_cuda(models, manifest, plan.device)
    else:
        _bind_cpu(models, manifest, share_dir)
    check_materialized(models)  # nothing left on the meta device, bound or built
    if not alive(manifest.leader):  # it may have gone while we mapped what it published
        raise ShareError(f"the leader (pid {manifest.leader.pid}) went away while this "
                         "follower attached")
    return models, ShareInfo("follower", str(share_dir), manifest.policy,
                             manifest.shared_bytes, manifest.private_bytes,
                             len(manifest.shared), manifest.leader)


def _kinds(manifest: ShareManifest, kind: str, count: int | None = None) -> None:
    kinds = [b.kind for b in manifest.buffers]
    if any(k != kind for k in kinds) or (count is not None and len(kinds) != count):
        wanted = f"{count} {kind} buffer" if count else f"{kind} buffers"
        raise ShareError(f"the manifest's buffers are {kinds}; on {manifest.device} a "
                         f"follower needs {wanted}")


def _bind_views(models: PipelineModels, manifest: ShareManifest,
                flats: list[torch.Tensor]) -> None:
    """Shared: views of the leader's buffers, proven to lie inside them (no copy was made).
    Private: copies of our own."""
    for entry in manifest.shared:
        flat = flats[entry.buffer]
        bound = bind(models, entry.name, view_of(flat, entry))
        start, end, at = flat.data_ptr(), flat.data_ptr() + flat.numel(), bound.data_ptr()
        if not (start <= at and at + entry.nbytes <= end):
            raise ShareError(f"tensor {entry.name} is not a view of the leader's buffer")
    for entry in manifest.private:
        bind(models, entry.name, view_of(flats[entry.buffer], entry).clone())


def _bind_cpu(models: PipelineModels, manifest: ShareManifest, share_dir: Path) -> None:
    _kinds(manifest, "segment", 1)
    buffer = manifest.buffers[0]
    mapping = map_segment(share_dir, buffer.nbytes)
    digest = mapping.sha256()
    if digest != buffer.sha256:
        raise ShareError(f"the weight-share segment {segment_path(share_dir)} does not hold what "
                         f"the leader wrote: its sha256 is {digest[:12]}…, the manifest says "
                         f"{(buffer.sha256 or '')[:12]}…")
    _bind_views(models, manifest, [mapping.flat])


def _bind_cuda(models: PipelineModels, manifest: ShareManifest, device: torch.device) -> None:
    _kinds(manifest, "cuda_ipc")
    flats = []
    for index, buffer in enumerate(manifest.buffers):
        assert buffer.ipc is not None  # sharefile: a cuda_ipc buffer has its handle
        flat = open_buffer(buffer.ipc, device)
        if flat.numel() < buffer.nbytes:
            raise ShareError(f"the leader's CUDA buffer {index} is {flat.numel()} bytes, the "
                             f"manifest says {buffer.nbytes}")
        flats.append(flat)
    _bind_views(models, manifest, flats)
