"""A stage process of one replica: `python -m omni_dp.engine.stage_process SPEC_JSON PID`.

Started by the replica's front (PID; engine/stage_group.py) when the placement puts stages
outside `main`; never by a person. It builds only what its stages need, binds its inbox, says Ready,
and serves until Stop. It dies with the front (PR_SET_PDEATHSIG) and says StageFailed before
exiting 3 when a stage fails; the front turns either into an unhealthy replica at once.

A tensor-parallel talker is one such process per rank: rank 0 is the talker stage (its
scheduler decides each step and broadcasts it); ranks ≥ 1 only follow (engine/tensor_parallel).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from omni_dp.engine.stage_launch import StageLaunch
from omni_dp.placement.builtin import VOICE_PIPELINE

if TYPE_CHECKING:
    from omni_dp.engine.links import Outbox

log = logging.getLogger("omni_dp.stage")

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(front_pid: int) -> None:
    """SIGKILL this process when the thread that started it exits (the front's main thread):
    a kill -9 of the replica leaves no stage process behind. Hand-written (ctypes, Linux only):
    no maintained library wraps this one prctl."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != front_pid:  # the front died before the prctl: nobody would kill us
        os._exit(1)


def build_stage_models(spec: StageLaunch):
    """The models this process's stages use, cast and on its device; the others dropped
    before anything moves (a vocoder process never holds the talker)."""
    import torch

    from omni_dp.engine.budget import check_before_pool
    from omni_dp.engine.config import resolve_model
    from omni_dp.engine.kv_cache import KVCache, plan_kv_cache
    from omni_dp.engine.plan import DTYPES
    from omni_dp.engine.runner import ModelRunner
    from omni_dp.engine.stage_set import StageModels
    from omni_dp.engine.weights import load_models, seeded_models

    cfg, model_dir = resolve_model(spec.model)
    models = (seeded_models(cfg, spec.weight_seed) if model_dir is None
              else load_models(cfg, Path(model_dir)))
    device, dtype = torch.device(spec.device), DTYPES[spec.dtype]
    held = StageModels(cfg, device)
    if "vocoder" in spec.stages:
        held.vocoder = models.vocoder.to(device=device)
    if "talker" in spec.stages:
        talker = models.talker
        kv_spec = plan_kv_cache(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                                head_dim=cfg.head_dim, dtype=dtype, page_size=spec.page_size,
                                max_total_tokens=spec.num_pages * spec.page_size)
        if spec.tp is None:
            talker.to(device=device, dtype=dtype)
            check_before_pool(spec.process, spec.budget_bytes, kv_spec.cache_bytes, device)
            held.kv_cache = KVCache(kv_spec, device)
            held.talker_runner = ModelRunner(talker, held.kv_cache, device)
        else:
            from omni_dp.engine import tensor_parallel as tp

            rank, size = spec.tp.rank, spec.tp.size
            group = tp.join_group(rank, size, spec.tp.store_port, spec.tp.backend,
                                  device=device if device.type == "cuda" else None)
            shard = tp.shard_talker(talker, rank, size, group=group.device_group)
            shard.to(device=device, dtype=dtype)
            rank_spec = tp.rank_kv_spec(kv_spec, size)
            check_before_pool(spec.process, spec.budget_bytes, rank_spec.cache_bytes, device)
            held.kv_cache = KVCache(rank_spec, device)
            held.tp_group = group
            if rank == 0:  # the talker stage: its scheduler decides, its runner broadcasts
                held.talker_runner = tp.TPModelRunner(shard, held.kv_cache, device, group)
            else:
                held.tp_shard = shard
    return held


def sendable(text: str) -> str:
    """`text` as the wire can carry it: a reason quoting undecodable bytes (a path read from
    disk, say) holds lone surrogates, which UTF-8 cannot encode; they become escapes."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def tell_front(front: str, message: object) -> None:
    """Send one last message on a context of its own, and wait (≤ 1 s) until it has left:
    zmq sends from its I/O thread, and the process exits right after. The shared context is
    not touched: other threads' sockets live in it (terminating it under them is undefined).
    The front also sees the exit itself, so a message lost here costs only the reason."""
    import zmq

    from omni_dp.engine.wire import encode

    frames = encode(message)  # before any socket: an encoding error leaves nothing open
    context = zmq.Context()
    try:
        sock = context.socket(zmq.PUSH)
        sock.connect(front)
        sock.send_multipart(frames)
    finally:
        context.destroy(linger=1000)  # closes the socket once sent, or after a second


def fatal_for(spec: StageLaunch) -> Callable[[str], None]:
    """What a failed stage does, from whichever thread: say why to the front (StageFailed),
    then exit 3 at once. Only the first failure speaks."""
    from omni_dp.engine import messages

    failed = threading.Event()

    def fatal(reason: str) -> None:
        if failed.is_set():
            return
        failed.set()
        reason = sendable(reason)
        log.error("%s", reason)
        try:
            tell_front(spec.front, messages.StageFailed(spec.process, reason))
        finally:
            logging.shutdown()
            os._exit(3)

    return fatal


def run(spec: StageLaunch) -> int:
    from omni_dp.engine.links import Outbox

    fatal = fatal_for(spec)
    if spec.pipeline == VOICE_PIPELINE.name:
        from omni_dp.engine.voice.stages import serve_voice_stages

        return serve_voice_stages(spec, Outbox(), fatal)
    return serve_tts_stages(spec, Outbox(), fatal)


def serve_tts_stages(spec: StageLaunch, outbox: Outbox, fatal: Callable[[str], None]) -> int:
    """The seeded TTS pipeline's stages of this process, until the front says Stop."""
    import torch

    from omni_dp.engine import messages
    from omni_dp.engine.links import Inbox
    from omni_dp.engine.preprocess import PreprocessError, PreprocessLimits
    from omni_dp.engine.stage_set import StageSet, VocoderRoute
    from omni_dp.tracing import stage_work

    torch.set_num_threads(spec.threads)
    sys.setswitchinterval(0.00005)  # as the front's (engine/server.py SWITCH_INTERVAL_S)
    try:
        held = build_stage_models(spec)
    except Exception as exc:  # weights or pool that cannot be had: the front reports it
        fatal(f"stage process {spec.process}: start-up failed: {exc}")
        return 3
    if spec.tp is not None and spec.tp.rank > 0:
        return follow_rank(spec, held, outbox)

    inbox = Inbox(spec.inbox)
    to_vocoder = None
    if "talker" in spec.stages and "vocoder" not in spec.stages:
        to_vocoder = VocoderRoute([
            (lambda step, endpoint=endpoint: outbox.send(endpoint, step))
            for endpoint in spec.vocoders])

    def deliver(request_id: str, chunk: bytes | None, done: bool) -> None:
        outbox.send(spec.front, messages.Audio(request_id, chunk or b"", done))

    stages = StageSet(
        spec.stages, held,
        limits=PreprocessLimits(spec.max_input_chars, spec.num_pages * spec.page_size),
        max_running_requests=spec.max_running_requests, to_vocoder=to_vocoder,
        deliver=deliver, on_fatal=fatal,
        on_stats=lambda stats: outbox.send(spec.front, messages.Stats(stats)),
        priority_share_every=spec.priority_share_every,
    )
    stages.start()
    outbox.send(spec.front, messages.Ready(spec.process, os.getpid()))
    log.info("stage process %s (pid %d): %s on %s", spec.process, os.getpid(),
             ", ".join(spec.stages), spec.device)
    try:
        while not isinstance(message := inbox.recv(None), messages.Stop):
            if isinstance(message, messages.Prepare) and stages.preprocess is not None:
                with stage_work("preprocess", spec.process, message.traceparent):
                    try:
                        speech = stages.preprocess.prepare(message.ask)
                        answer = messages.Prepared(message.request_id, speech)
                    except PreprocessError as exc:
                        answer = messages.Prepared(message.request_id, None, exc.field,
                                                   str(exc))
                outbox.send(spec.front, answer)
            elif not stages.handle(message):
                log.warning("stage process %s: no stage here takes %s", spec.process,
                            type(message).__name__)
    except Exception:  # a message it cannot read or answer: the replica cannot be trusted
        fatal(f"stage process {spec.process}: serving failed:\n{traceback.format_exc()}")
    stages.stop()
    inbox.close()
    outbox.close_all()
    return 0


def follow_rank(spec: StageLaunch, held, outbox: Outbox) -> int:
    """A TP rank ≥ 1: execute every step rank 0 broadcasts, until it broadcasts the end."""
    from omni_dp.engine import messages
    from omni_dp.engine import tensor_parallel as tp

    outbox.send(spec.front, messages.Ready(spec.process, os.getpid()))
    log.info("stage process %s (pid %d): talker rank %d of %d on %s", spec.process,
             os.getpid(), spec.tp.rank, spec.tp.size, spec.device)
    steps = tp.follow(held.tp_shard, held.kv_cache, held.device, held.tp_group)
    log.info("stage process %s: rank 0 stopped the group after %d steps", spec.process, steps)
    tp.leave_group()
    outbox.close_all()
    return 0


def main(argv: list[str]) -> int:
    # Signals are the front's to take: a terminal's Ctrl-C and the launcher's SIGTERM reach the
    # whole process group, and a stage process that died of them would fail the replica
    # instead of letting it drain. It stops on the front's Stop, or dies with the front.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    spec = StageLaunch.read(argv[1])
    die_with_parent(int(argv[2]))
    from omni_dp.logs import setup_logging

    setup_logging(spec.log_level, spec.log_format)
    from omni_dp import tracing

    tracer = tracing.start_tracing(spec.otlp_traces_endpoint, tracing.STAGE_SERVICE,
                                   {tracing.PROCESS_ATTR: spec.process})
    tracing.install(tracer)
    code = run(spec)
    if tracer is not None:  # flush before any exit, os._exit's included
        tracer.shutdown()
    if spec.tp is not None:
        # gloo's C++ threads outlive destroy_process_group; the interpreter's teardown can
        # then abort the process ("terminate called without an active exception", -6).
        # Everything is sent and stopped by now: leave without that teardown.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv))
