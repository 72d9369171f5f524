"""`omni-dp plan`: how many replicas fit this machine. Its machine flags are launch's own
fields (omni_dp/launcher/planning/options.py); the probe and the counting are omni_dp/bench's."""

from __future__ import annotations

import click

from omni_dp.cli.common import emit, exit_with_problems, format_options, options_from
from omni_dp.launcher.planning.options import LaunchOptions

# The settings of `launch` that decide one replica's footprint and where it runs.
PLAN_FIELDS = ("gpu", "gpus", "kv_cache_bytes", "max_total_tokens", "memory_headroom",
               "engine", "engine_python", "engine_overhead", "engine_stage")


@click.command(context_settings={"ignore_unknown_options": False})
@options_from(
    LaunchOptions, only=PLAN_FIELDS,
    gpu={"help": "The GPU to plan for (auto: GPU 0 when there is one; none: the CPU); --gpus "
                 "for several."},
    gpus={"help": "Several GPUs (exclusive with --gpu): N is counted per GPU (on the one with "
                  "the least usable memory), and in all."})
@click.option("--cores-per-replica", type=click.IntRange(min=1), default=1, show_default=True,
              metavar="N", help="Whole physical cores each replica's CPU block must have at "
                                "least.")
@format_options("the plan")
@click.argument("engine_args", nargs=-1, type=click.UNPROCESSED, metavar="[-- ENGINE ARGS]")
def plan(cores_per_replica: int, fmt: str, engine_args: tuple[str, ...],
         **flags) -> None:
    """How many replicas FIT this machine (not whether they are faster: `omni-dp bench`).

    Probes one replica as `launch` would (the built-in engine's dry run, or an external
    engine's model directory and KV pin), reads the CPU cores and the GPU, and prints each
    limit on N with its formula: memory (with and without --share-weights), whole-core CPU
    blocks, MPS's client limit; then the candidate configurations and the exact `omni-dp
    bench` command that would measure them. Pin the KV (--max-total-tokens or
    --kv-cache-bytes) to plan the size you will run.

    Exit codes: 0 planned, 2 bad options or machine (nothing started).
    """
    from omni_dp.bench.probe import CapacityPlanError, probe_capacity

    options = LaunchOptions(**flags, engine_args=tuple(engine_args))
    try:
        planned = probe_capacity(options, cores_per_replica=cores_per_replica)
    except CapacityPlanError as exc:
        exit_with_problems("plan", exc.problems)
    if fmt == "json":
        emit(planned.to_json(), "", as_json=True)
    else:
        from omni_dp.tables import render

        render([planned.grid()], fmt)
