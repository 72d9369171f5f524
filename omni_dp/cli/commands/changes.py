"""Day-two changes to a live run: `omni-dp restart` and `omni-dp scale`."""

from __future__ import annotations

import sys

import click

from omni_dp.cli.common import emit, exit_with_problems, fail, finite, json_option, nothing_there
from omni_dp.contract import ExitCode


class _EngineArgsCommand(click.Command):
    """Whatever follows `--` is the engine's (a model update), kept apart before click parses
    the rest, so that RUN_ID stays optional."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if "--" in args:
            cut = args.index("--")
            ctx.meta["engine_args"] = tuple(args[cut + 1:])
            args = args[:cut]
        return super().parse_args(ctx, args)


def _live(run_id: str | None, command: str):
    """The run, live, with a supervisor to make the change."""
    from omni_dp.launcher.views.status import pick
    from omni_dp.procs import is_alive
    from omni_dp.runfile import RunFileError, RunNotFound

    try:
        state = pick(run_id, command)
    except RunNotFound as exc:
        nothing_there(command, str(exc))
    except RunFileError as exc:
        fail(command, str(exc))
    supervisor = state.record.supervisor
    if supervisor is None or not is_alive(supervisor.identity):
        fail(command, f"run {state.run_id} has no live supervisor to make the change (its "
             f"state: {state.record.state.value}); `omni-dp status {state.run_id}` says more")
    return state


def _ask(command: str, state, request, as_json: bool) -> None:
    """Hand the change over, follow it, exit 0 only when every step passed."""
    from omni_dp.launcher.changes.follow import ask_and_follow
    from omni_dp.launcher.changes.request import ChangeRefused

    def say(line: str) -> None:
        click.echo(f"omni-dp {command}: {line}", err=True)

    if not request.steps:
        emit({"id": None, "summary": request.summary, "ok": True, "steps": []},
             f"omni-dp {command}: {request.summary}", as_json)
        return
    try:
        outcome = ask_and_follow(state.directory, request, state.record.supervisor.identity,
                                 say)
    except ChangeRefused as exc:
        fail(command, str(exc))
    undrained = outcome.stopped_in_router
    text = (f"omni-dp {command}: done in {outcome.seconds:.1f} s: {request.summary}"
            + (f"; replica {', '.join(map(str, undrained))} stopped without a drain (the router "
               "did not take it out, said above)" if undrained else "")
            if outcome.ok else f"omni-dp {command}: FAILED: {outcome.error}")
    emit(outcome.to_json(), text, as_json)
    sys.exit(ExitCode.OK if outcome.ok else ExitCode.RUNTIME)


def _wait_healthy_option(taken_out: str):
    """--wait-healthy, the same on both commands."""
    return click.option(
        "--wait-healthy", type=click.FloatRange(min=0), default=None, callback=finite,
        metavar="SECONDS",
        help=f"Before {taken_out} leaves the router, every other replica must be healthy "
             "(in the supervisor's record, its process alive, routable in the router): a step "
             "waits for that at most this long, then fails, saying which replica it waited "
             "for; 0: do not wait (taken out whatever the others' health, said). A failed "
             "replica (out of its restart budget) fails the step at once. "
             "[default: the run's --start-timeout plus 60 s]")


@click.command(cls=_EngineArgsCommand)
@click.argument("run_id", required=False)
@click.option("--replica", "replicas", type=click.IntRange(min=0), multiple=True,
              metavar="I", help="Restart only this replica (repeat for several). [default: "
                                "every replica, one at a time]")
@click.option("--allow-downtime", is_flag=True,
              help="Restart even where no other replica serves meanwhile (one replica, or a "
                   "weight-share group that is the whole run).")
@click.option("--drain-timeout", type=click.FloatRange(min=0), default=None, callback=finite,
              metavar="SECONDS", help="Seconds a replica's requests in flight get to finish "
                                      "once it is out of the router. [default: the run's]")
@_wait_healthy_option("a replica")
@json_option("the outcome")
@click.pass_context
def restart(ctx: click.Context, run_id: str | None, replicas: tuple[int, ...],
            allow_downtime: bool, drain_timeout: float | None, wait_healthy: float | None,
            as_json: bool) -> None:
    """Restart a live run's replicas one at a time, without downtime; `-- ENGINE ARGS` updates
    the model.

    Each replica in turn: out of the router, drained, stopped, started with the run's plan
    (or, with new engine arguments after `--`, with those: a model update, planned and
    checked as `launch` would), through every gate (health, KV, MPS attachment), back in. The
    run's supervisor makes the change; this command follows it. A weight-share leader
    restarts with its followers. Refused when no other replica would serve meanwhile, unless
    --allow-downtime. A replica leaves the router only while every other one is healthy: the
    step waits for one that is down or restarting (said), at most --wait-healthy.

    Exit codes: 0 every replica passed its gates, 1 no such run, 2 refused (nothing changed),
    3 a step failed (said; what passed stays).
    """
    from omni_dp.launcher.changes.plan import ChangePlanError, plan_restart

    state = _live(run_id, "restart")
    try:
        request = plan_restart(state.record, replicas=list(replicas) or None,
                               engine_args=ctx.meta.get("engine_args"),
                               allow_downtime=allow_downtime, drain_timeout=drain_timeout,
                               wait_healthy=wait_healthy)
    except ChangePlanError as exc:
        exit_with_problems("restart", exc.problems)
    _ask("restart", state, request, as_json)


@click.command()
@click.argument("run_id", required=False)
@click.option("--replicas", "-n", type=int, default=None, metavar="N",
              help="The run's replica count after the change.")
@click.option("--replicas-per-gpu", type=int, default=None, metavar="N",
              help="Over several GPUs (--gpus): replicas on each GPU after the change.")
@click.option("--drain-timeout", type=click.FloatRange(min=0), default=None, callback=finite,
              metavar="SECONDS", help="Seconds a removed replica's requests in flight get to "
                                      "finish. [default: the run's]")
@_wait_healthy_option("a removed or restarted replica")
@json_option("the outcome")
def scale(run_id: str | None, replicas: int | None, replicas_per_gpu: int | None,
          drain_timeout: float | None, wait_healthy: float | None, as_json: bool) -> None:
    """Add replicas to a live run, or remove the highest-numbered ones, without downtime.

    New replicas pass the same plan checks as `launch` (CPU blocks, memory fit, KV pin, the
    MPS client limit: every problem at once, nothing changed) and the same gates before they
    take traffic. Removed ones leave the router (once every other replica is healthy, waited
    for at most --wait-healthy), drain, and stop. Where the new count gives
    the others other CPU blocks (--cpu-blocks auto), they restart into them one at a time.
    run.json, `status`, the gateway and Prometheus discovery follow.

    Exit codes: 0 done (or nothing to change), 1 no such run, 2 refused (nothing changed), 3 a
    step failed.
    """
    from omni_dp.launcher.changes.plan import ChangePlanError, plan_scale

    if (replicas is None) == (replicas_per_gpu is None):
        fail("scale", "give the new count: --replicas N (or, over several GPUs, "
             "--replicas-per-gpu N)")
    state = _live(run_id, "scale")
    try:
        request = plan_scale(state.record, replicas if replicas is not None else
                             replicas_per_gpu, per_gpu=replicas_per_gpu is not None,
                             drain_timeout=drain_timeout, wait_healthy=wait_healthy)
    except ChangePlanError as exc:
        exit_with_problems("scale", exc.problems)
    _ask("scale", state, request, as_json)
