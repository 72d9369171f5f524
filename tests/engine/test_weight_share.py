"""Shared backbone weights, in one process: the policy, the plan, the identity, a leader's
export and a follower's attachment, and every way a follower refuses (fail closed).

The leader is this test process (its manifest names it, alive); the followers are models
attached here too, except where a write must kill one (a subprocess).
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import torch
from click.testing import CliRunner

from omni_dp.engine.config import ARCHITECTURE, PRESETS
from omni_dp.engine.kv_cache import KVCache, plan_kv_cache
from omni_dp.engine.model import FlatBatch, SequenceSlice
from omni_dp.engine.options import ServeOptions
from omni_dp.engine.plan import ServePlanError, plan_serve, plan_summary
from omni_dp.engine.server import build_models
from omni_dp.engine.share import ShareError
from omni_dp.engine.share import policy as policy_module
from omni_dp.engine.share.attach import attach
from omni_dp.engine.share.export import publish
from omni_dp.engine.share.identity import model_identity
from omni_dp.engine.share.layout import buffer_per_dtype, lay_out
from omni_dp.engine.share.policy import PolicyError, policy_for
from omni_dp.engine.share.segment import map_segment
from omni_dp.engine.share.tensors import named_tensors
from omni_dp.engine.share.verify import check_manifest, expected_of
from omni_dp.engine.share.watch import LeaderWatch
from omni_dp.engine.weights import meta_models, save_models, seeded_models
from omni_dp.procs import identify, is_alive
from omni_dp.sharefile import (
    ALIGN,
    MANIFEST_FILE,
    SEGMENT_FILE,
    Buffer,
    CudaIpcHandle,
    read_manifest,
    write_manifest,
)

from support.talker import PIPELINE
from support.wait import wait_for


def plan_for(role, share_dir, model="tiny", **options):
    options = {"device": "cpu", "threads": 1, "max_total_tokens": 256, **options}
    return plan_serve(ServeOptions(
        model=str(model), share_weights=role,
        share_dir=None if share_dir is None else str(share_dir), **options))


def talker_logits(models) -> torch.Tensor:
    """One prefill of a short prompt through the talker, over a KV pool of its own."""
    cfg = models.cfg
    ids = [cfg.bos_text_id, 72, 105, cfg.eos_text_id, cfg.first_speaker_id, cfg.bos_audio_id]
    n = len(ids)
    dtype = models.talker.embed.weight.dtype
    spec = plan_kv_cache(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                         head_dim=cfg.head_dim, dtype=dtype, page_size=16, max_total_tokens=32)
    kv = KVCache(spec, torch.device("cpu"))
    batch = FlatBatch(input_ids=torch.tensor(ids), positions=torch.arange(n),
                      slots=torch.arange(n), last_rows=torch.tensor([n - 1]),
                      sequences=[SequenceSlice(0, n, n, torch.tensor([0]))])
    return models.talker(batch, kv.k, kv.v)


def outputs(models) -> tuple[torch.Tensor, torch.Tensor]:
    codes = torch.arange(30) % models.cfg.codebook_size
    return talker_logits(models), models.vocoder(codes)


@pytest.fixture(scope="module")
def unit_dir(tmp_path_factory):
    """The small unit model as a weights directory (so its identity is its files' bytes)."""
    directory = tmp_path_factory.mktemp("unit") / "model"
    save_models(seeded_models(PIPELINE, 7), directory)
    return directory


@pytest.fixture
def published(tmp_path, unit_dir, monkeypatch):
    """A leader (this process) that published the unit model in a fresh share directory."""
    torch.set_num_threads(1)
    monkeypatch.delenv("OMNI_DP_RUN_ID", raising=False)  # run id "standalone" on both sides
    share = tmp_path / "share"
    plan = plan_for("leader", share, unit_dir)
    models = build_models(plan)
    info = publish(plan, models, share)
    return share, models, info


def follower_plan(share, unit_dir, **options):
    return plan_for("follower", share, unit_dir, **options)


def refused(share, unit_dir, **options) -> str:
    with pytest.raises(ShareError) as caught:
        attach(follower_plan(share, unit_dir, **options), share)
    return str(caught.value)


def rewrite(share, **changes) -> None:
    write_manifest(share, dataclasses.replace(read_manifest(share), **changes))


# --- the policy -------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_every_tensor_of_the_presets_is_declared_once(preset):
    models = meta_models(PRESETS[preset], torch.float32)
    tensors = named_tensors(models)
    shared, private = policy_for(ARCHITECTURE).split(tensors)
    assert sorted(shared + private) == sorted(tensors)
    assert not set(shared) & set(private)
    assert {"talker.embed.weight", "talker.lm_head.weight", "vocoder.ups.0.weight",
            "talker.layers.0.attn.qkv_proj.weight"} <= set(shared)
    assert {"talker.norm.weight", "talker.layers.0.input_norm.weight", "vocoder.post.bias"} \
        <= set(private)
    shared_bytes = sum(tensors[n].numel() * tensors[n].element_size() for n in shared)
    all_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    assert shared_bytes > 0.99 * all_bytes  # the backbone is what is shared


def test_a_new_parameter_forces_a_decision():
    models = meta_models(PIPELINE, torch.float32)
    models.talker.register_parameter("gate", torch.nn.Parameter(torch.zeros(3, device="meta")))
    with pytest.raises(PolicyError, match=r"talker\.gate is matched by no pattern"):
        policy_for(ARCHITECTURE).split(named_tensors(models))


def test_a_name_matched_twice_is_an_error():
    policy = policy_for(ARCHITECTURE)
    doubled = dataclasses.replace(policy, shared=(*policy.shared, r"talker\.norm\.weight"))
    with pytest.raises(PolicyError, match=r"talker\.norm\.weight is matched by shared .* and "
                                          r"private"):
        doubled.split(named_tensors(meta_models(PIPELINE, torch.float32)))


def test_an_architecture_without_a_policy_cannot_share(monkeypatch, tmp_path):
    with pytest.raises(PolicyError, match="architecture other has no tested weight-share "
                                          "policy; run without --share-weights"):
        policy_for("other")
    monkeypatch.setattr(policy_module, "POLICIES", {})
    with pytest.raises(ServePlanError, match=f"architecture {ARCHITECTURE} has no tested"):
        plan_for("leader", tmp_path / "share")
    from omni_dp.cli import serve

    result = CliRunner().invoke(serve, ["--device", "cpu", "--share-weights", "follower",
                                        "--share-dir", str(tmp_path / "share"), "--dry-run"])
    assert result.exit_code == 2
    assert "has no tested weight-share policy" in result.output
    # Without sharing, the dry run says nothing would be shared.
    summary = plan_summary(plan_for(None, None))
    assert summary["shared_weights_bytes"] == 0
    assert summary["private_weights_bytes"] == summary["weights_bytes"]


def test_a_meta_model_loads_no_python_meta_kernels():
    """normal_ and the rotary tables' ops have Python meta kernels whose first use imports
    ~800 modules (sympy, mpmath: ~70 MB per process); a follower or a sharing plan must not."""
    code = ("import sys, torch; from omni_dp.engine.config import PRESETS; "
            "from omni_dp.engine.weights import meta_models; "
            "m = meta_models(PRESETS['small'], torch.float32); "
            "print(m.talker.embed.weight.is_meta, 'sympy' in sys.modules, "
            "'mpmath' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.stdout.split() == ["True", "False", "False"], done.stderr


# --- the plan ---------------------------------------------------------------------------


def test_share_flags_go_together_and_every_problem_is_said(tmp_path):
    with pytest.raises(ServePlanError) as caught:
        plan_for("follower", None)
    assert "--share-weights follower needs --share-dir" in str(caught.value)
    with pytest.raises(ServePlanError, match="--share-dir needs --share-weights"):
        plan_for(None, tmp_path)
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    os.chmod(open_dir, 0o755)
    with pytest.raises(ServePlanError) as caught:
        plan_for("leader", open_dir, threads=0)
    assert len(caught.value.problems) == 2  # the threads and the directory, together
    assert f"--share-dir: {open_dir} has mode 755" in str(caught.value)
    assert not (open_dir / MANIFEST_FILE).exists()  # planning created nothing


def test_a_share_dir_that_is_a_symlink_is_refused_in_words_of_its_own(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(ServePlanError) as caught:
        plan_for("leader", link)
    assert caught.value.problems == [
        f"--share-dir: {link} is a symlink; it must be a real, private directory"]


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_the_dry_run_says_what_sharing_would_keep_once(tmp_path, dtype):
    summary = plan_summary(plan_for("leader", tmp_path / "share", dtype=dtype))
    assert summary["share_weights"] == "leader"
    assert summary["shared_weights_bytes"] + summary["private_weights_bytes"] \
        == summary["weights_bytes"]
    models = build_models(plan_for("leader", tmp_path / "share", dtype=dtype))
    info = publish(plan_for("leader", tmp_path / "share", dtype=dtype), models, tmp_path / "share")
    assert (info.shared_bytes, info.private_bytes) == (
        summary["shared_weights_bytes"], summary["private_weights_bytes"])
    assert plan_summary(plan_for(None, None))["share_weights"] is None


def test_a_sharing_dry_run_builds_the_meta_models_once(tmp_path, monkeypatch):
    from omni_dp.engine import weights as weights_module

    plan = plan_for("leader", tmp_path / "share")
    assert plan.weights is not None and plan.weights.share_problem is None

    def no_second_build(*args, **kwargs):
        raise AssertionError("the summary built the meta models again")

    monkeypatch.setattr(weights_module, "meta_models", no_second_build)
    summary = plan_summary(plan)
    assert (summary["weights_bytes"], summary["shared_weights_bytes"]) == (
        plan.weights.weights_bytes, plan.weights.shared_bytes)


# --- identity and layout ----------------------------------------------------------------


def test_the_model_identity_needs_no_weights_and_follows_seed_and_bytes(tmp_path, unit_dir):
    tiny = model_identity(plan_for(None, None))
    assert tiny == model_identity(plan_for(None, None))
    assert tiny.source == "preset tiny, seed 0"
    assert tiny.digest != model_identity(plan_for(None, None, weight_seed=1)).digest
    copy = tmp_path / "copy"
    shutil.copytree(unit_dir, copy)
    original = model_identity(plan_for(None, None, unit_dir))
    assert original.source == str(unit_dir.resolve())
    assert model_identity(plan_for(None, None, copy)).digest == original.digest
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert model_identity(plan_for(None, None, copy)).digest != original.digest


def test_cuda_layout_is_one_aligned_buffer_per_dtype():
    models = meta_models(PIPELINE, torch.bfloat16)  # talker bfloat16, vocoder float32
    tensors = named_tensors(models)
    shared, private = policy_for(ARCHITECTURE).split(tensors)
    sizes, shared_entries, private_entries = lay_out(
        [(n, tensors[n]) for n in shared], [(n, tensors[n]) for n in private], buffer_per_dtype)
    assert len(sizes) == 2
    for entry in (*shared_entries, *private_entries):
        assert entry.offset % ALIGN == 0
        assert entry.offset + entry.nbytes <= sizes[entry.buffer]
        assert {e.dtype for e in (*shared_entries, *private_entries)
                if e.buffer == entry.buffer} == {entry.dtype}


# --- export and attach ------------------------------------------------------------------


def test_leader_follower_and_a_plain_model_compute_the_same_bytes(tmp_path):
    torch.set_num_threads(1)
    share = tmp_path / "share"
    leader_plan = plan_for("leader", share)
    leader = build_models(leader_plan)
    info = publish(leader_plan, leader, share)
    follower, follower_info = attach(plan_for("follower", share), share)
    plain = build_models(plan_for(None, None))

    assert (share / SEGMENT_FILE).stat().st_mode & 0o777 == 0o400
    assert info.role == "leader" and follower_info.role == "follower"
    assert follower_info.leader == info.leader == identify(os.getpid())
    assert follower_info.tensors_shared == info.tensors_shared == 24
    expected = outputs(plain)
    for got in (outputs(leader), outputs(follower)):
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))

    manifest = read_manifest(share)
    mapping_start = follower.talker.embed.weight.data_ptr()  # the first shared tensor
    size = manifest.buffers[0].nbytes
    followers = named_tensors(follower)
    leaders = named_tensors(leader)
    for entry in manifest.shared:  # views of the one mapping: no copy anywhere
        assert mapping_start <= followers[entry.name].data_ptr() < mapping_start + size
        assert leaders[entry.name].data_ptr() != followers[entry.name].data_ptr()  # 2 maps
    for entry in manifest.private:  # copies of its own
        ptr = followers[entry.name].data_ptr()
        assert not mapping_start <= ptr < mapping_start + size
    assert not follower.talker.rope.cos.is_meta
    assert torch.equal(follower.talker.rope.cos, plain.talker.rope.cos)


def test_a_new_leader_replaces_what_an_earlier_one_left_but_nothing_else(published,
                                                                         unit_dir):
    share, _, _ = published
    before = read_manifest(share).created_at
    plan = plan_for("leader", share, unit_dir)
    publish(plan, build_models(plan), share)  # the leftover segment and manifest replaced
    assert read_manifest(share).created_at > before
    attach(follower_plan(share, unit_dir), share)
    segment = share / SEGMENT_FILE
    segment.unlink()
    segment.symlink_to(share / MANIFEST_FILE)
    with pytest.raises(ShareError, match="exists and is not a weight-share segment of ours"):
        publish(plan, build_models(plan), share)


NO_IPC_ALLOCATORS = [
    ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True", "enables expandable_segments"),
    ("PYTORCH_ALLOC_CONF", "max_split_size_mb:64, expandable_segments:true",
     "enables expandable_segments"),
    ("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync", "selects backend:cudaMallocAsync"),
    ("PYTORCH_ALLOC_CONF", "max_split_size_mb:64, backend: cudaMallocAsync",
     "selects backend:cudaMallocAsync"),
]


@pytest.mark.parametrize(("env", "value", "reason"), NO_IPC_ALLOCATORS)
def test_a_cuda_leader_refuses_an_allocator_without_ipc_handles(monkeypatch, env, value,
                                                                reason):
    from omni_dp.engine.share.cuda_ipc import exportable_problem

    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    assert exportable_problem() is None
    monkeypatch.setenv(env, "expandable_segments:False,backend:native")
    assert exportable_problem() is None
    monkeypatch.setenv(env, value)
    problem = exportable_problem()
    assert problem is not None and re.search(f"{env} {reason}", problem), problem


@pytest.mark.parametrize(("env", "value", "reason"), NO_IPC_ALLOCATORS)
def test_the_plan_of_a_cuda_leader_refuses_it_before_anything_starts(monkeypatch, tmp_path,
                                                                     env, value, reason):
    """Planning reads the environment only: a device faked as CUDA is enough (exit 2)."""
    from omni_dp.cli import serve
    from omni_dp.engine import plan as plan_module

    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(plan_module, "_resolve_device",
                        lambda name, problems: torch.device("cuda", 0))
    monkeypatch.setattr(plan_module, "_check_memory", lambda kv, device, problems: None)
    share = tmp_path / "share"
    assert plan_for("leader", share).device.type == "cuda"
    monkeypatch.setenv(env, value)
    with pytest.raises(ServePlanError) as caught:
        plan_for("leader", share)
    [problem] = caught.value.problems
    assert problem.startswith(f"--share-weights leader: {env} {reason}")
    plan_for("follower", share)  # a follower exports nothing
    plan_for(None, None)
    result = CliRunner().invoke(serve, ["--device", "cuda", "--share-weights", "leader",
                                        "--share-dir", str(share), "--dry-run"])
    assert result.exit_code == 2, result.output
    assert f"--share-weights leader: {env} {reason}" in result.output
    assert not share.exists()


# --- fail closed ------------------------------------------------------------------------


def test_a_follower_of_another_model_refuses(published, tmp_path, unit_dir):
    share, _, _ = published
    other = tmp_path / "other"
    save_models(seeded_models(PIPELINE, 8), other)
    with pytest.raises(ShareError) as caught:
        attach(follower_plan(share, other), share)
    assert (f"the model digest differs: the leader's is {unit_dir.resolve()} (sha256 "
            in str(caught.value))
    assert f"this follower's is {other.resolve()} (sha256 " in str(caught.value)


@pytest.mark.parametrize(("options", "env", "reason"), [
    ({"dtype": "float32"}, {}, "the talker dtype differs: the leader's is float64, this "
                               "follower's is float32"),
    ({}, {"OMNI_DP_RUN_ID": "another-run"}, "the run id differs: the leader's is standalone, "
                                            "this follower's is another-run"),
])
def test_a_follower_of_another_dtype_or_run_refuses(published, unit_dir, monkeypatch, options,
                                                    env, reason):
    share, _, _ = published
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert reason in refused(share, unit_dir, **options)


def test_a_tensor_of_another_shape_or_dtype_is_refused(published, unit_dir):
    share, _, _ = published
    manifest = read_manifest(share)
    first = manifest.shared[0]
    flat = dataclasses.replace(first, shape=(first.nbytes // 8,))
    rewrite(share, shared=(flat, *manifest.shared[1:]))
    assert (f"tensor {first.name} has shape [{first.nbytes // 8}] at the leader, "
            f"{list(first.shape)} here") in refused(share, unit_dir)
    as_int = dataclasses.replace(first, dtype="int64")
    rewrite(share, shared=(as_int, *manifest.shared[1:]))
    assert f"tensor {first.name} has dtype int64 at the leader, float64 here" \
        in refused(share, unit_dir)


def test_a_tensor_moved_between_the_sets_is_refused(published, unit_dir):
    share, _, _ = published
    manifest = read_manifest(share)
    moved = manifest.shared[0]
    rewrite(share, shared=manifest.shared[1:], private=(moved, *manifest.private))
    assert (f"are not this follower's policy's: {moved.name} is private at the leader, shared "
            "here") in refused(share, unit_dir)


def test_a_manifest_that_is_a_link_open_to_others_or_not_ours_is_refused(
        published, unit_dir, monkeypatch):
    share, _, _ = published
    path = share / MANIFEST_FILE
    os.chmod(path, 0o640)
    assert "has mode 640; group or other users may reach it" in refused(share, unit_dir)
    os.chmod(path, 0o600)
    real = share / "real.json"
    path.rename(real)
    path.symlink_to(real)
    assert "(it is a symlink)" in refused(share, unit_dir)
    path.unlink()
    real.rename(path)
    # Another user's file: we cannot chown without root, so we claim to be someone else.
    owner = os.stat(path).st_uid
    monkeypatch.setattr(os, "geteuid", lambda: owner + 1)
    assert f"belongs to uid {owner}, not to you (uid {owner + 1})" in refused(share, unit_dir)


def test_no_manifest_is_refused(tmp_path, unit_dir):
    share = tmp_path / "empty"
    share.mkdir(mode=0o700)
    assert f"the weight-share manifest {share / MANIFEST_FILE} does not exist" \
        in refused(share, unit_dir)


def test_the_manifest_of_a_gone_leader_is_refused(published, unit_dir):
    share, _, _ = published
    done = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.2)"])
    gone = identify(done.pid)
    done.wait()
    assert gone is not None
    rewrite(share, leader=gone)
    assert f"the leader (pid {gone.pid}) is not running" in refused(share, unit_dir)


def test_a_truncated_or_changed_segment_is_refused(published, unit_dir):
    share, _, _ = published
    segment = share / SEGMENT_FILE
    size = segment.stat().st_size
    os.chmod(segment, 0o600)
    original = segment.read_bytes()
    data = bytearray(original)
    data[size // 2] ^= 0xFF
    segment.write_bytes(bytes(data))
    assert "does not hold what the leader wrote: its sha256 is" in refused(share, unit_dir)
    segment.write_bytes(original)
    os.truncate(segment, size - 64)
    assert f"is truncated: {size - 64} bytes, the manifest says {size}" \
        in refused(share, unit_dir)


@pytest.mark.parametrize(("change", "reason"), [
    ({"device": "GPU-x"}, "the device differs: the leader's is GPU-x, this follower's is cpu"),
    ({"policy": "omni-dp-tts/0"}, "the share policy differs: the leader's is omni-dp-tts/0, "
                                  "this follower's is omni-dp-tts/1"),
])
def test_a_manifest_of_another_device_or_policy_is_refused(published, unit_dir, change, reason):
    share, _, _ = published
    rewrite(share, **change)
    assert reason in refused(share, unit_dir)


def test_a_segment_that_is_a_link_or_larger_than_the_manifest_says_is_refused(published,
                                                                              tmp_path):
    share, _, _ = published
    segment = share / SEGMENT_FILE
    size = read_manifest(share).buffers[0].nbytes
    map_segment(share, size)  # as published: fine
    elsewhere = tmp_path / "elsewhere.bin"
    shutil.copyfile(segment, elsewhere)
    os.chmod(elsewhere, 0o600)  # a file that would pass every other check
    kept = share / "kept.bin"
    segment.rename(kept)
    segment.symlink_to(elsewhere)
    with pytest.raises(ShareError, match=r"cannot open the weight-share segment .*\(it is a "
                                         r"symlink\)"):
        map_segment(share, size)
    segment.unlink()
    kept.rename(segment)
    os.chmod(segment, 0o600)
    with open(segment, "ab") as f:
        f.write(bytes(ALIGN))
    with pytest.raises(ShareError, match=f"is {size + ALIGN} bytes, the manifest says {size}"):
        map_segment(share, size)


def test_a_leader_gone_while_the_follower_attached_is_refused(published, unit_dir):
    """Alive when the manifest is checked, gone once the views are bound."""
    share, _, _ = published
    answers = iter([True, False])
    with pytest.raises(ShareError, match=r"the leader \(pid \d+\) went away while this "
                                         "follower attached"):
        attach(follower_plan(share, unit_dir), share, alive=lambda _: next(answers))


def test_a_shared_tensor_bound_as_a_copy_is_refused(published, unit_dir, monkeypatch):
    """Each shared tensor is proven to lie inside the leader's buffer once it is bound."""
    from omni_dp.engine.share import attach as attach_module
    from omni_dp.engine.share.tensors import bind

    share, _, _ = published
    monkeypatch.setattr(attach_module, "bind",
                        lambda models, name, tensor: bind(models, name, tensor.clone()))
    first = read_manifest(share).shared[0]
    assert f"tensor {first.name} is not a view of the leader's buffer" \
        in refused(share, unit_dir)


def test_a_cpu_follower_refuses_buffers_that_are_not_one_segment(published, unit_dir):
    share, _, _ = published
    nbytes = read_manifest(share).buffers[0].nbytes
    ipc = CudaIpcHandle(0, b"handle", nbytes, 0, b"refcount", 0, b"", False)
    rewrite(share, buffers=(Buffer("cuda_ipc", nbytes, ipc=ipc),))
    assert "the manifest's buffers are ['cuda_ipc']; on cpu a follower needs 1 segment buffer" \
        in refused(share, unit_dir)


def test_a_meta_tensor_left_as_a_plain_attribute_is_refused(published, unit_dir, monkeypatch):
    """Rotary tables left on the meta device (neither parameters nor buffers: no manifest
    entry binds them) would fail only at the first request; the follower refuses at once."""
    from omni_dp.engine.share import attach as attach_module

    share, _, _ = published

    def meta_tables(*args, **kwargs):
        models = meta_models(*args, **kwargs)
        rope = models.talker.rope
        rope.cos = torch.empty_like(rope.cos, device="meta")
        return models

    monkeypatch.setattr(attach_module, "meta_models", meta_tables)
    assert "tensors left unbound after attaching: talker.rope.cos" in refused(share, unit_dir)


def test_the_checks_run_in_order_and_the_leader_is_checked_before_the_tensors(published,
                                                                             unit_dir):
    share, _, _ = published
    plan = follower_plan(share, unit_dir)
    policy = policy_for(ARCHITECTURE)
    models = meta_models(plan.cfg, plan.dtype)
    expected = expected_of(plan, models, policy, model_identity(plan))
    manifest = read_manifest(share)
    check_manifest(manifest, expected)  # as published: fine
    broken = dataclasses.replace(manifest, shared=manifest.shared[1:])
    with pytest.raises(ShareError, match="is not running"):
        check_manifest(broken, expected, alive=lambda _: False)
    with pytest.raises(ShareError, match="architecture differs"):
        check_manifest(dataclasses.replace(broken, architecture="x"), expected,
                       alive=lambda _: False)


# --- a follower cannot write what it maps -------------------------------------------------

_WRITER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from omni_dp.engine.options import ServeOptions
    from omni_dp.engine.plan import plan_serve
    from omni_dp.engine.share.attach import attach

    share = Path(sys.argv[1])
    plan = plan_serve(ServeOptions(device="cpu", threads=1, max_total_tokens=256,
                                   model=sys.argv[2], share_weights="follower",
                                   share_dir=str(share)))
    models, _ = attach(plan, share)
    print("attached", flush=True)
    models.talker.embed.weight.data.add_(1.0)  # a write through a read-only mapping
    print("wrote", flush=True)
""")


def test_a_follower_that_writes_a_shared_tensor_dies_and_nobody_else_sees_it(published,
                                                                             unit_dir):
    share, leader, _ = published
    before = leader.talker.embed.weight.clone()
    second, _ = attach(follower_plan(share, unit_dir), share)
    expected = outputs(second)
    done = subprocess.run([sys.executable, "-c", _WRITER, str(share), str(unit_dir)],
                          capture_output=True, text=True, timeout=120)
    assert "attached" in done.stdout, done.stderr
    assert "wrote" not in done.stdout
    assert done.returncode == -signal.SIGSEGV, done.stderr
    assert torch.equal(leader.talker.embed.weight, before)
    assert all(torch.equal(a, b) for a, b in zip(outputs(second), expected, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(outputs(leader), expected, strict=True))


def _file_mappings(path) -> list[tuple[int, int, str]]:
    """(start, end, permissions) of this process's mappings of `path`."""
    target = str(path.resolve())
    spans = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.rstrip("\n").split(maxsplit=5)
            if len(fields) == 6 and fields[5] == target:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                spans.append((start, end, fields[1]))
    return spans


def test_the_leader_computes_from_its_own_read_only_mapping_of_the_segment(published):
    share, leader, _ = published
    spans = _file_mappings(share / SEGMENT_FILE)
    assert spans and {perms for _, _, perms in spans} == {"r--s"}  # read-only, shared
    tensors = named_tensors(leader)
    manifest = read_manifest(share)
    for entry in (*manifest.shared, *manifest.private):  # the leader keeps no copy of any
        at = tensors[entry.name].data_ptr()
        assert any(start <= at and at + entry.nbytes <= end for start, end, _ in spans), \
            entry.name


_LEADER_WRITER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from omni_dp.engine.options import ServeOptions
    from omni_dp.engine.plan import plan_serve
    from omni_dp.engine.server import build_models
    from omni_dp.engine.share.export import publish

    share = Path(sys.argv[1])
    plan = plan_serve(ServeOptions(device="cpu", threads=1, max_total_tokens=256,
                                   model=sys.argv[2], share_weights="leader",
                                   share_dir=str(share)))
    models = build_models(plan)
    publish(plan, models, share)
    print("published", flush=True)
    models.talker.layers[0].attn.qkv_proj.weight.data.mul_(2.0)  # a shared tensor
    print("wrote", flush=True)
""")


def test_a_leader_that_writes_a_shared_tensor_dies_too(tmp_path, unit_dir):
    share = tmp_path / "share"
    done = subprocess.run([sys.executable, "-c", _LEADER_WRITER, str(share), str(unit_dir)],
                          capture_output=True, text=True, timeout=120)
    assert "published" in done.stdout, done.stderr
    assert "wrote" not in done.stdout
    assert done.returncode == -signal.SIGSEGV, done.stderr


# --- the CUDA path, on the CPU ----------------------------------------------------------


@pytest.fixture
def fake_cuda(tmp_path, monkeypatch):
    """export._publish_cuda and attach._bind_cuda with the device calls faked (buffers are CPU
    tensors; a handle names one of them): (the exported buffers by handle, a plan on the fake
    GPU for a role, the share directory)."""
    from omni_dp.engine.share import attach as attach_module
    from omni_dp.engine.share import export as export_module
    from omni_dp.engine.share import verify as verify_module

    torch.set_num_threads(1)
    monkeypatch.delenv("OMNI_DP_RUN_ID", raising=False)
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    exported: dict[bytes, torch.Tensor] = {}

    def fake_export(flat: torch.Tensor) -> CudaIpcHandle:
        handle = f"buffer {len(exported)}".encode()
        exported[handle] = flat
        return CudaIpcHandle(0, handle, flat.numel(), 0, b"refcount", 0, b"", False)

    def fake_device_name(device: torch.device) -> str:
        return "GPU-fake" if device.type == "cuda" else "cpu"

    monkeypatch.setattr(export_module, "new_buffer",
                        lambda nbytes, device: torch.full((nbytes,), 0xAB, dtype=torch.uint8))
    monkeypatch.setattr(export_module, "export", fake_export)
    monkeypatch.setattr(export_module, "_KEEP", [])
    monkeypatch.setattr(attach_module, "open_buffer", lambda ipc, device: exported[ipc.handle])
    monkeypatch.setattr(export_module, "device_name", fake_device_name)
    monkeypatch.setattr(verify_module, "device_name", fake_device_name)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    gpu = torch.device("cuda", 0)
    share = tmp_path / "share"

    def on_gpu(role):
        return dataclasses.replace(plan_for(role, share, dtype="bfloat16"), device=gpu)

    return exported, on_gpu, share


def test_the_cuda_publish_and_bind_give_views_of_the_right_per_dtype_buffer(fake_cuda):
    """The per-dtype layout, the copies into the buffers, the views bound on both sides, the
    private copies, the same bytes computed."""
    exported, on_gpu, share = fake_cuda
    leader_plan = on_gpu("leader")
    leader = build_models(leader_plan, torch.device("cpu"))  # as leader_build_device says
    publish(leader_plan, leader, share)
    manifest = read_manifest(share)
    assert manifest.device == "GPU-fake"
    assert [b.kind for b in manifest.buffers] == ["cuda_ipc", "cuda_ipc"]
    flats = list(exported.values())
    assert [f.numel() for f in flats] == [b.nbytes for b in manifest.buffers]
    dtypes = [{e.dtype for e in (*manifest.shared, *manifest.private) if e.buffer == i}
              for i in range(2)]
    assert dtypes == [{"bfloat16"}, {"float32"}]  # the talker's, then the vocoder's
    assert not (share / SEGMENT_FILE).exists()

    follower, info = attach(on_gpu("follower"), share)
    assert info.tensors_shared == len(manifest.shared)
    plain = build_models(plan_for(None, None, dtype="bfloat16"))
    expected = outputs(plain)
    for got in (outputs(leader), outputs(follower)):
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))

    def inside(tensor: torch.Tensor, flat: torch.Tensor) -> bool:
        at = tensor.data_ptr()
        return flat.data_ptr() <= at and at + tensor.nbytes <= flat.data_ptr() + flat.numel()

    followers, leaders = named_tensors(follower), named_tensors(leader)
    for entry in manifest.shared:  # a view of its own dtype's buffer, on both sides
        flat = flats[entry.buffer]
        assert inside(followers[entry.name], flat) and inside(leaders[entry.name], flat), \
            entry.name
        assert followers[entry.name].data_ptr() == leaders[entry.name].data_ptr()
    for entry in manifest.private:  # the follower's own copy; the leader's lies in the buffer
        assert not any(inside(followers[entry.name], flat) for flat in flats), entry.name
        assert inside(leaders[entry.name], flats[entry.buffer]), entry.name


def test_a_cuda_buffer_smaller_than_the_manifest_says_is_refused(fake_cuda, monkeypatch):
    from omni_dp.engine.share import attach as attach_module

    exported, on_gpu, share = fake_cuda
    leader_plan = on_gpu("leader")
    publish(leader_plan, build_models(leader_plan, torch.device("cpu")), share)
    nbytes = read_manifest(share).buffers[0].nbytes
    monkeypatch.setattr(attach_module, "open_buffer",
                        lambda ipc, device: exported[ipc.handle][:-1])
    with pytest.raises(ShareError, match=f"the leader's CUDA buffer 0 is {nbytes - 1} bytes, "
                                         f"the manifest says {nbytes}"):
        attach(on_gpu("follower"), share)


# --- the leader watch -------------------------------------------------------------------


@pytest.fixture
def orphan():
    """A process that is not our child (its parent, a shell, has exited), as a follower's
    leader is not the follower's; killed by pid at teardown if the test did not."""
    done = subprocess.run(["sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"],
                          capture_output=True, text=True, timeout=10, check=True)
    identity = identify(int(done.stdout))
    assert identity is not None
    yield identity
    if is_alive(identity):
        os.kill(identity.pid, signal.SIGKILL)


def _no_pidfd(pid: int) -> int:
    raise OSError(errno.ENOSYS, "Function not implemented")


def test_pidfd_of_a_live_a_gone_and_a_recycled_process(orphan):
    from omni_dp.procs import pidfd_of

    fd = pidfd_of(orphan)
    assert fd is not None
    os.close(fd)
    read_end, write_end = os.pipe()  # the write end stands in for the pidfd
    assert pidfd_of(orphan, alive=lambda _: False, pidfd_open=lambda pid: write_end) is None
    assert os.read(read_end, 1) == b""  # EOF: the recycled pid's fd was closed
    os.close(read_end)
    with pytest.raises(OSError) as caught:
        pidfd_of(orphan, pidfd_open=_no_pidfd)
    assert caught.value.errno == errno.ENOSYS  # the caller's fallback decides
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.2)"])
    gone = identify(child.pid)
    child.wait()  # reaped: no such pid
    assert gone is not None and pidfd_of(gone) is None


def test_the_watch_sees_a_leader_that_is_not_its_child_exit_at_once(orphan):
    leader = orphan
    assert leader.pid not in {c.pid for c in psutil.Process().children()}
    called = []
    watch = LeaderWatch(leader, lambda: called.append(time.monotonic()))
    watch.start()
    wait_for("the pidfd", lambda: watch.mode, 5, 0.005)
    assert watch.mode == "pidfd"
    time.sleep(0.05)
    assert called == []  # alive: no call
    killed = time.monotonic()
    os.kill(leader.pid, signal.SIGKILL)
    wait_for("the call", lambda: called, 5, 0.001)
    latency = called[0] - killed
    print(f"leader kill -> on_gone: {latency * 1000:.1f} ms")
    assert latency < 0.1  # a poll every 0.5 s would be 250 ms late on average
    watch.join(5)
    assert called == [called[0]]


def test_a_pid_recycled_before_the_pidfd_was_taken_is_a_gone_leader():
    """The fd names whoever has the pid now: the identity is checked once, after it is taken."""
    calls, checks = [], []

    def recycled(identity):
        checks.append(identity)
        return False

    watch = LeaderWatch(identify(os.getpid()), lambda: calls.append(1), alive=recycled)
    watch.start()
    wait_for("the call", lambda: calls, 5, 0.005)
    assert (watch.mode, len(checks)) == ("pidfd", 1)


def test_an_alive_leader_is_checked_once_not_polled():
    """No repeated create-time comparison (it moves with the wall clock: a clock step would
    make every follower exit 4)."""
    checks, calls = [], []
    watch = LeaderWatch(identify(os.getpid()), lambda: calls.append(1), interval=0.01,
                        alive=lambda identity: checks.append(identity) or True)
    watch.start()
    time.sleep(0.2)  # twenty poll intervals
    watch.stop()
    watch.join(5)
    assert (watch.mode, len(checks), calls) == ("pidfd", 1, [])


def test_without_a_pidfd_the_watch_polls_and_calls_once():
    calls = []
    state = {"alive": True}
    watch = LeaderWatch(identify(os.getpid()), lambda: calls.append(1), interval=0.01,
                        alive=lambda _: state["alive"], pidfd_open=_no_pidfd)
    watch.start()
    time.sleep(0.05)  # a few polls
    assert (watch.mode, calls) == ("poll", [])
    state["alive"] = False
    wait_for("the call", lambda: calls, 5, 0.01)
    state["alive"] = True
    watch.join(5)
    watch.stop()
    assert calls == [1]


@pytest.mark.parametrize("where", ["alive", "pidfd_open"])
def test_a_watch_that_fails_says_the_leader_is_gone(caplog, where):
    """Fail closed: an error in the watch is logged and stops the follower."""
    def broken(_):
        raise RuntimeError("psutil broke")

    calls = []
    kwargs = {"alive": broken} if where == "alive" else {"pidfd_open": broken}
    watch = LeaderWatch(identify(os.getpid()), lambda: calls.append(1), **kwargs)
    with caplog.at_level(logging.ERROR, logger="omni_dp.serve"):
        watch.start()
        wait_for("the call", lambda: calls, 5, 0.005)
    assert "watching the leader (pid" in caplog.text
    assert "RuntimeError: psutil broke" in caplog.text


@pytest.mark.parametrize("pidfd", [True, False])
def test_a_stopped_watch_never_calls_and_its_thread_ends(orphan, pidfd):
    """A clean stop (SIGTERM, exit 0) must not turn into an exit 4 when the leader is
    stopped right after its followers."""
    leader = orphan
    calls = []
    options = {} if pidfd else {"pidfd_open": _no_pidfd, "interval": 0.01}
    watch = LeaderWatch(leader, lambda: calls.append(1), **options)
    watch.start()
    wait_for("the watch", lambda: watch.mode, 5, 0.005)
    watch.stop()
    os.kill(leader.pid, signal.SIGKILL)
    watch.join(5)
    assert not watch._thread.is_alive()  # woken by stop(), not left blocked on the pidfd
    time.sleep(0.05)
    assert calls == []
    watch.stop()  # twice is harmless


def test_a_gone_leader_seen_after_the_loop_closed_does_nothing(tmp_path):
    """The watch thread can outlive run(): by then the exit code is the process's own."""
    from omni_dp.contract import ExitCode
    from omni_dp.engine.server import ReplicaServer, State
    from omni_dp.engine.share import ShareInfo

    server = ReplicaServer(plan_for("follower", tmp_path / "share"))
    server.share = ShareInfo("follower", str(tmp_path / "share"), "p", 1, 1, 1,
                             identify(os.getpid()))
    loop = asyncio.new_event_loop()
    loop.close()
    server._loop = loop
    server._on_leader_gone()  # returns: no exception, no os._exit
    assert (server.state, server.exit_code) == (State.STARTING, ExitCode.OK)


def test_a_cuda_leader_builds_on_the_cpu_so_the_device_holds_its_weights_once(tmp_path):
    """Built on the device and then copied into the buffers it exports, a CUDA leader would
    hold the weights twice while it starts; the plan's fit counts them once."""
    import dataclasses

    from omni_dp.engine.server import build_models, leader_build_device

    plan = plan_for("leader", tmp_path / "share")
    on_gpu = dataclasses.replace(plan, device=torch.device("cuda", 0))  # no GPU needed to plan
    assert leader_build_device(on_gpu) == torch.device("cpu")
    assert leader_build_device(plan) == torch.device("cpu")
    models = build_models(on_gpu, leader_build_device(on_gpu))  # cast, but never moved
    assert {p.device.type for p in models.talker.parameters()} == {"cpu"}
    assert {p.dtype for p in models.talker.parameters()} == {on_gpu.dtype}
