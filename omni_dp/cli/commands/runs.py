"""A run after `launch`: `omni-dp status`, `list`, `logs`, `down` and `supervise`."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from omni_dp.cli.common import (
    emit,
    fail,
    finite,
    format_options,
    json_option,
    nothing_there,
)
from omni_dp.contract import ExitCode


def _pick_run(run_id: str | None, command: str):
    from omni_dp.launcher.views.status import pick
    from omni_dp.runfile import RunFileError, RunNotFound

    try:
        return pick(run_id, command)
    except RunNotFound as exc:
        nothing_there(command, str(exc))
    except RunFileError as exc:  # several runs and none named, an unreadable one
        fail(command, str(exc))


@click.command()
@click.argument("run_id", required=False)
@format_options("the status", table="fixed-width columns, never wrapped")
@click.option("--prometheus-sd", "sd_file", default=None, metavar="FILE",
              help="Instead of the status, write a Prometheus file_sd target list (the router "
                   "and every replica, labelled by run, role, replica and GPU) to FILE, "
                   "atomically; '-' prints it. With no RUN_ID: every live run on this host.")
def status(run_id: str | None, fmt: str, sd_file: str | None) -> None:
    """A run's replicas (pid, CPU block, port, health, KV, MPS, restarts), router, daemon.

    With no RUN_ID: the only live run. A run over several GPUs is shown GPU by GPU, each with
    its MPS daemon. Exit codes: 0 every replica healthy, 1 not (or the run is abandoned:
    nothing owns it, or there is no such run), 2 several runs and none named. With
    --prometheus-sd: 0 once the file is written, 2 when it cannot be (the message says why).
    """
    from omni_dp.launcher.planning.facts import invoked_as
    from omni_dp.launcher.views.status import collect, format_status

    if sd_file is not None:
        _write_prometheus_sd(run_id, sd_file, fmt == "json")
        return
    report = collect(_pick_run(run_id, "status"))
    emit(report, format_status(report, invoked_as(), fmt), fmt == "json")
    healthy = report["replicas"] and all(r["health"] == "healthy" for r in report["replicas"])
    sys.exit(ExitCode.OK if healthy and report["state"] != "abandoned" else ExitCode.CHECK_FAILED)


def _write_prometheus_sd(run_id: str | None, sd_file: str, as_json: bool) -> None:
    """`status --prometheus-sd`: the target list of the run(s), to FILE or stdout ('-')."""
    from omni_dp.launcher.views.scrape_targets import TargetError, render, run_groups, write_file_sd
    from omni_dp.launcher.views.status import scrape_runs
    from omni_dp.runfile import RunFileError, RunNotFound

    try:
        records = scrape_runs(run_id)
        groups = [group for record in records for group in run_groups(record)]
    except RunNotFound as exc:
        nothing_there("status", str(exc))
    except (RunFileError, TargetError) as exc:
        fail("status", str(exc))
    if sd_file == "-":
        click.echo(render(groups), nl=False)
        return
    path = Path(sd_file)
    try:
        write_file_sd(path, groups)
    except OSError as exc:
        fail("status", f"cannot write the Prometheus target list to {path}: {_why(exc, path)}")
    runs = [r.run_id for r in records]
    targets = sum(len(g["targets"]) for g in groups)
    emit({"file": str(path), "runs": runs, "targets": targets},
         f"wrote {targets} target(s) of {len(runs)} run(s) ({', '.join(runs) or 'no live run'})"
         f" to {path}", as_json)


def _why(exc: OSError, path: Path) -> str:
    """What to fix, for the errors a person can fix."""
    if isinstance(exc, FileNotFoundError):
        return f"its directory {path.parent} does not exist"
    if isinstance(exc, PermissionError):
        return f"{path.parent} is not writable by you"
    return exc.strerror or str(exc)


@click.command("list")
@json_option("the runs")
def list_runs(as_json: bool) -> None:
    """Every run under the state directory, live or kept after a failure."""
    from omni_dp.launcher.views.listing import format_runs, list_runs

    rows = list_runs()
    emit({"runs": rows}, format_runs(rows), as_json)


@click.command()
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
    Exit codes: 0 printed, 1 no such run (or none at all), 2 several runs and none named, or
    no such log.
    """
    from omni_dp.launcher.views.logview import LogError, select_logs, show_logs

    state = _pick_run(run_id, "logs")
    try:
        paths = select_logs(state.logs, replica=replica, router=router_log,
                            supervisor=supervisor_log)
        show_logs(paths, lines=lines, follow=follow, write=click.echo,
                  running=state.directory.exists)
    except LogError as exc:
        fail("logs", str(exc))


@click.command()
@click.argument("run_id", required=False)
@click.option("--drain-timeout", type=click.FloatRange(min=0), default=None, callback=finite,
              help="Seconds in-flight requests get, also when the run's supervisor does the "
                   "teardown. [default: the run's]")
@json_option("the result")
def down(run_id: str | None, drain_timeout: float | None, as_json: bool) -> None:
    """Stop a run and everything it started, and nothing else; remove its state.

    Order: supervisor, router (drains), replicas (drain, then SIGKILL of proven processes
    only), MPS daemon (after its clients are gone). A run already down just has its state
    removed; one whose state is gone is nothing to stop. Exit codes: 0 nothing left, 2 which
    run is ambiguous, 3 something could not be stopped (its state is kept and the leftovers
    named).
    """
    from omni_dp.launcher.teardown import teardown
    from omni_dp.launcher.views.listing import no_state_left
    from omni_dp.rundir import state_dir

    if no_state_left(run_id):  # already down: nothing to stop is success
        what = f"run {run_id}" if run_id else "any run"
        emit({"run_id": run_id, "clean": True, "removed": False, "leftovers": []},
             f"no state of {what} under {state_dir() / 'runs'}: nothing to stop", as_json)
        return
    state = _pick_run(run_id, "down")
    drain = drain_timeout if drain_timeout is not None else state.supervision.drain_timeout
    say = (lambda line: None) if as_json else (lambda line: click.echo(f"omni-dp: {line}"))
    result = teardown(state, drain_timeout=drain, say=say)
    text = (f"run {state.run_id} is down; nothing left behind" if result.clean else
            f"run {state.run_id}: could not confirm everything stopped; state kept in "
            f"{state.directory}\n" + "\n".join(f"  {line}" for line in result.leftovers))
    emit({"run_id": state.run_id, "clean": result.clean, "removed": result.removed,
          "leftovers": result.leftovers}, text, as_json)
    sys.exit(ExitCode.OK if result.clean else ExitCode.RUNTIME)


@click.command()
@click.argument("run_id", required=False)
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=1), default=None,
              callback=finite, metavar="SECONDS",
              help="How long the new supervisor gets to start and run its first sweep. "
                   "[default: 30]")
@json_option("the outcome")
def supervise(run_id: str | None, timeout_s: float | None, as_json: bool) -> None:
    """Supervise again a live run whose supervisor died (kill -9, OOM): serving went on, but
    nothing restarted a failing replica.

    Starts the detached supervisor `launch --detach` leaves behind, with the run's id and
    token, and returns once run.json names it supervising. It adopts the router and replicas
    as they run, and restarts what the dead one left half-restarted. The replicas it restarts
    inherit this shell's environment (as they did the launch's); a router launched with an
    API key needs it here too, in OMNI_DP_API_KEY. With no RUN_ID: the only live run. Safe to
    repeat: a run whose supervisor is alive is left as it is.

    Exit codes: 0 supervised (again, or already: then nothing is started), 1 no such run,
    2 nothing started: the run is not live (stopped, failed, never finished starting), its
    `launch` still runs, its API key is missing or refused, or several runs and none named,
    3 the supervisor started died or did not supervise in time: it is stopped, its log's tail
    said, and the run goes on serving, unsupervised (never torn down), 130 interrupted while
    waiting (likewise).
    """
    from omni_dp.launcher.supervision.detached import SUPERVISOR_HANDOFF_S
    from omni_dp.launcher.supervision.resume import NotSupervisable, ResumeFailed, resume

    state = _pick_run(run_id, "supervise")
    try:
        resumed = resume(state, say=lambda line: click.echo(f"omni-dp supervise: {line}",
                                                            err=True),
                         timeout_s=timeout_s if timeout_s is not None else SUPERVISOR_HANDOFF_S)
    except NotSupervisable as exc:
        fail("supervise", str(exc))
    except ResumeFailed as exc:
        if as_json:
            emit(exc.resumed.to_json(), "", True)
        click.echo(f"omni-dp supervise: {exc}", err=True)
        sys.exit(130 if exc.interrupted else ExitCode.RUNTIME)  # 130: as launch's, 128 + SIGINT
    emit(resumed.to_json(), resumed.line(), as_json)
