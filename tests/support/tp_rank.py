"""A tensor-parallel rank as a process of its own, for the tests of engine/tensor_parallel.py.

The product starts its ranks as stage processes (engine/stage_process.py); these tests drive
the group directly, with the test process as rank 0 and this script (`python tp_rank.py SPEC`)
as rank 1, so that the sharding, the broadcasts and the failure modes are tested without a
replica around them. Real ranks, real gloo: not a stand-in.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from omni_dp.engine.config import ModelConfig, resolve_model
from omni_dp.engine.kv_cache import KVCache, KVCacheSpec
from omni_dp.engine.model import Talker
from omni_dp.engine.tensor_parallel import (
    follow,
    join_group,
    leave_group,
    rank_kv_spec,
    shard_talker,
)
from omni_dp.engine.weights import load_models, seeded_models

TESTS_DIR = str(Path(__file__).resolve().parents[1])  # on PYTHONPATH: `import support`


# --- a follower process --------------------------------------------------------------------


@dataclass(frozen=True)
class RankSpec:
    """All a rank process needs to rebuild its shard and join: JSON on a follower's command line.

    Every rank builds exactly the same full talker (same preset and seed, or same directory),
    in the same dtype, and keeps its share; so rank 0's spec differs from the others' only in
    `rank`.
    """

    rank: int
    world: int
    store_port: int
    model: str  # a preset name or a model directory, as --model takes
    seed: int
    dtype: str  # a torch dtype name: "float64", "bfloat16"
    device: str  # "cpu", "cuda:0"
    page_size: int
    num_pages: int
    backend: str = "gloo"
    timeout_s: float = 60.0
    cpu_threads: int = 1  # torch's intra-op threads: ranks on one host share its cores

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    def command(self) -> list[str]:
        """The command line that runs this rank: this file, as a script."""
        return [sys.executable, str(Path(__file__).resolve()), self.to_json()]


def build_shard(spec: RankSpec, group: dist.ProcessGroup | None) -> Talker:
    """Build the full talker on the CPU, keep this rank's shard, move it to its device."""
    cfg, directory = resolve_model(spec.model)
    models = load_models(cfg, directory) if directory else seeded_models(cfg, spec.seed)
    full = models.talker.to(getattr(torch, spec.dtype))
    return shard_talker(full, spec.rank, spec.world, group).to(torch.device(spec.device))


def rank_kv_cache(cfg: ModelConfig, spec: RankSpec) -> KVCache:
    """This rank's KV pool: `spec.num_pages` pages of its kv heads."""
    full = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, getattr(torch, spec.dtype),
                       spec.page_size, spec.num_pages)
    return KVCache(rank_kv_spec(full, spec.world), torch.device(spec.device))


def run_follower(spec: RankSpec) -> int:
    """Join, build the shard and its cache, follow rank 0 until it stops; returns the steps."""
    if spec.rank == 0:
        raise ValueError("rank 0 drives the group with TPModelRunner, not run_follower")
    device = torch.device(spec.device)
    group = join_group(spec.rank, spec.world, spec.store_port, spec.backend, spec.timeout_s,
                       device if device.type == "cuda" else None)
    try:
        shard = build_shard(spec, group.device_group)
        cache = rank_kv_cache(shard.cfg, spec)
        return follow(shard, cache, device, group)
    finally:
        leave_group()


def main(argv: list[str]) -> int:
    spec = RankSpec(**json.loads(argv[0]))
    torch.set_num_threads(spec.cpu_threads)
    steps = run_follower(spec)
    print(f"tensor-parallel rank {spec.rank}/{spec.world}: {steps} steps", flush=True)
    # As the product's rank processes do (engine/stage_process.py): gloo's threads can abort
    # the interpreter's teardown, so leave without it.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

