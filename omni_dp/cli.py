"""The `omni-dp` command line. Thin: parse, validate, call into one package.

Each command imports its package inside the function, so `omni-dp --help` and the commands that
do not compute never import torch.
"""

from __future__ import annotations

import logging
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


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


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
              help="Model id shown by /v1/models. [default: omni-dp-<preset>]")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]),
              help="Least severe log messages written to stderr.")
def serve(log_level: str, **kwargs) -> None:
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
        for problem in exc.problems:
            click.echo(f"omni-dp serve: {problem}", err=True)
        sys.exit(2)
    _setup_logging(log_level)
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
        click.echo(
            f"omni-dp save-weights: {path} already holds {', '.join(existing)}; "
            "pass --force to overwrite", err=True,
        )
        sys.exit(2)
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
              type=click.Choice(["least_request", "round_robin", "power_of_two", "random"]),
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
@click.option("--drain-timeout", default=30.0, show_default=True, type=float,
              help="Seconds in-flight requests may take to finish after SIGTERM.")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]),
              help="Least severe log messages written to stderr (route lines are info).")
def router(replicas, log_level, drain_timeout, no_retry, health_interval, health_timeout,
           health_failures, health_successes, health_jitter, connect_timeout,
           request_timeout, **options) -> None:
    """Route HTTP traffic over replicas: one endpoint that keeps every replica driven.

    Any path is forwarded byte for byte to one replica and the answer streamed back. Ops:
    GET /health, /ready, /live, /metrics. Admin (loopback): GET/POST /workers,
    PUT/DELETE /workers/ID.

    Exit codes: 0 stopped by SIGTERM/SIGINT, 2 bad options or port taken (nothing started),
    3 a router worker process died.
    """
    from omni_dp.router.config import HealthConfig, RouterConfigError, plan_router

    health = HealthConfig(
        interval_s=health_interval, timeout_s=health_timeout, failure_threshold=health_failures,
        success_threshold=health_successes, jitter=health_jitter,
    )
    try:
        config = plan_router(
            list(replicas), health=health, retry_connect_failures=not no_retry,
            connect_timeout_s=connect_timeout, request_timeout_s=request_timeout, **options,
        )
    except RouterConfigError as exc:
        for problem in exc.problems:
            click.echo(f"omni-dp router: {problem}", err=True)
        sys.exit(2)
    _setup_logging(log_level)
    from omni_dp.router.workers import run_router

    sys.exit(run_router(config, drain_s=drain_timeout))


def main() -> None:
    cli(prog_name="omni-dp")
