"""A follower's checks of a manifest against its own plan, before it maps a byte.

Each field is compared with what the follower computes for itself, in the order that names the
most fundamental difference first (architecture, policy, model, dtype, device, run), then the
leader's liveness, then the tensors: the same names in the same sets, each of the dtype and
shape this follower's own model has. The first difference is the reason it refuses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from omni_dp.engine.config import ARCHITECTURE
from omni_dp.engine.plan import ServePlan, dtype_name
from omni_dp.engine.share import ShareError
from omni_dp.engine.share.cuda_ipc import device_name
from omni_dp.engine.share.identity import run_id
from omni_dp.engine.share.policy import SharePolicy
from omni_dp.engine.share.tensors import named_tensors
from omni_dp.engine.weights import PipelineModels
from omni_dp.procs import ProcessIdentity, is_alive
from omni_dp.sharefile import ModelIdentity, ShareManifest, TensorEntry

Spec = tuple[str, tuple[int, ...]]  # dtype name, shape


@dataclass(frozen=True)
class Expected:
    """What this follower would publish itself, had it been the leader."""

    architecture: str
    policy: str
    model: ModelIdentity
    dtype: str
    device: str
    run_id: str
    shared: dict[str, Spec]
    private: dict[str, Spec]


def expected_of(plan: ServePlan, models: PipelineModels, policy: SharePolicy,
                model: ModelIdentity) -> Expected:
    """From the follower's plan and its (meta-device) models."""
    tensors = named_tensors(models)
    shared, private = policy.split(tensors)

    def specs(names: list[str]) -> dict[str, Spec]:
        return {n: (dtype_name(tensors[n].dtype), tuple(tensors[n].shape)) for n in names}

    return Expected(ARCHITECTURE, policy.name, model, dtype_name(plan.dtype),
                    device_name(plan.device), run_id(), specs(shared), specs(private))


def _short(model: ModelIdentity) -> str:
    return f"{model.source} (sha256 {model.digest[:12]}…)"


def check_manifest(manifest: ShareManifest, expected: Expected,
                   alive: Callable[[ProcessIdentity], bool] = is_alive) -> None:
    """ShareError with the first difference between the manifest and this follower."""
    m, e = manifest, expected
    fields = (
        ("architecture", m.architecture, e.architecture, m.architecture, e.architecture),
        ("share policy", m.policy, e.policy, m.policy, e.policy),
        ("model digest", m.model.digest, e.model.digest, _short(m.model), _short(e.model)),
        ("talker dtype", m.dtype, e.dtype, m.dtype, e.dtype),
        ("device", m.device, e.device, m.device, e.device),
        ("run id", m.run_id, e.run_id, m.run_id, e.run_id),
    )
    for what, theirs, ours, theirs_text, ours_text in fields:
        if theirs != ours:
            raise ShareError(f"the {what} differs: the leader's is {theirs_text}, this "
                             f"follower's is {ours_text}")
    if not alive(m.leader):
        raise ShareError(f"the leader (pid {m.leader.pid}) is not running: the manifest is "
                         "one a gone leader left; not attaching")
    _check_sets(m, e)
    for entry in (*m.shared, *m.private):
        _check_tensor(entry, e.shared.get(entry.name) or e.private[entry.name])


def _check_sets(m: ShareManifest, e: Expected) -> None:
    theirs = {t.name: "shared" for t in m.shared} | {t.name: "private" for t in m.private}
    ours = {n: "shared" for n in e.shared} | {n: "private" for n in e.private}
    differences = [f"{name} is {theirs.get(name, 'absent')} at the leader, "
                   f"{ours.get(name, 'absent')} here"
                   for name in sorted(theirs.keys() | ours.keys())
                   if theirs.get(name) != ours.get(name)]
    if differences:
        more = f" and {len(differences) - 5} more" if len(differences) > 5 else ""
        raise ShareError("the leader's shared and private tensors are not this follower's "
                         f"policy's: {'; '.join(differences[:5])}{more}")


def _check_tensor(entry: TensorEntry, spec: Spec) -> None:
    dtype, shape = spec
    if entry.dtype != dtype:
        raise ShareError(f"tensor {entry.name} has dtype {entry.dtype} at the leader, {dtype} "
                         "here")
    if entry.shape != shape:
        raise ShareError(f"tensor {entry.name} has shape {list(entry.shape)} at the leader, "
                         f"{list(shape)} here")
