"""Which model, and which run: what a leader and its followers compute alike from their plans,
before a weight is loaded, and compare through the manifest.

A preset is its canonical config and its weight seed (seeded weights are a function of the
two); a weights directory is the bytes of its two files. A follower that would have loaded other
weights than its leader's refuses to map them.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from omni_dp.contract import RUN_ID_ENV
from omni_dp.engine.config import CONFIG_FILE, WEIGHTS_FILE
from omni_dp.engine.plan import ServePlan
from omni_dp.sharefile import ModelIdentity

STANDALONE_RUN = "standalone"  # the run id of replicas started outside `omni-dp launch`
_CHUNK = 4 * 1024**2


def run_id() -> str:
    return os.environ.get(RUN_ID_ENV) or STANDALONE_RUN


def model_identity(plan: ServePlan) -> ModelIdentity:
    digest = hashlib.sha256()
    if plan.model_dir is None:
        seed = plan.options.weight_seed
        canonical = json.dumps(plan.cfg.to_json(), sort_keys=True, separators=(",", ":"))
        digest.update(canonical.encode())
        digest.update(f"\0seed={seed}".encode())
        return ModelIdentity(f"preset {plan.cfg.name}, seed {seed}", digest.hexdigest())
    directory = Path(plan.model_dir).resolve()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        path = directory / name
        # Each file's length first, so that no two pairs of files hash as one stream.
        digest.update(f"{name}\0{path.stat().st_size}\0".encode())
        with open(path, "rb") as f:
            # Streamed (a weights file may be gigabytes); hashlib.file_digest is 3.11+.
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
    return ModelIdentity(str(directory), digest.hexdigest())
