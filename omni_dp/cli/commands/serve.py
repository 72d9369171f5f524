"""`omni-dp serve` and `omni-dp save-weights`: one replica, and the weights it can load.

The options come from omni_dp/engine/options.py (torch-free); the engine itself is imported
only when a command runs.
"""

from __future__ import annotations

import json
import sys

import click

from omni_dp.cli.common import (
    exit_with_problems,
    fail,
    log_format_option,
    log_level_option,
    options_from,
    setup_logging,
)
from omni_dp.engine.options import ServeOptions

DEFAULTS = ServeOptions()


@click.command()
@options_from(ServeOptions)
@click.option("--dry-run", is_flag=True,
              help="Validate the options, print the plan as JSON (weights, KV) and exit.")
@log_level_option("Least severe log messages written to stderr.")
@log_format_option()
def serve(log_level: str, log_format: str, dry_run: bool, **kwargs) -> None:
    """Serve ONE replica of the built-in TTS pipeline over HTTP.

    The pipeline is preprocess → talker (a decoder-only transformer over a paged KV cache,
    continuous batching) → vocoder (streaming, 24 kHz 16-bit PCM). Endpoints: POST
    /v1/audio/speech, GET /health, /get_server_info, /v1/models, /metrics.

    Exit codes: 0 after SIGTERM/SIGINT and draining, 2 bad options (nothing started),
    3 start-up or engine failure (a follower that cannot attach), 4 a --share-weights
    follower whose leader is gone.
    """
    from omni_dp.engine.plan import ServePlanError, plan_serve, plan_summary

    try:
        plan = plan_serve(ServeOptions(**kwargs))
    except ServePlanError as exc:
        exit_with_problems("serve", exc.problems)
    if dry_run:
        click.echo(json.dumps(plan_summary(plan)))
        return
    setup_logging(log_level, log_format)
    from omni_dp.engine.server import serve as run_server

    sys.exit(run_server(plan))


@click.command("save-weights")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--model", default=DEFAULTS.model, show_default=True,
              type=click.Choice(["tiny", "small"]), help="Preset whose seeded weights to write.")
@click.option("--weight-seed", default=DEFAULTS.weight_seed, show_default=True, type=int,
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
        fail("save-weights", f"{path} already holds {', '.join(existing)}; pass --force to "
                             "overwrite")
    models = seeded_models(PRESETS[model], weight_seed)
    save_models(models, path)
    params = sum(models.num_parameters.values())
    click.echo(f"wrote {model} (seed {weight_seed}, {params:,} parameters) to {path}")
