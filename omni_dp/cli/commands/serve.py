"""`omni-dp serve` and `omni-dp save-weights`: one replica, and the weights it can load.

The options come from omni_dp/engine/options.py (torch-free); the engine itself is imported
only when a command runs.
"""

from __future__ import annotations

import difflib
import json
import sys

import click

from omni_dp.cli.common import (
    OUTPUT,
    SectionedCommand,
    SectionOption,
    exit_with_problems,
    fail,
    log_format_option,
    log_level_option,
    options_from,
    setup_logging,
)
from omni_dp.engine.options import OBSERVABILITY, SERVE_SECTIONS, ServeOptions

DEFAULTS = ServeOptions()


@click.command(cls=SectionedCommand, sections=(*SERVE_SECTIONS, OUTPUT), help_section=OUTPUT,
               context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@options_from(ServeOptions)
@click.option("--dry-run", is_flag=True, cls=SectionOption, section=OUTPUT,
              help="Validate the options, print the plan as JSON on stdout (weights, KV, the "
                   "placement with where each value came from) and the process table on "
                   "stderr, and exit.")
@log_level_option("Least severe log messages written to stderr.", section=OBSERVABILITY)
@log_format_option(section=OBSERVABILITY)
@click.pass_context
def serve(ctx: click.Context, log_level: str, log_format: str, dry_run: bool,
          **kwargs) -> None:
    """Serve ONE replica of the built-in TTS pipeline over HTTP.

    By default (--model auto) a trained Piper voice, joe: preprocess (sentences, espeak-ng
    phonemes) → voice (its ONNX graph on onnxruntime, streamed per sentence, 22,050 Hz, no KV
    cache); docs/voice.md. The seeded presets (--model tiny|small, noise) are preprocess →
    talker (a decoder-only transformer over a paged KV cache, continuous batching) → vocoder
    (streaming, 24 kHz 16-bit PCM). Endpoints: POST /v1/audio/speech, GET /health,
    /get_server_info, /v1/models, /metrics.

    Placement: every stage runs in this process unless --placement-config or a dotted
    option (--<stage>.<field> VALUE: process, device, gpu_memory_fraction, tp_size, devices,
    replicas; --placement.<field> VALUE) puts it elsewhere; the voice's stages are preprocess
    and voice (--voice.process voice --voice.replicas 2), the seeded presets' preprocess,
    talker and vocoder; see docs/placement.md.

    Exit codes: 0 after SIGTERM/SIGINT and draining, 2 bad options (nothing started),
    3 start-up or engine failure (a follower that cannot attach, a stage process that
    died), 4 a --share-weights follower whose leader is gone.
    """
    from omni_dp.engine.plan import ServePlanError, plan_serve, plan_summary
    from omni_dp.placement.config import split_overrides
    from omni_dp.placement.model import PlacementError

    try:
        overrides, unknown = split_overrides(ctx.args)
    except PlacementError as exc:
        exit_with_problems("serve", exc.problems)
    if unknown:
        exit_with_problems("serve", [unknown_option_problem(unknown, ctx.command)])
    from omni_dp.engine.voice.default import resolve_default_model

    _, fallback = resolve_default_model(kwargs["model"])
    if fallback:  # said first, on stderr (a replica's log): the audio will be noise
        click.echo(f"omni-dp serve: {fallback}", err=True)
    try:
        plan = plan_serve(ServeOptions(**kwargs, placement_overrides=tuple(overrides)))
    except ServePlanError as exc:
        exit_with_problems("serve", exc.problems)
    if dry_run:
        from omni_dp.placement.table import render_table

        click.echo(json.dumps(plan_summary(plan)))
        if plan.placement is not None:
            click.echo(render_table(plan.placement), err=True)
        return
    setup_logging(log_level, log_format)
    from omni_dp.engine.server import serve as run_server

    sys.exit(run_server(plan))


def unknown_option_problem(args: list[str], command: click.Command) -> str:
    """What click would have said of an unknown option, which `serve` must let through for
    the dotted placement options (an open set click cannot declare)."""
    first = args[0]
    if not first.startswith("-"):
        return f"unexpected argument {first!r}: serve takes options only"
    name = first.split("=", 1)[0]
    known = [opt for param in command.params for opt in param.opts if opt.startswith("--")]
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean {close[0]}?" if close else ""
    return (f"no such option: {name}{hint} (a stage's placement is set with dotted options: "
            "--vocoder.process NAME, or for the voice --voice.process NAME)")


@click.command("save-weights")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--model", default="tiny", show_default=True,
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
