"""The talker as a tensor-parallel stage group: one talker split across `world` rank processes.

Megatron-style sharding of every decoder layer: attention heads (query and key/value heads
alike) and MLP columns are divided between the ranks, so each rank holds 1/world of the layer
weights and 1/world of the KV cache. Each layer costs two all-reduces (after o_proj and after
down_proj). Embedding, norms and lm_head are replicated: they are a small part of the model, and
with replicated logits any rank could sample; rank 0 alone does.

Rank 0 is the only rank the rest of the pipeline sees. It runs the scheduler as a single-process
replica does and broadcasts each step's host-side inputs (the same ints `ModelRunner` stages) to
the other ranks, which build the same FlatBatch and run their shard in lockstep (`follow`). Every
rank therefore executes exactly the batches rank 0's scheduler decided.

Rendezvous and sockets, all on loopback:
  * `open_store` (in the process that starts the group) binds a TCPStore listener itself, on
    127.0.0.1 port 0: the kernel picks a free port (no find-then-bind race between replicas
    starting together) and the store listens on loopback only. Left to itself, torch's default
    (libuv) store server listens on every interface whatever host name it is given.
  * gloo's pair sockets listen on kernel-assigned ports of the address of one network device:
    by default the one the host name resolves to, which can be an external interface.
    `join_group` sets GLOO_SOCKET_IFNAME to the loopback device (and NCCL_SOCKET_IFNAME, for
    NCCL's bootstrap sockets) before the group is made.

Failure: a rank process that dies closes its sockets, and a gloo collective waiting on it fails
at once with RuntimeError ("Connection closed by peer"); a rank that hangs makes the others'
collectives fail after the group's timeout ("Timed out waiting ...ms"). Either way the group is
unusable afterwards: rank 0's `execute` raises (the talker stage's fatal path) and a follower's
`follow` raises (its process should exit non-zero). Followers wait for the next step with no
practical timeout (an idle replica may wait for hours); rank 0 dying still wakes them at once.
Leaving is not dying: `leave_group` (destroy_process_group) does not close gloo's sockets, which
stay open until the process exits, so a rank 0 that leaves without `stop()` leaves its followers
waiting. A replica that fails should `stop()` if it can, and end its rank processes either way.
With NCCL (not tested here), the group's timeout is enforced by its watchdog, which by default
ends the process.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.torch_version import TorchVersion

from omni_dp.engine.config import ModelConfig
from omni_dp.engine.kv_cache import KVCache, KVCacheSpec
from omni_dp.engine.model import Attention, DecoderLayer, FlatBatch, GatedMLP, Talker
from omni_dp.engine.runner import (
    BatchLayout,
    ModelRunner,
    Segment,
    Span,
    assemble_batch,
)
from omni_dp.engine.scheduler import SchedulerOutput

LOOPBACK = "127.0.0.1"
LOOPBACK_IFNAME = "lo"  # Linux's loopback device, for GLOO_/NCCL_SOCKET_IFNAME
# How long a follower waits for rank 0's next step: an idle replica sends none, for as long as
# it has no requests. A rank 0 that dies is seen at once regardless (its sockets close).
IDLE_WAIT = datetime.timedelta(days=365)
_STOP = -1  # header value that ends `follow`
# The libuv store server (the default since torch 2.4) serves a listening socket it is handed
# only from torch 2.8 on; before, the classic server does.
_LIBUV_TAKES_LISTEN_FD = TorchVersion(torch.__version__) >= (2, 8)


# --- sharding ------------------------------------------------------------------------------


def check_shardable(cfg: ModelConfig, world: int) -> None:
    """Each rank needs whole query heads, whole kv heads and an equal share of the MLP."""
    if world < 1:
        raise ValueError(f"tensor-parallel world size must be positive, got {world}")
    problems = [
        f"{name} = {value} is not divisible by {world}"
        for name, value in (("num_heads", cfg.num_heads), ("num_kv_heads", cfg.num_kv_heads),
                            ("intermediate_size", cfg.intermediate_size))
        if value % world
    ]
    if problems:
        raise ValueError(
            f"model {cfg.name!r} cannot be split across {world} tensor-parallel ranks: "
            + "; ".join(problems)
        )


def shard_config(cfg: ModelConfig, world: int) -> ModelConfig:
    """The shapes one rank's layers have: 1/world of the heads and of the MLP width."""
    check_shardable(cfg, world)
    return dataclasses.replace(
        cfg, num_heads=cfg.num_heads // world, num_kv_heads=cfg.num_kv_heads // world,
        intermediate_size=cfg.intermediate_size // world,
    )


def rank_kv_spec(spec: KVCacheSpec, world: int) -> KVCacheSpec:
    """One rank's KV cache: its kv heads only, with the same pages (ids, size, count).

    The scheduler's page ids hold for every rank, and every rank's capacity in tokens is the
    unsharded cache's; each rank's bytes are 1/world of them.
    """
    if spec.num_kv_heads % world:
        raise ValueError(f"num_kv_heads = {spec.num_kv_heads} is not divisible by {world}")
    return dataclasses.replace(spec, num_kv_heads=spec.num_kv_heads // world)


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum `x` in place over the group's ranks (the default group if None)."""
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


def _rows(weight: torch.Tensor, parts: list[int], rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s share of each fused part along dim 0 ([q | k | v], [gate | up]), as a copy:
    a view would keep the whole unsharded weight alive."""
    return torch.cat([part.chunk(world)[rank] for part in weight.split(parts)])


def _columns(weight: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return weight.chunk(world, dim=1)[rank].clone(memory_format=torch.contiguous_format)


class _RowParallelOutput:
    """What both sharded layers add to their unsharded forward: the rank's group, and the sum
    of every rank's partial output (the row-parallel projection at their end)."""

    def __init__(self, shard_cfg: ModelConfig, world: int,
                 group: dist.ProcessGroup | None) -> None:
        super().__init__(shard_cfg)  # the unsharded layer, built with the shard's sizes
        self.world = world
        self.group = group

    def summed(self, partial: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(partial, self.group) if self.world > 1 else partial


class ShardedAttention(_RowParallelOutput, Attention):
    """This rank's query and kv heads; o_proj is row-parallel, its partial outputs summed.

    The forward is the unsharded one: with heads//world and kv_heads//world, query head j still
    reads kv head j // (heads // kv_heads), and the rank's cache holds exactly its kv heads.
    """

    def forward(self, x: torch.Tensor, batch: FlatBatch, rope: tuple[torch.Tensor, torch.Tensor],
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        return self.summed(super().forward(x, batch, rope, k_cache, v_cache))


class ShardedMLP(_RowParallelOutput, GatedMLP):
    """This rank's columns of gate and of up; down_proj is row-parallel, summed across ranks."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.summed(super().forward(x))


def shard_talker(
    talker: Talker, rank: int, world: int, group: dist.ProcessGroup | None = None
) -> Talker:
    """Rank `rank`'s shard of the unsharded `talker` (left untouched), same forward signature.

    Every rank builds the same full weights (one seed, or one checkpoint) and keeps its share:
    no weights are sent between ranks. The result is a Talker whose `cfg` is still the model's
    own; its layers have 1/world of the heads and MLP width, and sum their outputs over `group`.
    """
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a tensor-parallel group of {world}")
    cfg = talker.cfg
    local = shard_config(cfg, world)
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    inner = cfg.intermediate_size
    with torch.device("meta"):  # shapes only: the weights are assigned below
        shard = Talker(local)
    shard.cfg = cfg
    shard.tp_rank, shard.tp_world = rank, world
    # Replicated, copied: the shard must not share modules that a later `.to()` of either
    # model would move under the other.
    for name in ("embed", "norm", "lm_head"):
        setattr(shard, name, copy.deepcopy(getattr(talker, name)))
    for index, full in enumerate(talker.layers):
        layer: DecoderLayer = shard.layers[index]
        layer.input_norm = copy.deepcopy(full.input_norm)
        layer.post_attn_norm = copy.deepcopy(full.post_attn_norm)
        with torch.device("meta"):
            layer.attn = ShardedAttention(local, world, group)
            layer.mlp = ShardedMLP(local, world, group)
        layer.attn.load_state_dict({
            "qkv_proj.weight": _rows(full.attn.qkv_proj.weight, [q, kv, kv], rank, world),
            "o_proj.weight": _columns(full.attn.o_proj.weight, rank, world),
        }, assign=True)
        layer.mlp.load_state_dict({
            "gate_up_proj.weight": _rows(full.mlp.gate_up_proj.weight, [inner, inner], rank,
                                         world),
            "down_proj.weight": _columns(full.mlp.down_proj.weight, rank, world),
        }, assign=True)
    return shard.train(talker.training)


# --- the group -----------------------------------------------------------------------------


@dataclass
class TPGroup:
    """One rank's view of its tensor-parallel group.

    Two process groups on a GPU: the talker's all-reduces on NCCL, and the step broadcasts on
    gloo over host memory. The steps are host ints anyway, and a follower waiting in an NCCL
    broadcast would keep a kernel spinning on the GPU for as long as the replica is idle. On
    the CPU both are the same gloo group.
    """

    rank: int
    world: int
    device_group: dist.ProcessGroup
    cpu_group: dist.ProcessGroup


def open_store(timeout_s: float = 60.0) -> tuple[dist.TCPStore, int]:
    """The group's rendezvous store, in the process that starts the ranks; returns it and its
    port, which each rank is given. Keep the store referenced while the group lives: the
    server stops when it is collected.

    The listening socket is made here, bound to 127.0.0.1 port 0 (the kernel picks a free
    port, so two replicas starting at once never race for one), and handed to the store.
    """
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((LOOPBACK, 0))
        listener.listen(128)
        port = listener.getsockname()[1]
    except OSError:
        listener.close()
        raise
    # detach(): the store owns the descriptor from here and closes it; were the Python socket
    # to close it under the running store, its server thread would abort the process.
    store = dist.TCPStore(
        LOOPBACK, port, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s), master_listen_fd=listener.detach(),
        use_libuv=_LIBUV_TAKES_LISTEN_FD,
    )
    if store.port != port:
        raise RuntimeError(f"the rendezvous store serves port {store.port}, not {port}")
    return store, port


def join_group(
    rank: int,
    world: int,
    store_port: int,
    backend: str = "gloo",
    timeout_s: float = 60.0,
    device: torch.device | None = None,
) -> TPGroup:
    """Join the group as `rank` (in each rank process, rank 0 included); returns when all have.

    `timeout_s` bounds the rendezvous (a rank that never comes makes the others raise) and
    every collective after it. The process's default group becomes this one: one group per
    process, as a stage process has.
    """
    os.environ["GLOO_SOCKET_IFNAME"] = LOOPBACK_IFNAME
    if backend == "nccl":
        os.environ["NCCL_SOCKET_IFNAME"] = LOOPBACK_IFNAME
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(LOOPBACK, store_port, is_master=False, timeout=timeout)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world, timeout=timeout,
        device_id=device if backend == "nccl" else None,
    )
    device_group = dist.group.WORLD
    # The step broadcasts' group, with the same timeout: new_group's own default (gloo's 30
    # minutes) would let a hung rank keep rank 0 waiting that long.
    cpu_group = (device_group if backend == "gloo"
                 else dist.new_group(backend="gloo", timeout=timeout))
    return TPGroup(rank, world, device_group, cpu_group)


def leave_group() -> None:
    """Tear down this process's group (after `stop`, or after a failure). The other ranks are
    not told: gloo closes its sockets only when this process exits."""
    if dist.is_initialized():
        dist.destroy_process_group()


# --- the schedule broadcast ----------------------------------------------------------------
#
# One step is two broadcasts from rank 0 over the cpu group: a header [layout ints, staged
# ints] (or [-1, -1]: stop), then one int64 tensor holding the encoded layout followed by the
# staged ints themselves. The receivers size the second from the first.


def encode_layout(layout: BatchLayout) -> list[int]:
    """The layout as ints: counts, then every segment's bounds (and the decode table's shape)."""
    ints = [len(layout.spans), int(layout.decode is not None)]
    for segment in (layout.input_ids, layout.positions, layout.slots, layout.last_rows):
        ints += [segment.start, segment.end]
    for start, end, context_len, table in layout.spans:
        ints += [start, end, context_len, *((table.start, table.end) if table else (-1, -1))]
    if layout.decode is not None:
        rows, lengths, table = layout.decode
        ints += [rows.start, rows.end, lengths.start, lengths.end, table.start, table.end,
                 *table.shape]
    return ints


def decode_layout(ints: list[int]) -> BatchLayout:
    it = iter(ints)
    num_spans, has_decode = next(it), next(it)
    inputs = [_segment(it) for _ in range(4)]
    spans: list[Span] = []
    for _ in range(num_spans):
        start, end, context_len, table_start, table_end = (next(it) for _ in range(5))
        table = None if table_start < 0 else Segment(table_start, table_end,
                                                    (table_end - table_start,))
        spans.append((start, end, context_len, table))
    decode = None
    if has_decode:
        rows, lengths = _segment(it), _segment(it)
        start, end, num_rows, width = (next(it) for _ in range(4))
        decode = (rows, lengths, Segment(start, end, (num_rows, width)))
    assert next(it, None) is None, "layout has trailing ints"
    return BatchLayout(*inputs, spans=spans, decode=decode)


def _segment(it: Iterator[int]) -> Segment:
    start, end = next(it), next(it)
    return Segment(start, end, (end - start,))


def _broadcast(
    tensor: torch.Tensor, group: dist.ProcessGroup, timeout: datetime.timedelta | None = None
) -> None:
    """Broadcast from the group's rank 0; `timeout` overrides the group's for this call only."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    if timeout is not None:
        opts.timeout = timeout
    group.broadcast([tensor], opts).wait()


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host buffer on the talker's device; pinned on CUDA, so the copy does not block."""
    return host.to(device, non_blocking=True) if device.type == "cuda" else host


class TPModelRunner(ModelRunner):
    """Rank 0's runner: `ModelRunner.execute` over a shard, with each step shared first.

    The other ranks must be in `follow` with their shards; call `stop` to let them return.
    `execute` and `stop` must come from one thread at a time (the talker stage's, or after it
    has ended): two broadcasts at once on one group would interleave.
    """

    def __init__(
        self, talker: Talker, kv_cache: KVCache, device: torch.device, group: TPGroup
    ) -> None:
        if group.rank != 0:
            raise ValueError(f"TPModelRunner runs on rank 0, not rank {group.rank}: use follow()")
        super().__init__(talker, kv_cache, device)
        self.group = group
        self.stopped = False

    def execute(self, output: SchedulerOutput) -> list[int]:
        """Send the step to the other ranks, run this shard, sample from the replicated logits."""
        if self.stopped:
            raise RuntimeError("the tensor-parallel group was stopped")
        staging, layout = self.stage_batch(output)
        layout_ints = encode_layout(layout)
        _broadcast(torch.tensor([len(layout_ints), len(staging.values)]), self.group.cpu_group)
        message = torch.tensor(layout_ints + staging.values, dtype=torch.long,
                               pin_memory=self.device.type == "cuda")
        _broadcast(message, self.group.cpu_group)
        self.busy.begin()  # after the host-side broadcasts: the GPU has nothing of ours before
        staged = _to_device(message[len(layout_ints):], self.device)
        batch = assemble_batch(staged, layout, self.page_size)
        return self.sample_codes(output, self.talker(batch, self.kv_cache.k, self.kv_cache.v))

    def stop(self) -> None:
        """End the followers' loops (idempotent). The group stays up until `leave_group`."""
        if not self.stopped:
            self.stopped = True
            _broadcast(torch.tensor([_STOP, _STOP]), self.group.cpu_group)


def receive_step(group: TPGroup, device: torch.device, page_size: int) -> FlatBatch | None:
    """The next step rank 0 sent, as a FlatBatch on `device`; None once rank 0 has stopped."""
    header = torch.empty(2, dtype=torch.long)
    _broadcast(header, group.cpu_group, IDLE_WAIT)
    num_layout, num_staged = header.tolist()
    if num_layout == _STOP:
        return None
    message = torch.empty(num_layout + num_staged, dtype=torch.long,
                          pin_memory=device.type == "cuda")
    _broadcast(message, group.cpu_group)
    layout = decode_layout(message[:num_layout].tolist())
    return assemble_batch(_to_device(message[num_layout:], device), layout, page_size)


def follow(talker: Talker, kv_cache: KVCache, device: torch.device, group: TPGroup) -> int:
    """A rank ≥ 1's loop: run each step rank 0 broadcasts until it stops; returns the steps.

    The shard's all-reduces pair with rank 0's. Its logits are computed and dropped (the
    lm_head is replicated and small; only rank 0 samples).
    """
    if group.rank == 0:
        raise ValueError("rank 0 drives the group with TPModelRunner; follow() is for the others")
    steps = 0
    while (batch := receive_step(group, device, kv_cache.spec.page_size)) is not None:
        talker(batch, kv_cache.k, kv_cache.v)
        steps += 1
    return steps
