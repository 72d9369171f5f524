"""`omni-dp verify-mps` (a run's attachment proof; with --overlap, whether its replicas'
kernels ran at once: omni_dp/mps/overlap_run.py) and `omni-dp mps start|stop|status` (a
private daemon on its own: omni_dp/mps/standalone.py)."""

from __future__ import annotations

import json
import os
import sys
from typing import NoReturn

import click

from omni_dp.cli.common import SIZE, emit, fail, finite, json_option
from omni_dp.contract import API_KEY_ENV, ExitCode
from omni_dp.mps.binaries import CONTROL_HELP
from omni_dp.mps.overlap import DEFAULT_MIN_SHARE

OVERLAP_DURATION_S = 5.0
OVERLAP_CONCURRENCY = 16


@click.command("verify-mps")
@click.argument("run_id", required=False)
@click.option("--gpu", default=None, metavar="INDEX|UUID",
              help="Check only this GPU of the run (its NVML index or its UUID). "
                   "[default: every GPU of the run]")
@json_option("the report")
@click.option("--no-nvml", is_flag=True, help="Skip the NVML cross-check of GPU processes.")
@click.option("--overlap", is_flag=True,
              help="Instead of the attachment: put a short concurrent speech load on the run "
                   "(built-in engine, on a GPU, with or without --mps) and check that its "
                   "replicas' GPU steps ran at once, GPU by GPU.")
@click.option("--duration", type=click.FloatRange(0.5, 600), default=None, callback=finite,
              help=f"With --overlap: seconds of load. [default: {OVERLAP_DURATION_S:g}]")
@click.option("--concurrency", type=click.IntRange(1, 1024), default=None,
              help="With --overlap: concurrent streamed requests through the router. "
                   f"[default: {OVERLAP_CONCURRENCY}]")
@click.option("--min-share", type=click.FloatRange(0, 1), default=None, callback=finite,
              help="With --overlap: the share of busy time with two or more replicas busy at "
                   f"once that passes. [default: {DEFAULT_MIN_SHARE:g}]")
def verify_mps(run_id: str | None, gpu: str | None, as_json: bool, no_nvml: bool,
               overlap: bool, duration: float | None, concurrency: int | None,
               min_share: float | None) -> None:
    """Re-prove that every GPU process of every replica of a live run is an MPS client.

    Reads the run's state (OMNI_DP_STATE_DIR, default $XDG_RUNTIME_DIR or /tmp /omni-dp-UID).
    A run has one private MPS daemon per GPU: each GPU's replicas are checked against that
    GPU's daemon, and each GPU's proof is rewritten in the run directory (mps_attach.txt/.json
    for a one-GPU run, mps_attach.gpuINDEX.txt/.json per GPU). Prints the map, GPU by GPU.
    With no RUN_ID it takes the only live run with an MPS daemon.

    Exit codes: 0 PASS on every GPU checked, 1 FAIL on some GPU, or no such run (none live),
    2 cannot check (a GPU whose daemon is not running, a GPU not in the run, several runs and
    none named: the message says which).

    --overlap: attachment does not prove concurrency. Drives CONCURRENCY streamed speech
    requests through the run's router for DURATION seconds, reads each replica's GPU busy
    intervals (GET /gpu_busy) and reports, per GPU, the share of busy time during which two or
    more replicas were busy at once: PASS at MIN_SHARE or more, FAIL below (they take turns,
    as without MPS), cannot check (exit 2) on the CPU, another engine, one replica per GPU or
    too little load. With no RUN_ID it takes the only live run. A router with --api-key needs
    the key in OMNI_DP_API_KEY.
    """
    extra = [name for name, value in (("--duration", duration), ("--concurrency", concurrency),
                                      ("--min-share", min_share)) if value is not None]
    if overlap:
        _verify_overlap(run_id, gpu, as_json, duration, concurrency, min_share)
    if extra:
        fail("verify-mps", f"{', '.join(extra)}: only with --overlap")
    from omni_dp.mps.runs import (
        CANNOT_CHECK,
        FAIL,
        CannotCheck,
        format_verdict,
        pick_mps_run,
        verify_run,
    )
    from omni_dp.runfile import RunNotFound

    try:
        run = pick_mps_run(run_id)
        verdict = verify_run(run, gpu=gpu, use_nvml=not no_nvml)
    except CannotCheck as exc:
        _cannot_check(str(exc), as_json)
    except RunNotFound as exc:
        _no_run(str(exc), as_json)
    checked = len(verdict.unchecked) < len(verdict.gpus)
    if as_json or checked:
        emit(verdict.to_json(), format_verdict(verdict), as_json)
    if not as_json:
        for unchecked in verdict.unchecked:
            click.echo(f"omni-dp verify-mps: cannot check: {unchecked.reason}", err=True)
    code = {FAIL: ExitCode.CHECK_FAILED, CANNOT_CHECK: ExitCode.USAGE}.get(verdict.result,
                                                                          ExitCode.OK)
    sys.exit(code)


def _verify_overlap(run_id: str | None, gpu: str | None, as_json: bool,
                    duration: float | None, concurrency: int | None,
                    min_share: float | None) -> NoReturn:
    from omni_dp.mps.overlap_run import (
        FAIL,
        PASS,
        CannotCheck,
        check_overlap,
        format_overlap,
        pick_live_run,
    )
    from omni_dp.runfile import RunNotFound

    try:
        result = check_overlap(
            pick_live_run(run_id), gpu=gpu, min_share=min_share,
            duration=OVERLAP_DURATION_S if duration is None else duration,
            concurrency=concurrency or OVERLAP_CONCURRENCY,
            api_key=os.environ.get(API_KEY_ENV))
    except CannotCheck as exc:
        _cannot_check(str(exc), as_json)
    except RunNotFound as exc:
        _no_run(str(exc), as_json)
    emit(result.to_json(), format_overlap(result), as_json)
    sys.exit({PASS: ExitCode.OK, FAIL: ExitCode.CHECK_FAILED}.get(result.result,
                                                                  ExitCode.USAGE))


def _no_run(reason: str, as_json: bool) -> NoReturn:
    """Nothing to check: no such run, or none live. Exit 1, as `status` and `logs` do."""
    _no_verdict("NO_RUN", reason, "", ExitCode.CHECK_FAILED, as_json)


def _cannot_check(reason: str, as_json: bool) -> NoReturn:
    """No verdict on the run at all (not an --mps run, no GPU of that name, …): exit 2."""
    _no_verdict("CANNOT_CHECK", reason, "cannot check: ", ExitCode.USAGE, as_json)


def _no_verdict(result: str, reason: str, words: str, code: int, as_json: bool) -> NoReturn:
    if as_json:
        click.echo(json.dumps({"result": result, "reason": reason}, indent=2))
    else:
        click.echo(f"omni-dp verify-mps: {words}{reason}", err=True)
    sys.exit(code)


@click.group()
def mps() -> None:
    """Manage a private MPS control daemon on its own (the launcher does this for a run)."""


_STATE_DIR = click.option(
    "--state-dir", required=True, type=click.Path(file_okay=False),
    help="Directory that holds mps/pipe, mps/log and mps/daemon.json (keep its path short: "
         "the control socket path must fit in 107 bytes).")
_MPS_CONTROL = click.option(
    "--mps-control", default=None, metavar="PATH",
    help=CONTROL_HELP)


@mps.command("start")
@_STATE_DIR
@_MPS_CONTROL
@click.option("--gpu", default="0", show_default=True, metavar="INDEX|UUID",
              help="The GPU the daemon serves (its UUID goes into CUDA_VISIBLE_DEVICES).")
@click.option("--mps-thread-percentage", type=click.FloatRange(0, 100, min_open=True),
              default=None, callback=finite,
              help="Default active thread percentage for the MPS server.")
@click.option("--mps-memory-limit", type=SIZE, default=None,
              help="Default pinned device memory limit per client, e.g. 20GiB.")
@click.option("--no-gpu-check", is_flag=True,
              help="Start even where NVML sees no usable GPU (to test the daemon itself; no "
                   "client can attach there).")
@json_option("the daemon record")
def mps_start(state_dir, mps_control, gpu, mps_thread_percentage, mps_memory_limit,
              no_gpu_check, as_json) -> None:
    """Start a private MPS control daemon under --state-dir and record it."""
    from omni_dp.mps.standalone import StandaloneError, start_daemon

    try:
        record = start_daemon(
            state_dir, control_binary=mps_control, gpu=gpu,
            thread_percentage=mps_thread_percentage, memory_limit_bytes=mps_memory_limit,
            gpu_check=not no_gpu_check, say=lambda line: click.echo(line, err=as_json))
    except StandaloneError as exc:
        fail("mps start", str(exc), exc.code)
    emit(record.to_json(), f"MPS control daemon pid {record.identity.pid} serving "
         f"CUDA_MPS_PIPE_DIRECTORY={record.pipe_dir}", as_json)


@mps.command("stop")
@_STATE_DIR
@click.option("--force", is_flag=True, help="Quit even while MPS clients are attached.")
def mps_stop(state_dir, force) -> None:
    """Stop the daemon recorded under --state-dir: quit, then wait for its pid to exit."""
    from omni_dp.mps.standalone import StandaloneError, stop_daemon

    try:
        record, was_running = stop_daemon(state_dir, force=force)
    except StandaloneError as exc:
        fail("mps stop", str(exc), exc.code)
    click.echo(f"MPS control daemon pid {record.identity.pid} "
               + ("stopped" if was_running else "was not running; its record is removed"))


@mps.command("status")
@_STATE_DIR
@json_option("the health")
def mps_status(state_dir, as_json) -> None:
    """Is the recorded daemon alive, answering, which servers, any MPS faults in its logs.

    Exit codes: 0 healthy, 1 not (dead, unreachable or faults logged), 2 nothing recorded.
    """
    from omni_dp.mps.standalone import StandaloneError, daemon_health, format_health

    try:
        record, health = daemon_health(state_dir)
    except StandaloneError as exc:
        fail("mps status", str(exc), exc.code)
    emit({"daemon": record.to_json(), **health.to_json()}, format_health(record, health),
         as_json)
    sys.exit(ExitCode.OK if health.ok else ExitCode.CHECK_FAILED)
