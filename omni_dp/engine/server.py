"""The replica's HTTP server: the contract in docs/contracts.md, served by aiohttp.

Lifecycle: bind the port (so /health answers 503 "starting" at once), load weights and allocate
the KV pool off the event loop, then serve. SIGTERM/SIGINT: /health and new requests turn 503,
in-flight requests finish (up to --drain-timeout), exit 0. A dead stage worker: exit 3.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import math
import os
import signal
import socket
import struct
import sys
import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from aiohttp import HttpVersion11, web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from omni_dp import __version__, logs
from omni_dp.contract import (
    GOING_AWAY_HEADER,
    PRIORITY_HEADER,
    RESUMABLE_BY_BYTES,
    RESUMABLE_HEADER,
    RESUME_FROM_HEADER,
    RESUMED_FROM_HEADER,
    BadPriority,
    ExitCode,
    Priority,
)
from omni_dp.engine.api import (
    OPENAI_MODEL_ALIASES,
    RESUMABLE_FORMATS,
    ApiError,
    ResumeAsk,
    SpeechParams,
    model_not_found,
    parse_resume_headers,
    parse_speech_body,
)
from omni_dp.engine.audio import (
    CONTENT_TYPES,
    OUTPUT_RATE,
    STREAMED_FORMATS,
    StreamEncoder,
    encode_whole,
    sse_audio_delta,
    sse_audio_done,
    sse_error,
    takes_cpu,
)
from omni_dp.engine.budget import check_before_pool
from omni_dp.engine.kv_cache import KVCache
from omni_dp.engine.metrics import ReplicaMetrics
from omni_dp.engine.pipeline import EngineFailed, Pipeline, RequestCutOff
from omni_dp.engine.placement_plan import default_placement, main_of, process_threads
from omni_dp.engine.plan import ServePlan, dtype_name
from omni_dp.engine.preprocess import (
    VOICES,
    PreparedSpeech,
    PreprocessError,
    PreprocessLimits,
    SpeechAsk,
)
from omni_dp.engine.priority import priority_of
from omni_dp.engine.runner import ModelRunner
from omni_dp.engine.share import ShareInfo
from omni_dp.engine.share.attach import attach
from omni_dp.engine.share.export import publish
from omni_dp.engine.share.watch import LeaderWatch
from omni_dp.engine.speech_stream import SpeechStreams
from omni_dp.engine.stage_set import StageModels
from omni_dp.engine.voice.preprocess import voice_names
from omni_dp.engine.weights import (
    PipelineModels,
    load_models,
    meta_models,
    place,
    seeded_models,
)
from omni_dp.net import bind_listening
from omni_dp.speech_stream import SPEECH_STREAM_PATH
from omni_dp.tracing import (
    REPLICA_SERVICE,
    TRACEPARENT,
    Tracer,
    reset_current,
    set_current,
    start_tracing,
)

log = logging.getLogger("omni_dp.serve")

# Measured with bench/engine_throughput.py on 2 cores at concurrency 8: 10.7 req/s at the
# default 5 ms, 13.4 at 0.2 ms, 15.1 at 0.05 ms.
SWITCH_INTERVAL_S = 0.00005
# A follower whose leader is gone stops serving at once (exit 4); if its clean stop (every
# in-flight request cut off, the workers joined) has not ended the process this long after the
# leader's exit was seen, it exits without one.
LEADER_GONE_GRACE_S = 0.5
LEADER_GONE_REASON = "the leader of this replica's shared weights is gone"


class State(str, Enum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"


class PortInUse(OSError):
    pass


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind before anything is loaded, so a taken port is a usage error (exit 2), not a crash."""
    try:
        return bind_listening(host, port, backlog=1024)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise PortInUse(f"{host}:{port} is already in use; pick another --port") from None
        raise


def build_models(plan: ServePlan, device: torch.device | None = None) -> PipelineModels:
    """The replica's models, cast, on `device` (default: the plan's)."""
    if plan.model_dir is None:
        models = seeded_models(plan.cfg, plan.options.weight_seed)
    else:
        models = load_models(plan.cfg, Path(plan.model_dir))
    place(models, device or plan.device, plan.dtype)
    return models


def weights_source(plan: ServePlan) -> str:
    """Where the weights come from, as /get_server_info says it (weights.seeded_models and
    load_models name them the same way)."""
    if plan.model_dir is None:
        return f"preset {plan.cfg.name}, seed {plan.options.weight_seed}"
    return str(plan.model_dir)


def stage_launch_base(plan: ServePlan) -> dict:
    """The StageLaunch fields (engine/stage_process.py) every stage process of this replica
    shares: the plan's model, dtype, threads and the exact KV pool."""
    return {
        "dtype": dtype_name(plan.dtype), "threads": plan.threads, "model": plan.options.model,
        "weight_seed": plan.options.weight_seed, "page_size": plan.kv.page_size,
        "num_pages": plan.kv.num_pages,
        "max_running_requests": plan.options.max_running_requests,
        "max_input_chars": plan.options.max_input_chars,
        "voice_first_piece_chars": plan.options.voice_first_piece_chars,
        "priority_share_every": plan.options.priority_share_every,
        "otlp_traces_endpoint": plan.options.otlp_traces_endpoint,
    }


def current_log_setup() -> tuple[str, str]:
    """This process's log level and format, for its stage processes to log alike."""
    setup = logs.current()
    return logging.getLevelName(setup.level), setup.fmt


def leader_build_device(plan: ServePlan) -> torch.device:
    """Where a sharing leader builds before it publishes: always the CPU. A CUDA leader builds
    and casts there and copies each tensor once into the device buffers it exports, so that the
    GPU holds the weights once while it starts (building on the device, then copying into the
    buffers, would hold them twice: the plan's memory fit counts them once); a CPU leader builds
    on its own device. The plan allows no other device (plan._resolve_device: cpu or cuda)."""
    return torch.device("cpu")


@web.middleware
async def json_errors(request: web.Request, handler) -> web.StreamResponse:
    """aiohttp's own 404/405/413 pages as the same JSON error body every other error has."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = f"{request.method} {request.path}: {exc.reason}"
        if exc.status == 405:
            message += f"; allowed: {exc.headers.get('Allow', '')}"
        return web.json_response(ApiError(exc.status, message).body(), status=exc.status)


class GoingAway(ApiError):
    """A 5xx this replica answers because it is leaving (or not there yet): it did no part of
    the request, and says so (GOING_AWAY_HEADER) so that the router sends it elsewhere."""

    def __init__(self, status: int, message: str, why: str) -> None:
        super().__init__(status, message)
        self.why = why


@dataclass(frozen=True)
class AdmittedSpeech:
    """A speech request that passed every check and can go to the pipeline."""

    params: SpeechParams
    speech: PreparedSpeech
    resume: ResumeAsk = field(default_factory=ResumeAsk)
    priority: Priority = Priority.DEFAULT  # X-Omni-DP-Priority: the order its work is queued in

    @property
    def seed(self) -> int:
        return self.speech.seed


class ByteSkip:
    """Drops the first `offset` bytes of what passes through it: an answer resumed from a byte
    (the router's resume) is the same bytes as the whole one, from that byte on."""

    def __init__(self, offset: int) -> None:
        self.left = offset

    def __call__(self, data: bytes) -> bytes:
        if self.left <= 0 or not data:
            return data
        dropped = min(self.left, len(data))
        self.left -= dropped
        return data[dropped:]


class ReplicaServer:
    def __init__(self, plan: ServePlan) -> None:
        self.plan = plan
        self.options = plan.options
        self.placement = plan.placement or default_placement(plan.device)
        self.state = State.STARTING
        self.pipeline: Pipeline | None = None
        self.models: PipelineModels | None = None
        self.share: ShareInfo | None = None  # when sharing weights (--share-weights)
        self._watch: LeaderWatch | None = None
        self._abandoned: str | None = None  # why in-flight requests are cut off at once
        self.exit_code = ExitCode.OK
        self._stop = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._signals = 0
        self._started_at = time.time()
        self.tracer: Tracer | None = None  # --otlp-traces-endpoint (started by run)
        self.metrics = ReplicaMetrics(
            lambda: self.pipeline.stats() if self.pipeline else None, plan.served_model_name
        )
        # What a request's `model` may name, in /v1/models' order: the served model, then
        # OpenAI's TTS models (once each, should the served model be named like one).
        self.model_names = tuple(dict.fromkeys((plan.served_model_name, *OPENAI_MODEL_ALIASES)))
        # Another replica regenerates a wav/pcm answer byte for byte only where sampling does
        # not depend on batching: a float64 talker (docs/replica.md, Determinism). In float32 or
        # bfloat16 a batch can flip a sample, so a resumed answer could go on differently.
        # A Piper voice never: its noise is drawn inside its graph (engine/voice/pipeline.py).
        self.resumable = plan.dtype == torch.float64 and plan.voice is None
        self.app = web.Application(
            client_max_size=self.options.max_body_bytes, middlewares=[json_errors]
        )
        self.app.add_routes([
            web.get("/health", self.health),
            web.get("/get_server_info", self.server_info),
            web.get("/v1/models", self.list_models),
            web.get("/metrics", self.prometheus),
            web.get("/gpu_busy", self.gpu_busy),
            web.post("/v1/audio/speech", self.speech),
            web.get(SPEECH_STREAM_PATH, SpeechStreams(self).handle),
        ])

    # --- lifecycle ---------------------------------------------------------------------
    async def run(self, sock: socket.socket) -> int:
        loop = self._loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        self.tracer = start_tracing(self.options.otlp_traces_endpoint, REPLICA_SERVICE)
        # handler_cancellation: a client that hangs up cancels its handler at once, which
        # aborts its request and frees its KV pages.
        # shutdown_timeout: by cleanup time our own drain has already waited.
        runner = web.AppRunner(
            self.app, handler_cancellation=True, access_log=None, shutdown_timeout=2.0
        )
        await runner.setup()
        await web.SockSite(runner, sock).start()
        host, port = sock.getsockname()[:2]
        log.info("listening on http://%s:%d (state: starting)", host, port)
        try:
            await self._load()
            if self.state == State.STARTING:
                self.state = State.READY
                log.info("ready: %s", self._summary())
            await self._stop.wait()
            await self._drain()
        finally:
            if self._watch is not None:
                self._watch.stop()
            await runner.cleanup()
            if self.pipeline is not None:
                self.pipeline.stop()
            if self.tracer is not None:
                self.tracer.shutdown()
        return self.exit_code

    async def _load(self) -> None:
        if self.plan.voice is not None:
            await self._load_voice()
            return
        plan = self.plan
        main = main_of(self.placement)
        role, share_dir = self.options.share_weights, Path(self.options.share_dir or ".")
        # The replica's threads are split among its processes; main keeps its share.
        torch.set_num_threads(process_threads(self.placement, plan.threads)[main.name])
        failed = "start-up failed"
        try:
            if role == "follower":
                failed = "weight share"
                started = time.perf_counter()
                self.models, self.share = await asyncio.to_thread(attach, plan, share_dir)
                log.info("weight share: follower mapped %d tensors, %d bytes shared (%d "
                         "private, copied) from %s in %.2f s", self.share.tensors_shared,
                         self.share.shared_bytes, self.share.private_bytes, share_dir,
                         time.perf_counter() - started)
            elif not {"talker", "vocoder"} & set(main.stages):
                # Every model is in a stage process: here only their shapes, for the info.
                self.models = meta_models(plan.cfg, plan.dtype, weights_source(plan))
            else:
                device = leader_build_device(plan) if role == "leader" else None
                self.models = await asyncio.to_thread(build_models, plan, device)
                if role == "leader":
                    failed = "weight share"
                    self.share = await asyncio.to_thread(publish, plan, self.models, share_dir)
            failed = "start-up failed"
            held = StageModels(plan.cfg, plan.device)
            if "talker" in main.stages:
                check_before_pool(main.name, main.budget_bytes, plan.kv.cache_bytes,
                                  plan.device)
                held.kv_cache = await asyncio.to_thread(KVCache, plan.kv, plan.device)
                held.talker_runner = ModelRunner(self.models.talker, held.kv_cache, plan.device)
            if "vocoder" in main.stages:
                held.vocoder = self.models.vocoder
            self.pipeline = Pipeline(
                self.placement, held, threads=plan.threads,
                limits=PreprocessLimits(self.options.max_input_chars, plan.kv.max_total_tokens),
                max_running_requests=self.options.max_running_requests,
                on_fatal=self._on_fatal, launch_base=stage_launch_base(plan),
                log_setup=current_log_setup(),
                priority_share_every=self.options.priority_share_every,
            )
            if self._stop.is_set():
                return  # a signal while the models were built: start nothing more
            self.pipeline.start()  # here, on the main thread: stage processes die with it
            if not await self.pipeline.wait_ready(self._stop):
                return  # a signal during start-up: run() stops the pipeline
        except Exception as exc:  # weights, share, pool or a stage process: report, exit 3
            log.error("%s: %s", failed, exc)
            self.state = State.FAILED
            self.exit_code = ExitCode.RUNTIME
            self._stop.set()
            return
        if role == "follower" and self.share is not None:
            self._watch = LeaderWatch(self.share.leader, self._on_leader_gone)
            self._watch.start()

    async def _load_voice(self) -> None:
        """A Piper voice: its ONNX session where main speaks, its stage processes where the
        placement puts stages; no KV pool."""
        from omni_dp.engine.voice.pipeline import VoicePipeline

        plan = self.plan
        pipeline = VoicePipeline(plan.voice, self.placement, threads=plan.threads,
                                 max_input_chars=self.options.max_input_chars,
                                 on_fatal=self._on_fatal, launch_base=stage_launch_base(plan),
                                 log_setup=current_log_setup(),
                                 lookahead=self.options.voice_lookahead,
                                 first_piece_chars=self.options.voice_first_piece_chars,
                                 priority_share_every=self.options.priority_share_every)
        self.pipeline = pipeline  # stopped by run() whatever happens next
        try:
            await asyncio.to_thread(pipeline.load)
            if self._stop.is_set():
                return  # a signal while the session was made: start nothing more
            pipeline.start()  # here, on the main thread: stage processes die with it
            await pipeline.wait_ready(self._stop)
        except Exception as exc:  # onnxruntime could not make the session, or a stage
            # process failed to start: report, exit 3
            log.error("start-up failed: the voice %s: %s", plan.voice.onnx_path, exc)
            self.state = State.FAILED
            self.exit_code = ExitCode.RUNTIME
            self._stop.set()

    def _summary(self) -> str:
        if self.plan.voice is not None:
            voice, processes = self.plan.voice, self.placement.processes
            where = ("" if len(processes) == 1 else ", stages on " + ", ".join(
                f"{p.name} ({'+'.join(p.stages) or 'front'} on {p.device})" for p in processes))
            return (f"voice {voice.name} ({voice.source}) on {self.plan.device} with "
                    f"onnxruntime, {voice.sample_rate} Hz, no KV cache, "
                    f"{self.plan.threads} threads{where}")
        kv = self.plan.kv
        return (
            f"model {self.plan.cfg.name} on {self.plan.device} "
            f"({dtype_name(self.plan.dtype)}), "
            f"KV {kv.max_total_tokens} tokens = {kv.num_pages} pages × {kv.page_size}, "
            f"{kv.cache_bytes} bytes, {self.plan.threads} threads"
        )

    def _on_signal(self, sig: signal.Signals) -> None:
        self._signals += 1
        if self._signals == 1:
            log.info("%s: draining (up to %.0fs)", sig.name, self.options.drain_timeout)
            if self.state != State.FAILED:
                self.state = State.DRAINING
            self._stop.set()
        else:
            log.info("%s again: stopping without waiting for in-flight requests", sig.name)

    @property
    def _hurry(self) -> bool:
        """A second signal, or a gone leader: stop without waiting for in-flight requests."""
        return self._signals > 1 or self._abandoned is not None

    def _on_fatal(self, reason: str) -> None:
        self.state = State.FAILED
        if self.exit_code == ExitCode.OK:  # a gone leader's 4 stays what the process says
            self.exit_code = ExitCode.RUNTIME
        self._stop.set()

    def _on_leader_gone(self) -> None:
        """In the watch thread: stop serving, exit 4.

        On a GPU at once, without a clean stop: the leader's exit freed the memory its IPC
        handles name, and CUDA does not promise what reading it gives, so no further kernel
        of ours may run (a clean stop would wait for the talker's step in flight). On the CPU
        the mapping stays valid (the file's pages outlive the leader): in-flight requests are
        cut off with a terminal error and the process exits by the normal path, or here after
        LEADER_GONE_GRACE_S.
        """
        assert self.share is not None
        if self._loop is None or self._loop.is_closed():
            return  # run() has returned: the process is on its way out with its own code
        log.error("weight share: the leader (pid %d) is gone; this follower stops serving",
                  self.share.leader.pid)
        self.state = State.FAILED  # /health says 503 from now on
        self.exit_code = ExitCode.LEADER_GONE
        if self.plan.device.type == "cuda":
            os._exit(ExitCode.LEADER_GONE)
        try:
            self._loop.call_soon_threadsafe(self._abandon, LEADER_GONE_REASON)
        except RuntimeError:  # the loop closed since: run() has returned
            return
        time.sleep(LEADER_GONE_GRACE_S)
        log.error("weight share: the clean stop took longer than %.1f s; exiting",
                  LEADER_GONE_GRACE_S)
        os._exit(ExitCode.LEADER_GONE)

    def _abandon(self, reason: str) -> None:
        """Stop now: every in-flight request cut off, no drain."""
        self._abandoned = reason
        if self.pipeline is not None:
            self.pipeline.cut_off_all(reason)
        self._stop.set()

    async def _drain(self) -> None:
        if self.pipeline is None:
            return
        deadline = time.monotonic() + self.options.drain_timeout
        while self.pipeline.num_in_flight and time.monotonic() < deadline and not self._hurry:
            await asyncio.sleep(0.05)
        if self.pipeline.num_in_flight:
            reason = self._abandoned or ("second signal" if self._hurry else "drain timeout")
            log.warning("%s: %d request(s) cut off", reason, self.pipeline.num_in_flight)
            self.pipeline.cut_off_all("the replica stopped before this request finished")
            deadline = time.monotonic() + 2.0
            while self.pipeline.num_in_flight and time.monotonic() < deadline:
                await asyncio.sleep(0.01)  # let the handlers send their terminal errors

    # --- routes ------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        status = 200 if self.state == State.READY else 503
        return web.json_response({"status": self.state.value}, status=status)

    async def server_info(self, request: web.Request) -> web.Response:
        if self.pipeline is None or (self.models is None and self.plan.voice is None):
            return web.json_response({"status": self.state.value}, status=503)
        return web.json_response({**self._info_common(), "model": self._model_info(),
                                  "weight_share": self.share.to_json() if self.share else None})

    def _info_common(self) -> dict:
        """/get_server_info's fields every model has (a voice's KV figures are all 0)."""
        plan, kv = self.plan, self.plan.kv
        assert self.pipeline is not None
        return {
            "version": __version__,
            "state": self.state.value,
            "max_total_num_tokens": kv.max_total_tokens,
            "kv_cache_bytes": kv.cache_bytes,
            "kv_bytes_per_token": kv.bytes_per_token,
            "page_size": kv.page_size,
            "num_pages": kv.num_pages,
            "max_running_requests": self.options.max_running_requests,
            "max_queued_requests": self.options.max_queued_requests,
            "device": str(plan.device),
            "dtype": dtype_name(plan.dtype),
            "threads": torch.get_num_threads(),
            "processes": self.pipeline.processes(),
            "started_at": self._started_at,
            # what every answer is in (X-Sample-Rate): the model's own rate is model.sample_rate
            "output_sample_rate": OUTPUT_RATE,
        }

    def _model_info(self) -> dict:
        plan = self.plan
        if plan.voice is not None:
            from omni_dp.engine.voice.plan import NO_KV

            return {"name": plan.voice.name, "served_name": plan.served_model_name,
                    "kind": "piper-voice", "source": plan.voice.source,
                    "weights_bytes": plan.voice.weights_bytes,
                    "sample_rate": plan.voice.sample_rate, "kv": NO_KV, "reproducible": False}
        assert self.models is not None
        return {
            "name": plan.cfg.name,
            "served_name": plan.served_model_name,
            "source": self.models.source,
            "parameters": self.models.num_parameters,
            "sample_rate": plan.cfg.sample_rate,
            "frame_rate_hz": plan.cfg.frame_rate_hz,
            "max_new_tokens": plan.cfg.max_new_tokens,
        }

    async def gpu_busy(self, request: web.Request) -> web.Response:
        """Each timed stage's GPU busy intervals since `?since=` (Unix seconds; default 0)."""
        raw = request.query.get("since", "0")
        try:
            since = float(raw)
        except ValueError:
            since = math.nan
        if not math.isfinite(since):
            error = ApiError(400, f"since must be a time in Unix seconds, not {raw!r}", "since")
            return web.json_response(error.body(), status=400)
        if self.pipeline is None:
            return web.json_response({"status": self.state.value}, status=503)
        return web.json_response(self.pipeline.gpu_busy(since))

    async def list_models(self, request: web.Request) -> web.Response:
        """Every name `model` may take: the served model first (clients that take the first
        entry get it), then OpenAI's aliases of it, each with `root` the served model."""
        served = self.plan.served_model_name
        return web.json_response({"object": "list", "data": [{
            "id": name, "object": "model", "created": int(self._started_at),
            "owned_by": "omni-dp", "root": served,
        } for name in self.model_names]})

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.metrics.registry),
            headers={"Content-Type": CONTENT_TYPE_LATEST},
        )

    async def speech(self, request: web.Request) -> web.StreamResponse:
        if self.tracer is not None:
            return await self._traced_speech(request, self.tracer)
        return await self._speech(request)

    async def _traced_speech(self, request: web.Request, tracer: Tracer) -> web.StreamResponse:
        """The request in a span whose parent is the caller's traceparent (the router's
        attempt, or a client's); its stage processes' spans are this one's children."""
        span = tracer.start("replica.speech", request.headers.get(TRACEPARENT), {
            "omni_dp.model": self.plan.served_model_name, "url.path": request.path,
            "http.request.method": request.method}, kind="server")
        token = set_current(tracer.traceparent(span))
        try:
            response = await self._speech(request, span)
            span.set_attribute("http.response.status_code", response.status)
            return response
        except BaseException as exc:  # the client gone (cancelled), or a bug
            tracer.fail(span, type(exc).__name__)
            raise
        finally:
            reset_current(token)
            span.end()

    async def _speech(self, request: web.Request,
                      span: Any = None) -> web.StreamResponse:
        """A speech request; `span`, its span when the replica traces (its format and class
        are set on it once known)."""
        started = time.perf_counter()
        try:
            job = await self._admit(request)
        except ApiError as exc:
            outcome = "rejected" if exc.status == 503 else "bad_request"
            self.metrics.count(outcome)
            return self.refused(exc)
        if span is not None:
            sse = job.params.stream_format == "sse"
            span.set_attributes({"omni_dp.format": "sse" if sse else job.params.response_format,
                                 "omni_dp.priority": job.priority.label})
        assert self.pipeline is not None
        self.metrics.count_priority(job.priority)
        synthesis = self.pipeline.synthesize(job.speech, job.priority)
        params = job.params
        # aclosing: a handler cancelled while writing (client gone) closes the generator at
        # once, which aborts the request and frees its pages — not whenever GC gets to it.
        async with contextlib.aclosing(synthesis) as chunks:
            sse = params.stream_format == "sse"
            if params.stream and (sse or params.response_format in STREAMED_FORMATS):
                return await self._stream(request, job, chunks, started)
            # Not streamed: asked so, or a format sent whole (audio.STREAMED_FORMATS says why).
            return await self._whole(job, chunks, started)

    @staticmethod
    def refused(exc: ApiError) -> web.Response:
        """A request refused before any of it was done: a 503 says when to retry, and where
        the replica is leaving (GoingAway), that it is."""
        headers = {"Retry-After": "1"} if exc.status == 503 else {}
        if isinstance(exc, GoingAway):
            headers[GOING_AWAY_HEADER] = exc.why
        return web.json_response(exc.body(), status=exc.status, headers=headers)

    def not_ready(self) -> GoingAway | None:
        """Why this replica takes no request now (not ready: another replica may), or None."""
        if self.state != State.READY:
            return GoingAway(503, f"replica is {self.state.value}; retry on another replica",
                             self.state.value)
        return None

    def full(self) -> ApiError | None:
        """Why this replica takes no more requests now (as many in flight as it may hold)."""
        assert self.pipeline is not None
        capacity = self.options.max_running_requests + self.options.max_queued_requests
        if self.pipeline.num_in_flight >= capacity:
            return ApiError(503, f"replica is full ({capacity} requests in flight); retry "
                            "shortly")
        return None

    @staticmethod
    def priority_of(request: web.Request) -> Priority:
        """The request's class from X-Omni-DP-Priority (absent: default); an unknown value is
        a 400 naming the header and the accepted values."""
        try:
            return priority_of(request.headers.get(PRIORITY_HEADER))
        except BadPriority as exc:
            raise ApiError(400, str(exc), PRIORITY_HEADER) from None

    def speech_params(self, raw: bytes) -> SpeechParams:
        """A speech body checked field by field (ApiError naming the field) against this
        replica's model: its voices, its bounds, its served names. POST's body and a speech
        session's config alike."""
        cfg = self.plan.cfg
        # A voice refuses max_new_tokens in its preprocess stage, by field: any bound parses.
        limit = cfg.max_new_tokens if cfg is not None else 2**31 - 1
        voices = VOICES if self.plan.voice is None else voice_names(self.plan.voice)
        params = parse_speech_body(raw, max_new_tokens_limit=limit, voices=voices)
        if params.model is not None and params.model not in self.model_names:
            raise model_not_found(params.model)
        return params

    async def _admit(self, request: web.Request) -> AdmittedSpeech:
        if (leaving := self.not_ready()) is not None:
            raise leaving
        assert self.pipeline is not None
        priority = self.priority_of(request)
        limit = self.options.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise ApiError(413, f"body is {request.content_length} bytes; the limit is {limit}")
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise ApiError(413, f"body exceeds the limit of {limit} bytes") from None
        params = self.speech_params(raw)
        resume = parse_resume_headers(request.headers, params)
        if resume.offset is not None and self.plan.voice is not None:
            # By design: the voice's noise is drawn in its graph, so no replica can regenerate
            # the bytes another one sent (engine/voice/pipeline.py); the router never asks.
            raise ApiError(400, f"{RESUME_FROM_HEADER}: a Piper voice's answers cannot be "
                           "resumed (their noise is drawn inside the voice's graph, whatever "
                           "the seed)", RESUME_FROM_HEADER)
        seed = params.seed if params.seed is not None else resume.seed
        ask = SpeechAsk(params.input, params.voice, params.speed, seed, params.max_new_tokens)
        try:
            speech = await self.pipeline.prepare(ask)
        except PreprocessError as exc:
            raise ApiError(400, str(exc), exc.field) from None
        except EngineFailed as exc:  # the replica failed, or only this request did (the
            # phonemizer on its text): either way nothing was done, another replica may take
            # it; the header says the state the replica really is in
            if self.pipeline.failure is not None:
                raise GoingAway(503, f"replica failed ({exc}); retry on another replica",
                                State.FAILED.value) from None
            raise GoingAway(503, f"this request failed ({exc}); the replica is "
                            f"{self.state.value}: retry on another replica",
                            self.state.value) from None
        if (full := self.full()) is not None:
            raise full
        return AdmittedSpeech(params, speech, resume, priority)

    async def _whole(self, job: AdmittedSpeech, chunks, started: float) -> web.Response:
        params = job.params
        answer = self.metrics.answer(params.response_format, job.priority, started)
        pcm = bytearray()
        first = None
        try:
            async for chunk in chunks:
                first = first or time.perf_counter()
                pcm += chunk
        except EngineFailed as exc:
            self.metrics.count("failed")
            answer.finish(False, self.plan.served_model_name)
            return web.json_response(ApiError(500, f"engine failed: {exc}").body(), status=500,
                                     headers={GOING_AWAY_HEADER: State.FAILED.value})
        except RequestCutOff as exc:
            self.metrics.count("cut_off")
            answer.finish(False, self.plan.served_model_name)
            error = ApiError(503, f"{exc}; retry on another replica")
            return web.json_response(error.body(), status=503, headers={
                "Retry-After": "1", GOING_AWAY_HEADER: self.state.value})
        except asyncio.CancelledError:
            self.metrics.count("client_disconnected")
            answer.finish(False, self.plan.served_model_name)
            raise
        rate = self.plan.sample_rate
        if takes_cpu(params.response_format, rate):  # an encoder or the resampler: off the loop
            body = await asyncio.to_thread(encode_whole, params.response_format, bytes(pcm), rate)
        else:
            body = encode_whole(params.response_format, bytes(pcm), rate)
        self._record(started, first, len(pcm))
        offset = job.resume.offset or 0
        # One body: its audio reaches the client at once, as the handler returns (a resumed
        # one: the part from the router's offset on).
        sent = (len(body) - offset) / len(body) if body else 0.0
        answer.add(time.perf_counter(), self._seconds(len(pcm)) * sent,
                   self.plan.served_model_name)
        answer.finish(True, self.plan.served_model_name)
        return web.Response(body=body[offset:], headers=self._audio_headers(job))

    async def _stream(self, request, job: AdmittedSpeech, chunks, started: float):
        params = job.params
        sse = params.stream_format == "sse"
        response = web.StreamResponse(headers=self._audio_headers(job))
        if sse:
            response.content_type = "text/event-stream"
            response.headers["Cache-Control"] = "no-cache"
        # No Content-Length: aiohttp sends HTTP/1.1 chunked and HTTP/1.0 close-delimited
        # (chunked encoding does not exist in 1.0; forcing it there was a 500).
        await response.prepare(request)
        encoder = StreamEncoder(params.response_format, self.plan.sample_rate)
        first = None
        num_pcm_bytes = 0
        skip = ByteSkip(job.resume.offset or 0)  # a resumed answer: from the router's offset on
        model = self.plan.served_model_name
        answer = self.metrics.answer("sse" if sse else params.response_format, job.priority,
                                     started)
        # The model's audio seconds not yet written: an encoder (opus, aac) may hold some back,
        # and they count once its bytes reach the client.
        pending = 0.0

        async def send(data: bytes, seconds: float = 0.0) -> None:
            nonlocal pending
            pending += seconds
            sent = skip(data)
            if sent:
                await response.write(sse_audio_delta(sent) if sse else sent)
                answer.add(time.perf_counter(), pending, model)
                pending = 0.0
            elif data:  # skipped whole (the client had it from another replica): not sent
                pending = 0.0

        try:
            await send(encoder.header())
            async for chunk in chunks:
                first = first or time.perf_counter()
                num_pcm_bytes += len(chunk)
                await send(await encoder.feed_async(chunk), self._seconds(len(chunk)))
            await send(await encoder.finish_async())
            if sse:
                await response.write(sse_audio_done(self._usage(job, num_pcm_bytes)))
        except (EngineFailed, RequestCutOff) as exc:
            outcome = "failed" if isinstance(exc, EngineFailed) else "cut_off"
            self.metrics.count(outcome)
            answer.finish(False, model)
            if sse:
                await response.write(sse_error(str(exc)))
            self._break(request, reset=not sse)
            return response
        except (asyncio.CancelledError, ConnectionResetError):
            self.metrics.count("client_disconnected")
            answer.finish(False, model)
            raise
        finally:
            encoder.close()
        await response.write_eof()
        self._record(started, first, num_pcm_bytes)
        answer.finish(True, model)
        return response

    def _seconds(self, num_pcm_bytes: int) -> float:
        """Seconds of the model's 16-bit mono PCM (at its own rate, before any resampling)."""
        return num_pcm_bytes / 2 / self.plan.sample_rate

    @staticmethod
    def _break(request: web.Request, *, reset: bool) -> None:
        """End a failed stream so the client sees an error, never a short success.

        HTTP/1.1: closing without the terminating chunk is that error. HTTP/1.0 has no
        terminator, so a raw audio stream is reset (RST) instead of closed cleanly.
        """
        transport = request.transport
        if transport is None:
            return
        if reset and request.version < HttpVersion11:
            sock = transport.get_extra_info("socket")
            with contextlib.suppress(OSError, AttributeError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            transport.abort()
            return
        transport.close()

    def _audio_headers(self, job: AdmittedSpeech) -> dict[str, str]:
        params = job.params
        headers = {
            "Content-Type": CONTENT_TYPES[params.response_format],
            # Of the bytes sent, not the model's: every format is resampled to OUTPUT_RATE.
            "X-Sample-Rate": str(OUTPUT_RATE),
        }
        if self.plan.voice is None:  # a voice's seed reproduces nothing: none is sent back
            headers["X-Seed"] = str(job.seed)  # send it back as `seed` to reproduce this audio
        if self.resumable and params.response_format in RESUMABLE_FORMATS:
            # Its bytes are a function of the request and X-Seed: the router may resume it.
            headers[RESUMABLE_HEADER] = RESUMABLE_BY_BYTES
        if job.resume.offset is not None:
            headers[RESUMED_FROM_HEADER] = str(job.resume.offset)
        return headers

    def _usage(self, job: AdmittedSpeech, num_pcm_bytes: int) -> dict:
        """OpenAI's usage shape (prompt tokens, codec tokens spoken), then audio_seconds.

        `num_pcm_bytes` counts the model's PCM at its own rate, before the resampling to
        OUTPUT_RATE: the same duration, and the codec tokens are the model's."""
        cfg = self.plan.cfg
        samples = num_pcm_bytes // 2
        input_tokens = len(job.speech.prompt.token_ids)  # a voice's: its phoneme ids
        # A voice samples no codec tokens: its output is counted in audio_seconds alone.
        output_tokens = samples // cfg.vocoder.samples_per_token if cfg is not None else 0
        return {
            "input_tokens": input_tokens, "output_tokens": output_tokens,
            "total_tokens": input_tokens + output_tokens,
            "audio_seconds": samples / self.plan.sample_rate,
        }

    def _record(self, started: float, first: float | None, num_bytes: int) -> None:
        now = time.perf_counter()
        self.metrics.count("ok")
        self.metrics.audio_seconds.inc(num_bytes / 2 / self.plan.sample_rate)
        self.metrics.latency.observe(now - started)
        if first is not None:
            self.metrics.first_audio.observe(first - started)


def serve(plan: ServePlan) -> int:
    """Run one replica until it is told to stop; return the process exit code."""
    torch.set_num_threads(plan.threads)
    # The talker thread gives up the GIL around every torch op; with the default 5 ms switch
    # interval, getting it back from the event loop or vocoder thread can cost up to that
    # much per op (the convoy effect). A short interval keeps the step loop moving.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        sock = bind_socket(plan.options.host, plan.options.port)
    except PortInUse as exc:
        log.error("%s", exc)
        return ExitCode.USAGE
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s", plan.options.host, plan.options.port, exc)
        return ExitCode.USAGE
    with contextlib.suppress(ImportError):
        import uvloop  # optional: faster event loop when installed

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())

    async def main() -> int:
        return await ReplicaServer(plan).run(sock)

    code = asyncio.run(main())
    if code == ExitCode.LEADER_GONE:
        # Stopped cleanly, but without the interpreter's teardown (torch's alone takes about
        # half a second): a follower whose leader is gone is out right after its clean stop.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
