"""The talker as a tensor-parallel group: shard shapes and numerics in one process, then a real
two-rank gloo group on the CPU (rank 0 here, rank 1 a subprocess) against one process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import psutil
import pytest
import torch
from torch.distributed import TCPStore

from omni_dp.engine import tensor_parallel
from omni_dp.engine.config import PRESETS
from omni_dp.engine.kv_cache import KVCache, plan_kv_cache
from omni_dp.engine.model import Attention, GatedMLP
from omni_dp.engine.runner import ModelRunner, assemble_batch
from omni_dp.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput, TalkerRequest
from omni_dp.engine.tensor_parallel import (
    TPModelRunner,
    decode_layout,
    encode_layout,
    join_group,
    leave_group,
    open_store,
    rank_kv_spec,
    shard_talker,
)
from omni_dp.engine.weights import seeded_models

from support.talker import CFG as SMALL_CFG
from support.tp_rank import TESTS_DIR, RankSpec

TINY = PRESETS["tiny"]
SEED = 7
PAGE = 4
NUM_PAGES = 10  # small enough that the live run preempts and recomputes a request
# float64 all the way: the shards' all-reduce sums the same products in another order, which
# moves logits by a few ulps (~1e-15 here). 1e-9 is far above that and far below any real
# difference (a wrong slice or a missed reduction moves logits by ~1e-2 or more).
LOGIT_ATOL = 1e-9
GROUP_TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def tiny_talker():
    torch.set_num_threads(1)
    return seeded_models(TINY, SEED).talker.to(torch.float64)


def kv_spec(cfg, num_pages=NUM_PAGES):
    return plan_kv_cache(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                         head_dim=cfg.head_dim, dtype=torch.float64, page_size=PAGE,
                         max_total_tokens=num_pages * PAGE)


def prompt(cfg, length, offset=0):
    return [cfg.first_speaker_id + offset % cfg.num_speakers, cfg.bos_text_id,
            *[(17 * i + 5 + offset) % 256 for i in range(length - 2)]]


# --- pure: shapes, slices, layout -----------------------------------------------------------


def test_world_2_shards_of_tiny_have_half_the_heads_and_mlp(tiny_talker):
    d, hidden, inner = TINY.head_dim, TINY.hidden_size, TINY.intermediate_size
    assert (TINY.num_heads, TINY.num_kv_heads) == (4, 2)
    full = tiny_talker.layers[1]
    for rank in range(2):
        shard = shard_talker(tiny_talker, rank, 2)
        assert shard.cfg == TINY and (shard.tp_rank, shard.tp_world) == (rank, 2)
        assert not any(p.is_meta for p in shard.parameters())
        layer = shard.layers[1]
        assert (layer.attn.num_heads, layer.attn.num_kv_heads) == (2, 1)
        assert layer.attn.qkv_proj.weight.shape == ((2 + 1 + 1) * d, hidden)
        assert layer.attn.o_proj.weight.shape == (hidden, 2 * d)
        assert layer.mlp.gate_up_proj.weight.shape == (inner, hidden)  # 2 × inner / 2
        assert layer.mlp.down_proj.weight.shape == (hidden, inner // 2)
        # [q | k | v]: this rank's query heads, then its kv head of k, then of v.
        qkv, q = full.attn.qkv_proj.weight, 4 * d
        expected = torch.cat([qkv[rank * 2 * d : (rank + 1) * 2 * d],
                              qkv[q + rank * d : q + (rank + 1) * d],
                              qkv[q + 2 * d + rank * d : q + 2 * d + (rank + 1) * d]])
        assert torch.equal(layer.attn.qkv_proj.weight, expected)
        # [gate | up]: this rank's half of each.
        gate_up, half = full.mlp.gate_up_proj.weight, inner // 2
        expected = torch.cat([gate_up[rank * half : (rank + 1) * half],
                              gate_up[inner + rank * half : inner + (rank + 1) * half]])
        assert torch.equal(layer.mlp.gate_up_proj.weight, expected)
        assert torch.equal(layer.attn.o_proj.weight,
                           full.attn.o_proj.weight[:, rank * 2 * d : (rank + 1) * 2 * d])
        assert torch.equal(layer.mlp.down_proj.weight,
                           full.mlp.down_proj.weight[:, rank * half : (rank + 1) * half])
        # Replicated, as copies: equal, but not the unsharded model's storage.
        assert torch.equal(shard.lm_head.weight, tiny_talker.lm_head.weight)
        assert shard.embed.weight.data_ptr() != tiny_talker.embed.weight.data_ptr()
    assert tiny_talker.layers[1].attn.num_heads == 4  # the unsharded talker is untouched


def test_world_3_is_refused_naming_the_numbers(tiny_talker):
    with pytest.raises(ValueError, match=r"num_heads = 4 .* by 3; num_kv_heads = 2 .* by 3"):
        shard_talker(tiny_talker, 0, 3)


def test_a_rank_kv_cache_keeps_pages_and_capacity_with_its_heads_only():
    full = kv_spec(TINY)
    spec = rank_kv_spec(full, 2)
    assert spec.num_kv_heads == 1
    assert (spec.num_pages, spec.page_size, spec.max_total_tokens) == (
        full.num_pages, full.page_size, full.max_total_tokens)
    assert spec.cache_bytes * 2 == full.cache_bytes


def test_the_store_listens_on_a_kernel_chosen_loopback_port_only():
    stores = [open_store() for _ in range(2)]
    ports = [port for _, port in stores]
    assert len(set(ports)) == 2 and 0 not in ports
    listening = {c.laddr for c in psutil.Process().net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN}
    assert {(addr.ip, addr.port) for addr in listening if addr.port in ports} == {
        ("127.0.0.1", port) for port in ports}
    store, port = stores[0]
    client = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))
    client.set("rank1", "here")
    assert store.get("rank1") == b"here"


def mixed_step(cfg):
    """A step with one prefill beside two decodes (different context lengths)."""
    a = TalkerRequest("a", prompt(cfg, 9), 8, 1, cfg.first_code_id)
    b = TalkerRequest("b", prompt(cfg, 6, 3), 8, 2, cfg.first_code_id)
    c = TalkerRequest("c", prompt(cfg, 3, 5), 8, 3, cfg.first_code_id)
    a.pages, b.pages, c.pages = [5, 0, 9], [3, 7], [8]
    a.num_computed_tokens, c.num_computed_tokens = 8, 2
    return SchedulerOutput([ScheduledRequest(a, 1), ScheduledRequest(b, 6),
                            ScheduledRequest(c, 1)], [])


def test_a_layout_survives_its_int_encoding(tiny_talker):
    runner = ModelRunner(tiny_talker, KVCache(kv_spec(TINY), torch.device("cpu")),
                         torch.device("cpu"))
    output = mixed_step(TINY)
    staging, layout = runner.stage_batch(output)
    assert layout.decode is not None and any(t is not None for *_, t in layout.spans)
    assert decode_layout(encode_layout(layout)) == layout
    rebuilt = assemble_batch(torch.tensor(staging.values), decode_layout(encode_layout(layout)),
                             PAGE)
    direct = runner.build_batch(output)
    for name in ("input_ids", "positions", "slots", "last_rows"):
        assert torch.equal(getattr(rebuilt, name), getattr(direct, name))
    assert torch.equal(rebuilt.decode.mask, direct.decode.mask)
    assert torch.equal(rebuilt.decode.page_table, direct.decode.page_table)


def test_rank_partial_outputs_sum_to_the_unsharded_layer():
    # One process, no group: each rank's attention and MLP before their all-reduce (the parent
    # class's forward), summed here as the all-reduce would.
    generator = torch.Generator().manual_seed(0)
    cfg = SMALL_CFG
    full = seeded_models(cfg, 3).talker.to(torch.float64)
    shards = [shard_talker(full, rank, 2) for rank in range(2)]
    output = mixed_step(cfg)
    cpu = torch.device("cpu")
    full_cache = KVCache(kv_spec(cfg), cpu)
    rank_caches = [KVCache(rank_kv_spec(kv_spec(cfg), 2), cpu) for _ in shards]
    batch = ModelRunner(full, full_cache, cpu).build_batch(output)
    x = torch.randn(len(batch.input_ids), cfg.hidden_size, dtype=torch.float64,
                    generator=generator)
    rope = full.rope.tables(batch.positions, torch.float64)
    with torch.no_grad():
        # The decoding rows read context they did not write this step: the same in every cache.
        full_cache.k.normal_(generator=generator)
        full_cache.v.normal_(generator=generator)
        for rank, cache in enumerate(rank_caches):
            cache.k.copy_(full_cache.k.chunk(2, dim=3)[rank])
            cache.v.copy_(full_cache.v.chunk(2, dim=3)[rank])
        expected = Attention.forward(full.layers[0].attn, x, batch, rope, full_cache.k[0],
                                     full_cache.v[0])
        summed = sum(Attention.forward(s.layers[0].attn, x, batch, rope, c.k[0], c.v[0])
                     for s, c in zip(shards, rank_caches, strict=True))
        torch.testing.assert_close(summed, expected, rtol=0, atol=LOGIT_ATOL)
        # Each rank wrote its own kv head of this step's keys.
        for rank, cache in enumerate(rank_caches):
            written = full_cache.k[0].flatten(0, 1)[batch.slots]
            torch.testing.assert_close(cache.k[0].flatten(0, 1)[batch.slots],
                                       written[:, rank : rank + 1], rtol=0, atol=LOGIT_ATOL)
        mlp = sum(GatedMLP.forward(s.layers[0].mlp, x) for s in shards)
        torch.testing.assert_close(mlp, full.layers[0].mlp(x), rtol=0, atol=LOGIT_ATOL)


# --- live: two ranks over gloo ------------------------------------------------------------


class Recording:
    """Wraps a talker: records each call's logits (the runner's only view of them)."""

    def __init__(self, talker):
        self.talker, self.cfg, self.logits = talker, talker.cfg, []

    def __call__(self, batch, k_caches, v_caches):
        logits = self.talker(batch, k_caches, v_caches)
        self.logits.append(logits.clone())
        return logits


def generate(runner, recording):
    """Three requests arriving at steps 0, 2 and 4 through a real scheduler: prefills beside
    decodes, and a pool small enough to preempt. Returns codes by id and step times."""
    scheduler = Scheduler(runner.kv_cache.spec, end_of_audio=TINY.end_of_audio,
                          max_running_requests=4)
    specs = [("x", prompt(TINY, 7), 0, 11), ("y", prompt(TINY, 12, 2), 2, 22),
             ("z", prompt(TINY, 5, 5), 4, 33)]
    requests, times, step = {}, [], 0
    while len(requests) < len(specs) or scheduler.has_requests():
        for request_id, ids, arrival, seed in specs:
            if arrival == step:
                requests[request_id] = TalkerRequest(request_id, ids, 10, seed,
                                                     TINY.first_code_id)
                scheduler.add_request(requests[request_id])
        output = scheduler.schedule()
        if not output.is_empty:
            start = time.perf_counter()
            codes = runner.execute(output)
            times.append(time.perf_counter() - start)
            scheduler.update_from_output(output, codes)
        step += 1
        assert step < 200
    assert len(recording.logits) == len(times)
    return {rid: r.output_codes for rid, r in requests.items()}, times, scheduler


def start_rank_1(port):
    spec = RankSpec(rank=1, world=2, store_port=port, model="tiny", seed=SEED, dtype="float64",
                    device="cpu", page_size=PAGE, num_pages=NUM_PAGES, timeout_s=GROUP_TIMEOUT_S)
    return subprocess.Popen(spec.command(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


@pytest.fixture
def rank_1(monkeypatch):
    """Rank 1 of a group whose rank 0 is this process, started before it joins; reaped after."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # join_group sets it; restored after
    store, port = open_store()
    process = start_rank_1(port)
    yield store, port, process
    leave_group()
    if process.poll() is None:
        process.kill()
    process.wait(timeout=10)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_two_gloo_ranks_sample_the_codes_one_process_samples(tiny_talker, rank_1):
    _, port, process = rank_1
    cpu = torch.device("cpu")
    alone = ModelRunner(Recording(tiny_talker), KVCache(kv_spec(TINY), cpu), cpu)
    codes_alone, times_alone, scheduler = generate(alone, alone.talker)
    assert scheduler.num_preemptions_total > 0

    group = join_group(0, 2, port, "gloo", GROUP_TIMEOUT_S)
    shard = shard_talker(tiny_talker, 0, 2, group.device_group)
    tp = TPModelRunner(Recording(shard), KVCache(rank_kv_spec(kv_spec(TINY), 2), cpu), cpu,
                       group)
    codes_tp, times_tp, _ = generate(tp, tp.talker)
    tp.stop()
    out, _ = process.communicate(timeout=GROUP_TIMEOUT_S)
    assert process.returncode == 0, out
    assert f"{len(times_tp)} steps" in out  # rank 1 ran every step, then stopped

    assert codes_tp == codes_alone
    assert sum(map(len, codes_alone.values())) >= 20
    diff = max((a - b).abs().max().item()
               for a, b in zip(alone.talker.logits, tp.talker.logits, strict=True))
    print(f"\n{len(times_tp)} steps; max |logit diff| {diff:.2e}; step time: "
          f"1 process {1e3 * sorted(times_alone)[len(times_alone) // 2]:.2f} ms, "
          f"2 ranks {1e3 * sorted(times_tp)[len(times_tp) // 2]:.2f} ms (medians)")
    assert diff < LOGIT_ATOL


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_dead_rank_fails_rank_0s_next_step_without_waiting_for_the_timeout(tiny_talker,
                                                                             rank_1):
    _, port, process = rank_1
    cpu = torch.device("cpu")
    group = join_group(0, 2, port, "gloo", GROUP_TIMEOUT_S)
    tp = TPModelRunner(shard_talker(tiny_talker, 0, 2, group.device_group),
                       KVCache(rank_kv_spec(kv_spec(TINY), 2), cpu), cpu, group)
    output = mixed_step(TINY)
    tp.execute(output)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=10)
    start = time.monotonic()
    with pytest.raises(RuntimeError):  # gloo: "Connection closed by peer" or a failed send
        tp.execute(output)
    assert time.monotonic() - start < GROUP_TIMEOUT_S / 2


# Rank 0 in a process of its own, which dies after one step. (Leaving the group is not the
# same: gloo keeps its sockets open until the process exits, so a follower would wait on.)
RANK_0_THEN_DIE = """
import os, signal, sys, torch
from omni_dp.engine.scheduler import ScheduledRequest, SchedulerOutput, TalkerRequest
sys.path.insert(0, sys.argv[2])  # the tests directory: support.tp_rank
from omni_dp.engine import tensor_parallel as tp
from support.tp_rank import RankSpec, build_shard, rank_kv_cache
spec = RankSpec(**__import__("json").loads(sys.argv[1]))
group = tp.join_group(0, spec.world, spec.store_port, spec.backend, spec.timeout_s)
shard = build_shard(spec, group.device_group)
runner = tp.TPModelRunner(shard, rank_kv_cache(shard.cfg, spec), torch.device("cpu"), group)
request = TalkerRequest("r", [shard.cfg.bos_text_id] * 5, 4, 0, shard.cfg.first_code_id)
request.pages = [0, 1]
runner.execute(SchedulerOutput([ScheduledRequest(request, 5)], []))
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_rank_1_fails_at_once_when_rank_0_dies_while_it_waits(rank_1):
    _, port, process = rank_1
    spec = RankSpec(rank=0, world=2, store_port=port, model="tiny", seed=SEED, dtype="float64",
                    device="cpu", page_size=PAGE, num_pages=NUM_PAGES, timeout_s=GROUP_TIMEOUT_S)
    rank_0 = subprocess.Popen([sys.executable, "-c", RANK_0_THEN_DIE, spec.to_json(), TESTS_DIR])
    try:
        assert rank_0.wait(timeout=GROUP_TIMEOUT_S) == -signal.SIGKILL
    finally:
        if rank_0.poll() is None:
            rank_0.kill()
            rank_0.wait()
    start = time.monotonic()
    out, _ = process.communicate(timeout=GROUP_TIMEOUT_S)
    # Neither IDLE_WAIT nor the group's timeout: the closed connection wakes it.
    assert time.monotonic() - start < GROUP_TIMEOUT_S / 2
    assert process.returncode != 0 and "RuntimeError" in out, out


def test_an_nccl_rank_binds_its_gpu_and_its_step_group_keeps_the_timeout(monkeypatch):
    """On GPUs (not runnable here: TEST STAND-INS for torch.distributed's group calls record
    what they are given): the NCCL group is bound to the rank's device and bootstraps on
    loopback, and the gloo group of the step broadcasts times out as the NCCL one does, not
    after gloo's default half hour."""
    made: list[tuple[str, dict]] = []
    monkeypatch.setattr(tensor_parallel.dist, "init_process_group",
                        lambda backend, **kwargs: made.append((backend, kwargs)))
    monkeypatch.setattr(tensor_parallel.dist, "new_group",
                        lambda **kwargs: made.append(("new_group", kwargs)) or "gloo group")
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(name, raising=False)
    store, port = open_store()
    group = join_group(1, 2, port, "nccl", 7.0, device=torch.device("cuda", 1))
    assert [what for what, _ in made] == ["nccl", "new_group"]
    init, step_group = made[0][1], made[1][1]
    assert init["device_id"] == torch.device("cuda", 1)
    assert init["timeout"] == timedelta(seconds=7.0)
    assert step_group == {"backend": "gloo", "timeout": timedelta(seconds=7.0)}
    assert group.cpu_group == "gloo group" and (group.rank, group.world) == (1, 2)
    assert os.environ["NCCL_SOCKET_IFNAME"] == os.environ["GLOO_SOCKET_IFNAME"] == "lo"
    del store
