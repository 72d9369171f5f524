"""The `omni-dp` command line. Thin: parse, validate, call into one package.

Each command imports its package inside the function, so `omni-dp --help` and the commands that
do not compute never import torch.
"""

from __future__ import annotations

import json
import math
import sys

import click

from omni_dp import __version__
from omni_dp.sizes import parse_size


class SizeParam(click.ParamType):
    """A byte size such as 2GiB, 512MiB or 4096."""

    name = "SIZE"

    def convert(self, value, param, ctx):
        try:
            return parse_size(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


SIZE = SizeParam()


def _finite(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    """nan and inf parse as floats and then pass every bound check (nan compares false with
    everything): refuse them where no plan checks the number."""
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number", ctx, param)
    return value


# The router's policies (omni_dp/router/policies), named here so that `--help` need not import
# the router; a test keeps the lists equal.
POLICIES = ("least_request", "round_robin", "power_of_two", "random")


def _exit_with_problems(command: str, problems: list[str]) -> None:
    """Every problem of a plan, one per line, then exit 2: nothing was started."""
    for problem in problems:
        click.echo(f"omni-dp {command}: {problem}", err=True)
    sys.exit(2)


def _setup_logging(level: str, log_format: str) -> None:
    from omni_dp.logs import setup_logging

    setup_logging(level, log_format)


# The formats of omni_dp/logs.py, named here so that `--help` need not import it.
LOG_FORMATS = ("text", "json")


def _log_format_option(envvar: str | None = None, more: str = ""):
    """`--log-format` for the commands that log; from the environment where they read it."""
    also = f" Also read from {envvar}." if envvar else ""
    return click.option(
        "--log-format", default="text", show_default=True, type=click.Choice(LOG_FORMATS),
        envvar=envvar,
        help="Log lines as text, or as one JSON object per line (time, level, logger, message, "
             f"fields).{more}{also}")


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="omni-dp")
def cli() -> None:
    """Run N replicas of a multi-stage omni model pipeline on one GPU, and prove it."""


@cli.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8100, show_default=True, type=int,
              help="TCP port to listen on (0 picks a free one and logs it).")
@click.option("--model", default="tiny", show_default=True, metavar="tiny|small|DIR",
              help="A preset with seeded weights (tiny: ~3M params, for CPU and tests; small: "
                   "~80M, for GPU demos), or a directory written by `omni-dp save-weights`.")
@click.option("--weight-seed", default=0, show_default=True, type=int,
              help="Seed of a preset's weights; replicas with equal seeds sound the same.")
@click.option("--device", default="auto", show_default=True, metavar="auto|cpu|cuda[:N]",
              help="Where the talker and vocoder run; auto = cuda:0 when CUDA is available.")
@click.option("--dtype", default="auto", show_default=True,
              type=click.Choice(["auto", "float64", "float32", "bfloat16", "float16"]),
              help="Talker weights and KV dtype. auto = float64 on CPU (output independent of "
                   "batching) and bfloat16 on CUDA.")
@click.option("--threads", type=int, default=None,
              help="Torch intra-op threads. [default: the CPUs this process may run on]")
@click.option("--kv-cache-bytes", type=SIZE, default=None,
              help="Size the KV pool by memory: floor(SIZE / (page × bytes per token)) pages.")
@click.option("--max-total-tokens", type=int, default=None,
              help="Size the KV pool by capacity: exactly this many tokens (a whole number of "
                   "pages). [default: 16384 when neither knob is given]")
@click.option("--page-size", default=16, show_default=True, type=int,
              help="Tokens per KV page.")
@click.option("--max-running-requests", default=32, show_default=True, type=int,
              help="Largest running batch; more requests wait in the queue.")
@click.option("--max-queued-requests", default=256, show_default=True, type=int,
              help="Requests that may wait beyond the running batch; more get 503 + Retry-After.")
@click.option("--max-input-chars", default=2000, show_default=True, type=int,
              help="Longest accepted input text, after normalisation.")
@click.option("--max-body-bytes", default="64KiB", show_default=True, type=SIZE,
              help="Largest accepted request body.")
@click.option("--drain-timeout", default=30.0, show_default=True, type=float,
              help="Seconds in-flight requests may take to finish after SIGTERM.")
@click.option("--served-model-name", default=None,
              help="Model id shown by /v1/models and in the metrics' model_name label; a "
                   "request's `model` must be it, absent, or an OpenAI TTS name (tts-1, "
                   "tts-1-hd, gpt-4o-mini-tts), else 404. [default: omni-dp-<preset>]")
@click.option("--dry-run", is_flag=True,
              help="Validate the options, print the plan as JSON (weights, KV) and exit.")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]),
              help="Least severe log messages written to stderr.")
@_log_format_option()
def serve(log_level: str, log_format: str, dry_run: bool, **kwargs) -> None:
    """Serve ONE replica of the built-in TTS pipeline over HTTP.

    The pipeline is preprocess → talker (a decoder-only transformer over a paged KV cache,
    continuous batching) → vocoder (streaming, 24 kHz 16-bit PCM). Endpoints: POST
    /v1/audio/speech, GET /health, /get_server_info, /v1/models, /metrics.

    Exit codes: 0 after SIGTERM/SIGINT and draining, 2 bad options (nothing started),
    3 start-up or engine failure.
    """
    from omni_dp.engine.plan import ServeOptions, ServePlanError, plan_serve

    options = ServeOptions(**kwargs)
    try:
        plan = plan_serve(options)
    except ServePlanError as exc:
        _exit_with_problems("serve", exc.problems)
    if dry_run:
        from omni_dp.engine.plan import plan_summary

        click.echo(json.dumps(plan_summary(plan)))
        return
    _setup_logging(log_level, log_format)
    from omni_dp.engine.server import serve as run_server

    sys.exit(run_server(plan))


@cli.command("save-weights")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--model", default="tiny", show_default=True, type=click.Choice(["tiny", "small"]),
              help="Preset whose seeded weights to write.")
@click.option("--weight-seed", default=0, show_default=True, type=int,
              help="Seed of the weights.")
@click.option("--force", is_flag=True, help="Overwrite a directory that already holds weights.")
def save_weights(directory: str, model: str, weight_seed: int, force: bool) -> None:
    """Write a preset's seeded weights to DIRECTORY (config.json + model.safetensors).

    `omni-dp serve --model DIRECTORY` then serves exactly these weights.
    """
    from pathlib import Path

    from omni_dp.engine.config import CONFIG_FILE, PRESETS, WEIGHTS_FILE
    from omni_dp.engine.weights import save_models, seeded_models

    path = Path(directory)
    existing = [name for name in (CONFIG_FILE, WEIGHTS_FILE) if (path / name).exists()]
    if existing and not force:
        _fail("save-weights", f"{path} already holds {', '.join(existing)}; pass --force to "
                              "overwrite")
    models = seeded_models(PRESETS[model], weight_seed)
    save_models(models, path)
    params = sum(models.num_parameters.values())
    click.echo(f"wrote {model} (seed {weight_seed}, {params:,} parameters) to {path}")


@cli.command()
@click.option("--replica", "replicas", multiple=True, metavar="[ID=]URL",
              help="A replica to route to, e.g. http://127.0.0.1:8101 or 0=http://…; repeat "
                   "for each. The id defaults to the position. More can be added at runtime "
                   "with POST /workers.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8000, show_default=True, type=int, help="TCP port to listen on.")
@click.option("--policy", default="least_request", show_default=True,
              type=click.Choice(POLICIES),
              help="How a replica is chosen among the routable ones with room.")
@click.option("--workers", default=1, show_default=True, type=int,
              help="Router processes sharing the port (SO_REUSEPORT), for when one core is the "
                   "limit. Bounds are split between them.")
@click.option("--api-key", default=None, envvar="OMNI_DP_API_KEY",
              help="Require `Authorization: Bearer KEY` (or X-API-Key) on every route but "
                   "/health, /ready, /live and /metrics. Also read from OMNI_DP_API_KEY.")
@click.option("--admin-allow-remote", is_flag=True,
              help="Let non-loopback clients use /workers (loopback only by default).")
@click.option("--max-inflight", type=int, default=None,
              help="Requests in flight through the router; more get 503 + Retry-After at once. "
                   "[default: --max-inflight-per-replica × replicas]")
@click.option("--max-inflight-per-replica", default=256, show_default=True, type=int,
              help="Requests in flight to one replica; also its upstream connection pool size.")
@click.option("--max-body-bytes", default="64MiB", show_default=True, type=SIZE,
              help="Largest accepted request body (413 beyond).")
@click.option("--max-body-readers", type=int, default=None,
              help="Requests whose body is still arriving; more get 503 + Retry-After. Bodies "
                   "are read before a request takes an in-flight slot, so slow senders never "
                   "hold those. [default: 4 × the --max-inflight bound]")
@click.option("--body-timeout", default=30.0, show_default=True, type=float,
              help="Seconds a request body may take to arrive (408 beyond).")
@click.option("--header-timeout", default=30.0, show_default=True, type=float,
              help="Seconds a connection may take to send a complete request head, from when "
                   "it opened or its previous response ended; idle keep-alive connections "
                   "close after it too.")
@click.option("--connect-timeout", default=5.0, show_default=True, type=float,
              help="Seconds to connect to a replica.")
@click.option("--request-timeout", default=1800.0, show_default=True, type=float,
              help="Seconds a whole proxied request may take.")
@click.option("--no-retry", is_flag=True,
              help="Never retry, not even a request whose connection failed before any byte "
                   "was sent (retried once on another replica by default).")
@click.option("--health-interval", default=5.0, show_default=True, type=float,
              help="Seconds between active /health checks of each replica.")
@click.option("--health-timeout", default=2.0, show_default=True, type=float,
              help="Seconds a /health check may take.")
@click.option("--health-failures", default=3, show_default=True, type=int,
              help="Consecutive failures (checks, connection errors, 502/504) that eject.")
@click.option("--health-successes", default=2, show_default=True, type=int,
              help="Consecutive passing checks that re-admit an ejected replica.")
@click.option("--health-jitter", default=0.2, show_default=True, type=float,
              help="Each check interval is scaled by a random factor in [1-J, 1+J].")
@click.option("--drain-timeout", default=30.0, show_default=True, type=float, callback=_finite,
              help="Seconds in-flight requests may take to finish after SIGTERM.")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]),
              help="Least severe log messages written to stderr (route lines are info).")
@_log_format_option("OMNI_DP_LOG_FORMAT")
def router(replicas, log_level, drain_timeout, no_retry, health_interval, health_timeout,
           health_failures, health_successes, health_jitter, connect_timeout,
           request_timeout, body_timeout, header_timeout, **options) -> None:
    """Route HTTP traffic over replicas: one endpoint that keeps every replica driven.

    Any path is forwarded byte for byte to one replica and the answer streamed back. Ops:
    GET /health, /ready, /live, /metrics. Admin (loopback): GET/POST /workers,
    PUT/DELETE /workers/ID.

    Exit codes: 0 stopped by SIGTERM/SIGINT, 2 bad options or port taken (nothing started),
    3 a router worker process died.
    """
    from omni_dp.router.config import HealthConfig, RouterConfigError, plan_router

    log_format = options.pop("log_format")  # the log set-up's, not the router config's
    health = HealthConfig(
        interval_s=health_interval, timeout_s=health_timeout, failure_threshold=health_failures,
        success_threshold=health_successes, jitter=health_jitter,
    )
    try:
        config = plan_router(
            list(replicas), health=health, retry_connect_failures=not no_retry,
            connect_timeout_s=connect_timeout, request_timeout_s=request_timeout,
            body_timeout_s=body_timeout, header_timeout_s=header_timeout, **options,
        )
    except RouterConfigError as exc:
        _exit_with_problems("router", exc.problems)
    _setup_logging(log_level, log_format)
    from omni_dp.router.workers import run_router

    sys.exit(run_router(config, drain_s=drain_timeout))


def _emit(data: dict, text: str, as_json: bool) -> None:
    click.echo(json.dumps(data, indent=2) if as_json else text.rstrip("\n"))


@cli.command("verify-mps")
@click.argument("run_id", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--no-nvml", is_flag=True, help="Skip the NVML cross-check of GPU processes.")
def verify_mps(run_id: str | None, as_json: bool, no_nvml: bool) -> None:
    """Re-prove that every GPU process of every replica of a live run is an MPS client.

    Reads the run's state (OMNI_DP_STATE_DIR, default $XDG_RUNTIME_DIR or /tmp /omni-dp-UID),
    queries the run's private MPS daemon, rewrites mps_attach.txt/.json in the run directory and
    prints the map. With no RUN_ID it takes the only live run.

    Exit codes: 0 PASS, 1 FAIL, 2 cannot check (the message says why).
    """
    from omni_dp.mps.attach import format_text
    from omni_dp.mps.runs import CannotCheck, pick_run, verify_run

    try:
        run = pick_run(run_id)
        report = verify_run(run, use_nvml=not no_nvml)
    except CannotCheck as exc:
        if as_json:
            click.echo(json.dumps({"result": "CANNOT_CHECK", "reason": str(exc)}, indent=2))
        else:
            click.echo(f"omni-dp verify-mps: cannot check: {exc}", err=True)
        sys.exit(2)
    _emit({"run_id": run.run_id, **report.to_json()},
          f"run {run.run_id}\n{format_text(report)}", as_json)
    sys.exit(0 if report.passed else 1)


@cli.group()
def mps() -> None:
    """Manage a private MPS control daemon on its own (the launcher does this for a run)."""


_STATE_DIR = click.option(
    "--state-dir", required=True, type=click.Path(file_okay=False),
    help="Directory that holds mps/pipe, mps/log and mps/daemon.json (keep its path short: "
         "the control socket path must fit in 107 bytes).")
_MPS_CONTROL = click.option(
    "--mps-control", default=None, metavar="PATH",
    help="The nvidia-cuda-mps-control binary (its nvidia-cuda-mps-server is found beside it). "
         "[default: $OMNI_DP_MPS_CONTROL, then PATH, /usr/local/nvidia/bin, /usr/bin, next to "
         "nvidia-smi]")


def _mps_paths(state_dir: str):
    from pathlib import Path

    from omni_dp.rundir import mps_log_dir, mps_pipe_dir

    base = Path(state_dir).absolute()
    return mps_pipe_dir(base), mps_log_dir(base), base / "mps" / "daemon.json"


def _fail(command: str, message: str, code: int = 2) -> None:
    click.echo(f"omni-dp {command}: {message}", err=True)
    sys.exit(code)


@mps.command("start")
@_STATE_DIR
@_MPS_CONTROL
@click.option("--gpu", default="0", show_default=True, metavar="INDEX|UUID",
              help="The GPU the daemon serves (its UUID goes into CUDA_VISIBLE_DEVICES).")
@click.option("--mps-thread-percentage", type=click.FloatRange(0, 100, min_open=True),
              default=None, callback=_finite,
              help="Default active thread percentage for the MPS server.")
@click.option("--mps-memory-limit", type=SIZE, default=None,
              help="Default pinned device memory limit per client, e.g. 20GiB.")
@click.option("--no-gpu-check", is_flag=True,
              help="Start even where NVML sees no usable GPU (to test the daemon itself; no "
                   "client can attach there).")
@click.option("--json", "as_json", is_flag=True, help="Print the daemon record as JSON.")
def mps_start(state_dir, mps_control, gpu, mps_thread_percentage, mps_memory_limit,
              no_gpu_check, as_json) -> None:
    """Start a private MPS control daemon under --state-dir and record it."""
    from omni_dp.files import atomic_write
    from omni_dp.mps.control import MpsControl, MpsControlError
    from omni_dp.mps.daemon import MpsDaemon, MpsDaemonError
    from omni_dp.mps.preflight import GPU_CHECKS, format_report, run_preflight

    pipe, log_dir, record_path = _mps_paths(state_dir)
    report = run_preflight(control_binary=mps_control, gpu=gpu, pipe_dir=str(pipe),
                           num_client_processes=0)
    blocking = [p for p in report.problems if not (no_gpu_check and p.check in GPU_CHECKS)]
    if blocking:
        _fail("mps start", "cannot start the MPS daemon:\n" + format_report(report))
    if record_path.exists():
        _fail("mps start", f"{record_path} exists: a daemon was started here; run "
                           f"`omni-dp mps stop --state-dir {state_dir}` first")
    found = report.binaries
    assert found is not None  # else a control_binary problem stopped it above
    click.echo(found.describe(), err=as_json)  # which pair, where from, which versions
    try:
        control = MpsControl(found.control, str(pipe), str(log_dir), server_binary=found.server)
        record = MpsDaemon(control).start(
            gpu_uuid=report.gpu.uuid if report.gpu else None,
            thread_percentage=mps_thread_percentage, memory_limit_bytes=mps_memory_limit,
        )
    except (MpsControlError, MpsDaemonError) as exc:
        _fail("mps start", str(exc), code=3)
    atomic_write(record_path, json.dumps(record.to_json(), indent=2) + "\n")
    _emit(record.to_json(), f"MPS control daemon pid {record.identity.pid} serving "
          f"CUDA_MPS_PIPE_DIRECTORY={record.pipe_dir}", as_json)


def _load_record(state_dir: str, command: str):
    from omni_dp.mps.daemon import DaemonRecord

    record_path = _mps_paths(state_dir)[2]
    try:
        return DaemonRecord.from_json(json.loads(record_path.read_text())), record_path
    except FileNotFoundError:
        _fail(command, f"no daemon recorded under {state_dir} ({record_path} is missing)")
    except (OSError, ValueError, KeyError) as exc:
        _fail(command, f"cannot read {record_path}: {exc!r}")


@mps.command("stop")
@_STATE_DIR
@click.option("--force", is_flag=True, help="Quit even while MPS clients are attached.")
def mps_stop(state_dir, force) -> None:
    """Stop the daemon recorded under --state-dir: quit, then wait for its pid to exit."""
    from omni_dp.mps.daemon import MpsDaemon, MpsDaemonError

    record, record_path = _load_record(state_dir, "mps stop")
    try:
        was_running = MpsDaemon(record.control()).stop(record, force=force)
    except MpsDaemonError as exc:
        _fail("mps stop", str(exc), code=1)
    record_path.unlink()
    click.echo(f"MPS control daemon pid {record.identity.pid} "
               + ("stopped" if was_running else "was not running; its record is removed"))


@mps.command("status")
@_STATE_DIR
@click.option("--json", "as_json", is_flag=True, help="Print the health as JSON.")
def mps_status(state_dir, as_json) -> None:
    """Is the recorded daemon alive, answering, which servers, any MPS faults in its logs.

    Exit codes: 0 healthy, 1 not (dead, unreachable or faults logged), 2 nothing recorded.
    """
    from omni_dp.mps.daemon import MpsDaemon

    record, _ = _load_record(state_dir, "mps status")
    health = MpsDaemon(record.control()).health(record)
    lines = [
        f"daemon pid {record.identity.pid}: {'alive' if health.alive else 'NOT RUNNING'}, "
        f"{'answering' if health.reachable else 'not answering'}",
        f"servers: {', '.join(map(str, health.servers)) or 'none'}",
        *[f"fault: {line}" for line in health.faults],
    ]
    if health.error:
        lines.append(f"error: {health.error}")
    _emit({"daemon": record.to_json(), **health.to_json()}, "\n".join(lines), as_json)
    sys.exit(0 if health.ok else 1)


# --- a run: launch, status, list, logs, down -----------------------------------------------


@cli.command(context_settings={"ignore_unknown_options": False})
@click.option("--replicas", "-n", type=int, default=1, show_default=True,
              help="How many complete replicas of the pipeline to run.")
@click.option("--mps", is_flag=True,
              help="Run the replicas under a private CUDA MPS daemon and prove every GPU "
                   "process attached.")
@click.option("--gpu", default="auto", show_default=True, metavar="auto|none|INDEX|UUID",
              help="The one GPU (auto: GPU 0 when there is one; none: run on CPU).")
@click.option("--cpu-blocks", default="auto", show_default=True, metavar='auto|none|"0-3 4-7"',
              help="CPU cores per replica: auto (disjoint whole cores, GPU's NUMA node first), "
                   "none (unpinned) or one CPU list per replica.")
@click.option("--kv-cache-bytes", type=SIZE, default=None,
              help="Pin every replica's KV pool to this many bytes, e.g. 2GiB.")
@click.option("--max-total-tokens", type=int, default=None,
              help="Pin every replica's KV pool to this many tokens.")
@click.option("--start", type=click.Choice(["sequential", "parallel"]), default=None,
              help="Start the replicas one after another, or together.  [default: parallel "
                   "(every replica's KV is a fixed size)]")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address the router listens on (replicas always listen on 127.0.0.1).")
@click.option("--router-port", type=int, default=8000, show_default=True)
@click.option("--base-port", type=int, default=8100, show_default=True,
              help="Replica i listens on BASE_PORT + i.")
@click.option("--policy", default="least_request", show_default=True,
              type=click.Choice(POLICIES),
              help="The router's load-balancing policy.")
@click.option("--router-workers", type=int, default=1, show_default=True,
              help="Router processes sharing the port (SO_REUSEPORT).")
@click.option("--run-id", default=None, help="Name the run (default: run-DATE-TIME-XXXX).")
@click.option("--detach", is_flag=True,
              help="Return once the run is verified; a background supervisor keeps it up.")
@click.option("--config", "config_file", default=None, metavar="FILE",
              help="A YAML file with these settings (dashes or underscores); flags win.")
@click.option("--mps-control", default=None, metavar="PATH",
              help="The nvidia-cuda-mps-control binary (its nvidia-cuda-mps-server is found "
                   "beside it). [default: $OMNI_DP_MPS_CONTROL, then PATH, "
                   "/usr/local/nvidia/bin, /usr/bin, next to nvidia-smi]")
@click.option("--no-gpu-check", is_flag=True,
              help="With --mps where NVML sees no GPU: start the daemon anyway (exercises the "
                   "machinery; attach verification cannot pass without GPU clients).")
@click.option("--health-timeout", type=float, default=300.0, show_default=True,
              help="Seconds a replica may take to become healthy.")
@click.option("--drain-timeout", type=float, default=30.0, show_default=True,
              help="Seconds in-flight requests get when a replica or the router stops.")
@click.option("--check-interval", type=float, default=2.0, show_default=True,
              help="Seconds between supervision sweeps.")
@click.option("--health-failures", type=int, default=3, show_default=True,
              help="Consecutive failed /health checks before a replica is restarted.")
@click.option("--restart-budget", type=int, default=5, show_default=True,
              help="Restarts per replica within --restart-window before it is marked failed.")
@click.option("--restart-window", type=float, default=600.0, show_default=True)
@click.option("--on-mps-fault", type=click.Choice(["restart", "fail"]), default="restart",
              show_default=True,
              help="If the MPS daemon dies or logs a fault: restart it and every replica, or "
                   "stop the run.")
@click.option("--memory-headroom", type=float, default=0.05, show_default=True,
              help="Fraction of GPU memory the fit check keeps free.")
@click.option("--api-key", default=None, envvar="OMNI_DP_API_KEY", metavar="KEY",
              help="The router requires `Authorization: Bearer KEY` (but on /health, /ready, "
                   "/live, /metrics); the supervisor's admin calls send it. Passed by "
                   "environment, never written to the run's state. Also read from "
                   "OMNI_DP_API_KEY.")
@_log_format_option("OMNI_DP_LOG_FORMAT", " Passed on to the supervisor, replicas and router.")
@click.option("--dry-run", is_flag=True, help="Print the plan and exit; start nothing.")
@click.option("--json", "as_json", is_flag=True, help="With --dry-run: the plan as JSON.")
@click.argument("engine_args", nargs=-1, type=click.UNPROCESSED, metavar="[-- ENGINE ARGS]")
@click.pass_context
def launch(ctx, config_file, dry_run, as_json, engine_args, **flags) -> None:
    """Run N replicas on one GPU behind one router, verified, and supervise them.

    Preflight checks everything first and exits 2 with every problem before anything exists.
    Then: state dir, (--mps) private MPS daemon, replicas pinned to CPU blocks, health, equal
    KV, (--mps) attachment of every CUDA process, router. Arguments after `--` go to every
    replica's engine (e.g. -- --model small).

    Exit codes: 0 stopped cleanly (or detached), 2 bad options/machine (nothing created),
    3 a failure after start (torn down; state kept for diagnosis).
    """
    from click.core import ParameterSource

    from omni_dp.launcher.facts import gather_facts
    from omni_dp.launcher.options import load_config_file, merge_options
    from omni_dp.launcher.plan import LaunchPlanError, check_options, plan_launch

    problems: list[str] = []
    file_values = load_config_file(config_file, problems) if config_file else {}
    given = {name: value for name, value in flags.items()
             if ctx.get_parameter_source(name) != ParameterSource.DEFAULT}
    if engine_args:
        given["engine_args"] = tuple(engine_args)
    defaults = {name: value for name, value in flags.items() if name not in given}
    options = merge_options({**defaults, **file_values}, given, config_file)
    say = _launch_say(options.log_format)
    preflight = "preflight (CPU topology, GPU, ports, engine dry run)…"
    if options.log_format == "json":  # on stderr in both formats: stdout may be --json's plan
        from omni_dp.logs import json_line

        click.echo(json_line("omni_dp.launch", preflight), err=True)
    else:
        click.echo(f"omni-dp launch: {preflight}", err=True)
    facts = gather_facts(options, option_problems=problems + check_options(options))
    try:  # the config file's problems and the plan's, all at once
        plan = plan_launch(options, facts, earlier_problems=problems)
    except LaunchPlanError as exc:
        _exit_with_problems("launch", exc.problems)
    if dry_run:
        _emit({"run_id": plan.run_id, **plan.to_json(),
               "replica_plans": [{"index": r.index, "port": r.port, "cpus": r.cpus,
                                  "argv": list(r.argv)} for r in plan.replicas]},
              "\n".join(plan.describe()), as_json)
        return
    if options.log_format == "json":
        say("\n".join(plan.describe()))
    else:
        click.echo("\n".join(plan.describe()))
    from omni_dp.launcher.launch import launch as run_launch

    sys.exit(run_launch(plan, say=say))


def _launch_say(log_format: str):
    """How launch and its foreground supervisor report: `omni-dp: …` lines, or with json one
    JSON log line each; both on stdout."""
    if log_format != "json":
        return lambda line: click.echo(f"omni-dp: {line}")
    import logging

    from omni_dp.logs import setup_logging

    setup_logging("info", "json", stream=sys.stdout)
    return logging.getLogger("omni_dp.launch").info


def _pick_run(run_id: str | None, command: str):
    from omni_dp.launcher.state import StateError
    from omni_dp.launcher.status import NoSuchRun, pick

    try:
        return pick(run_id, command)
    except (NoSuchRun, StateError) as exc:
        _fail(command, str(exc))


@cli.command()
@click.argument("run_id", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
def status(run_id: str | None, as_json: bool) -> None:
    """A run's replicas (pid, CPU block, port, health, KV, MPS, restarts), router, daemon.

    With no RUN_ID: the only live run. Exit codes: 0 every replica healthy, 1 not (or the run
    is abandoned: nothing owns it), 2 no such run.
    """
    from omni_dp.launcher.facts import invoked_as
    from omni_dp.launcher.status import collect, format_status

    state = _pick_run(run_id, "status")
    report = collect(state)
    _emit(report, format_status(report, invoked_as()), as_json)
    healthy = report["replicas"] and all(r["health"] == "healthy" for r in report["replicas"])
    sys.exit(0 if healthy and report["state"] != "abandoned" else 1)


@cli.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print the runs as JSON.")
def list_runs(as_json: bool) -> None:
    """Every run under the state directory, live or kept after a failure."""
    from omni_dp.launcher.state import RunState, StateError
    from omni_dp.launcher.status import collect, run_dirs

    rows = []
    for directory in run_dirs():
        try:
            report = collect(RunState.load(directory), probe=False)
        except StateError as exc:
            rows.append({"run_id": directory.name, "state": "unreadable", "error": str(exc)})
            continue
        rows.append({"run_id": report["run_id"], "state": report["state"],
                     "replicas": len(report["replicas"]), "router": report["router"]["url"],
                     "gpu": report["gpu"], "directory": report["directory"]})
    text = "\n".join(
        f"{r['run_id']}  {r['state']}  " + (f"{r['replicas']} replica(s)  {r['router']}  "
                                            f"{r['gpu']}" if "replicas" in r else r["error"])
        for r in rows) or "no runs"
    _emit({"runs": rows}, text, as_json)


@cli.command()
@click.argument("run_id", required=False)
@click.option("--replica", type=int, default=None, help="Only this replica's log.")
@click.option("--router", "router_log", is_flag=True, help="Only the router's log.")
@click.option("--supervisor", "supervisor_log", is_flag=True, help="Only the supervisor's log.")
@click.option("-f", "--follow", is_flag=True,
              help="Keep printing lines as they are completed (Ctrl-C stops; so does `down`).")
@click.option("-n", "--lines", type=click.IntRange(min=0), default=50, show_default=True,
              help="How many last lines to print first (0: none).")
def logs(run_id, replica, router_log, supervisor_log, follow, lines) -> None:
    """Print a run's logs (replicas, router, supervisor), optionally following them.

    With several logs each line is prefixed with its log's name. Following prints whole lines
    only, and goes on in a log the supervisor replaced (after an MPS fault) from its start.
    """
    import contextlib
    import time

    from omni_dp.logs import Follower, last_lines

    state = _pick_run(run_id, "logs")
    names = sorted(p.name for p in state.logs.glob("*.log"))
    if replica is not None:
        names = [f"replica_{replica}.log"]
    elif router_log:
        names = ["router.log"]
    elif supervisor_log:
        names = ["supervisor.log"]
    paths = [state.logs / n for n in names]
    missing = [p.name for p in paths if not p.exists()]
    if missing:
        _fail("logs", f"no {', '.join(missing)} in {state.logs}")

    def echo(path, raw_lines: list[bytes]) -> None:
        prefix = f"[{path.stem}] " if len(paths) > 1 else ""
        for raw in raw_lines:
            click.echo(prefix + raw.decode(errors="replace"))

    with contextlib.ExitStack() as stack:
        followers = []
        try:
            for path in paths:
                if not follow:
                    with open(path, "rb") as f:
                        echo(path, last_lines(f, lines, whole_only=False))
                    continue
                follower = Follower(path)
                stack.callback(follower.close)
                followers.append(follower)
                echo(path, follower.start(lines))
        except OSError as exc:  # removed by `down` meanwhile, or unreadable
            _fail("logs", f"cannot read {exc.filename}: {exc.strerror}")
        with contextlib.suppress(KeyboardInterrupt):
            while follow and state.directory.exists():
                time.sleep(0.25)
                for follower in followers:
                    echo(follower.path, follower.poll())


@cli.command()
@click.argument("run_id", required=False)
@click.option("--drain-timeout", type=click.FloatRange(min=0), default=None, callback=_finite,
              help="Seconds in-flight requests get, also when the run's supervisor does the "
                   "teardown. [default: the run's]")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def down(run_id: str | None, drain_timeout: float | None, as_json: bool) -> None:
    """Stop a run and everything it started, and nothing else; remove its state.

    Order: supervisor, router (drains), replicas (drain, then SIGKILL of proven processes
    only), MPS daemon (after its clients are gone). A run already down just has its state
    removed; one whose state is gone is nothing to stop. Exit codes: 0 nothing left, 2 which
    run is ambiguous, 3 something could not be stopped (its state is kept and the leftovers
    named).
    """
    from omni_dp.launcher.status import run_dirs
    from omni_dp.launcher.teardown import teardown
    from omni_dp.rundir import RUN_ID, run_dir, state_dir

    if run_id is None:
        gone = not run_dirs()
    else:  # a malformed id is left to _pick_run, which says what is wrong with it
        gone = bool(RUN_ID.match(run_id)) and not run_dir(state_dir(), run_id).exists()
    if gone:  # already down: nothing to stop is success
        what = f"run {run_id}" if run_id else "any run"
        _emit({"run_id": run_id, "clean": True, "removed": False, "leftovers": []},
              f"no state of {what} under {state_dir() / 'runs'}: nothing to stop", as_json)
        return
    state = _pick_run(run_id, "down")
    drain = drain_timeout if drain_timeout is not None else \
        state.plan["supervision"]["drain_timeout"]
    say = (lambda line: None) if as_json else (lambda line: click.echo(f"omni-dp: {line}"))
    result = teardown(state, drain_timeout=drain, say=say)
    data = {"run_id": state.run_id, "clean": result.clean, "removed": result.removed,
            "leftovers": result.leftovers}
    text = (f"run {state.run_id} is down; nothing left behind" if result.clean else
            f"run {state.run_id}: could not confirm everything stopped; state kept in "
            f"{state.directory}\n" + "\n".join(f"  {line}" for line in result.leftovers))
    _emit(data, text, as_json)
    sys.exit(0 if result.clean else 3)


def main() -> None:
    cli(prog_name="omni-dp")
