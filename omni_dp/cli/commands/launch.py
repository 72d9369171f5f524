"""`omni-dp launch`: its flags are the fields of omni_dp/launcher/planning/options.py; the
machine is read and the plan made by omni_dp/launcher, which then runs it."""

from __future__ import annotations

import sys

import click
from click.core import ParameterSource

from omni_dp.cli.common import (
    OUTPUT,
    POLICIES,
    SectionedCommand,
    SectionOption,
    emit,
    exit_with_problems,
    log_format_attrs,
    options_from,
    take_deprecated,
)
from omni_dp.launcher.planning.options import (
    LAUNCH_SECTIONS,
    LaunchOptions,
    load_config_file,
    merge_options,
)


@click.command(cls=SectionedCommand, sections=(*LAUNCH_SECTIONS, OUTPUT), help_section=OUTPUT,
               context_settings={"ignore_unknown_options": False})
@options_from(LaunchOptions, policy={"type": click.Choice(POLICIES)},
              log_format=log_format_attrs("OMNI_DP_LOG_FORMAT",
                                          " Passed on to the supervisor, replicas and router."))
@click.option("--dry-run", is_flag=True, help="Print the plan and exit; start nothing.",
              cls=SectionOption, section=OUTPUT)
@click.option("--json", "as_json", is_flag=True, cls=SectionOption, section=OUTPUT,
              help="With --dry-run: the plan as JSON. With --detach: once the run is up and "
                   "supervised, its summary as one JSON object on stdout (all else on stderr).")
@click.argument("engine_args", nargs=-1, type=click.UNPROCESSED, metavar="[-- ENGINE ARGS]")
@click.pass_context
def launch(ctx, dry_run, as_json, engine_args, **flags) -> None:
    """Run N replicas on one GPU (or on each of --gpus) behind one router, verified, and
    supervise them.

    Preflight checks everything first and exits 2 with every problem before anything exists.
    Then: state dir, (--mps) a private MPS daemon per GPU, replicas pinned to CPU blocks,
    health, equal KV, (--mps) attachment of every CUDA process to its GPU's daemon, router,
    (--register) the fleet gateway. Arguments after `--` go to every replica's engine: for
    the built-in one e.g. `-- --model small`; for an external engine
    the model directory first, then the engine's own flags, e.g. `--engine vllm
    --max-total-tokens 1024 -- /models/my-llama --enforce-eager`.

    Exit codes: 0 stopped cleanly (or detached), 2 bad options/machine (nothing created),
    3 a failure after start (torn down; state kept for diagnosis).
    """
    problems: list[str] = []
    notes = take_deprecated(ctx, flags)
    options = _options(ctx, flags, tuple(engine_args), problems, notes)
    if as_json and not (dry_run or options.detach):
        problems.append("--json needs --dry-run (the plan) or --detach (the run's summary): "
                        "a foreground launch's output is its log; for JSON lines use "
                        "--log-format json")
    from omni_dp.engine.voice.default import launch_note

    fallback = launch_note(options.engine, options.engine_args)
    if fallback:  # serve's default model will be the seeded preset: its audio is noise
        notes.append(fallback)
    for note in notes:
        _note(options.log_format, note)
    _note(options.log_format, "preflight (CPU topology, GPU, ports, "
          + ("engine dry run)…" if options.engine == "builtin" else "model directory)…"))
    # (by name: the adapters are not imported to make the flags, see LaunchOptions)
    plan = _plan(options, problems)
    if dry_run:
        emit({"run_id": plan.run_id, **plan.to_json(), "gpus": plan.gpus_json(),
              "replica_plans": [{"index": r.index, "port": r.port, "cpus": r.cpus,
                                 "gpu": r.gpu, "argv": list(r.argv)} for r in plan.replicas]},
             "\n".join(plan.describe()), as_json)
        return
    from omni_dp.launcher.launch import launch as run_launch
    from omni_dp.launcher.views.launch_output import launch_output

    out = launch_output(options.log_format, summary_json=as_json)
    described = "\n".join(plan.describe())
    if options.log_format == "json":
        out.say(described)
    else:
        click.echo(described, err=as_json)  # --detach --json: stdout is the summary's
    sys.exit(run_launch(plan, out))


def _options(ctx: click.Context, flags: dict, engine_args: tuple[str, ...],
             problems: list[str], notes: list[str]) -> LaunchOptions:
    """The dataclass's defaults, then the --config file, then the flags given (an environment
    variable counts as given)."""
    config_file = flags.pop("config_file")
    file_values = load_config_file(config_file, problems, notes) if config_file else {}
    given = {name: value for name, value in flags.items()
             if ctx.get_parameter_source(name) != ParameterSource.DEFAULT}
    if engine_args:
        given["engine_args"] = engine_args
    return merge_options(file_values, given, config_file)


def _plan(options: LaunchOptions, problems: list[str]):
    """Read the machine and plan; the config file's problems and the plan's, all at once."""
    from omni_dp.launcher.planning.checks import check_options
    from omni_dp.launcher.planning.facts import gather_facts
    from omni_dp.launcher.planning.plan import LaunchPlanError, plan_launch

    facts = gather_facts(options, option_problems=problems + check_options(options))
    try:
        return plan_launch(options, facts, earlier_problems=problems)
    except LaunchPlanError as exc:
        exit_with_problems("launch", exc.problems)


def _note(log_format: str, message: str) -> None:
    """A line about the launch itself, on stderr in both formats (stdout may be --json's)."""
    if log_format == "json":
        from omni_dp.logs import json_line

        click.echo(json_line("omni_dp.launch", message), err=True)
    else:
        click.echo(f"omni-dp launch: {message}", err=True)
