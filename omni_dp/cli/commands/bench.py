"""`omni-dp bench`: a concurrency sweep per configuration (an endpoint, or runs it launches and
downs itself), ranges over trials, every failure counted; a table, JSON and a figure. The
measuring is omni_dp/bench's; this module turns flags into its settings and shows the result."""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

import click

from omni_dp.cli.common import fail, finite, format_options
from omni_dp.contract import API_KEY_ENV, ExitCode

WORKLOADS = ("auto", "speech", "speech-stream", "completions")
LLM_ENGINES = ("vllm", "sglang")


def _levels(ctx: click.Context, param: click.Parameter, value: str | None
            ) -> tuple[int, ...] | None:
    if value is None or value == "auto":
        return None
    try:
        levels = tuple(int(v) for v in value.split(","))
    except ValueError:
        raise click.BadParameter("give concurrency levels like 1,2,4,8, or auto") from None
    if any(level < 1 for level in levels) or list(levels) != sorted(set(levels)):
        raise click.BadParameter("levels must be ≥ 1, rising, each once (e.g. 1,4,16)")
    return levels


# Unknown options are refused: a launch option before `--` is a mistake to say, not to pass on.
@click.command(context_settings={"ignore_unknown_options": False})
@click.option("--configs", default=None, metavar="1,2mps,3mps",
              help="Launch each configuration (N replicas, `mps`: under MPS), measure it, "
                   "`down` it, check nothing is left, then the next. Launch options after "
                   "`--` (engine arguments after a second `--`).")
@click.option("--trials", type=click.IntRange(min=1), default=3, show_default=True,
              help="Measured windows per concurrency level; the report gives their range.")
@click.option("--duration", type=float, default=20.0, show_default=True, callback=finite,
              help="Seconds of each measured window.")
@click.option("--warmup", type=float, default=5.0, show_default=True, callback=finite,
              help="Seconds of load before each window that are not counted.")
@click.option("--concurrency", default="auto", show_default=True, callback=_levels,
              metavar="auto|1,2,4,…",
              help="The levels to sweep; auto doubles from 1 until throughput stops rising.")
@click.option("--max-concurrency", type=click.IntRange(min=1), default=256, show_default=True,
              help="The highest level auto goes to.")
@click.option("--max-p99", type=float, default=None, callback=finite, metavar="SECONDS",
              help="Stop a sweep at the level whose p99 latency passes this bound.")
@click.option("--min-gain", type=float, default=0.05, show_default=True, callback=finite,
              help="Saturated once a level raises throughput by less than this fraction.")
@click.option("--timeout", type=float, default=60.0, show_default=True, callback=finite,
              help="Seconds one request may take before it counts as timed out.")
@click.option("--workload", type=click.Choice(WORKLOADS), default="auto", show_default=True,
              help="What each request is: speech (WAV), speech-stream (streamed PCM), "
                   "completions (/v1/completions, streamed); auto: completions for vLLM and "
                   "sglang configurations, else speech-stream.")
@click.option("--texts", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="The prompts, one per line (default: a built-in set of 16).")
@click.option("--model", default=None,
              help="Completions: the served model name (default: each endpoint's first "
                   "/v1/models entry).")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Request i is the same in every configuration and run with one seed.")
@click.option("--run-dir", type=click.Path(file_okay=False), default=None,
              help="With URL: the run's directory (omni-dp status shows it), so that the "
                   "replicas' CPU and GPU use is sampled.")
@click.option("--out", type=click.Path(file_okay=False), default=None, metavar="DIR",
              help="Write bench.json and bench.png there.")
@format_options("the result")
@click.argument("args", nargs=-1, type=click.UNPROCESSED,
                metavar="[URL] [-- LAUNCH OPTIONS [-- ENGINE ARGS]]")
def bench(configs, trials, duration, warmup, concurrency, max_concurrency, max_p99, min_gain,
          timeout, workload, texts, model, seed, run_dir, out, fmt, args) -> None:
    """Find the right N: a sweep per configuration, ranges over trials, failures kept.

    Either against a running endpoint (`omni-dp bench http://127.0.0.1:8000`) or by
    launching configurations itself (`omni-dp bench --configs 1,2mps,3mps -- --gpu 0
    --max-total-tokens 4096 -- --model small`). Each configuration gets a concurrency sweep
    up to its saturation (throughput stops rising, or p99 passes --max-p99, or requests fail),
    --trials windows per level; the report gives each number's range over the trials, every
    failed, timed-out or refused request, configurations that failed, and each DP
    configuration's throughput at its own saturation against the single replica's.

    Exit codes: 0 every configuration ran, 1 some failed or were degraded (see the report),
    2 bad options (nothing started), 130 interrupted (what was started is down).
    """
    from omni_dp.bench.runner import BenchRunner, BenchSettings, check_launch_args, parse_spec

    url, launch_args = _split(configs, args)
    specs = [s.strip() for s in configs.split(",")] if configs else []
    try:
        for spec in specs:
            parse_spec(spec)
        check_launch_args(launch_args)
        chosen = _workload(workload, texts, model, seed, launch_args)
        settings = BenchSettings(
            trials=trials, duration_s=duration, warmup_s=warmup, timeout_s=timeout,
            concurrency=concurrency, max_p99_s=max_p99, min_gain=min_gain, seed=seed,
            workload=chosen, api_key=os.environ.get(API_KEY_ENV), max_concurrency=max_concurrency)
    except ValueError as exc:
        fail("bench", str(exc))
    if out is not None:
        _writable(out)
    partial = None if out is None else (lambda done: _write_json(
        _report((done, None), settings), Path(out), complete=False))
    results = _run(BenchRunner, settings, url, run_dir, specs, launch_args, partial)
    report = _report(results, settings)
    _show(report, out, fmt, complete=results[1] is None)
    sys.exit(_exit_code(report, results[1]))


def _split(configs: str | None, args: tuple[str, ...]) -> tuple[str | None, list[str]]:
    """URL mode: one argument, the endpoint; --configs mode: the arguments are launch's."""
    if configs:
        if args and args[0].startswith(("http://", "https://")):
            fail("bench", f"give an endpoint URL ({args[0]}) or --configs, not both")
        return None, list(args)
    if len(args) != 1 or not args[0].startswith(("http://", "https://")):
        fail("bench", "give the endpoint to measure (omni-dp bench http://HOST:PORT) or the "
             "configurations to launch (--configs 1,2mps -- LAUNCH OPTIONS)")
    return args[0].rstrip("/"), []


def _workload(kind: str, texts: str | None, model: str | None, seed: int,
              launch_args: list[str]):
    from omni_dp.bench.workload import BUILTIN_TEXTS, Workload, load_texts

    engine = _flag(launch_args, "--engine")
    if kind == "auto":
        kind = "completions" if engine in LLM_ENGINES else "speech-stream"
    # model None: the runner asks each endpoint's /v1/models (with the key) what it serves
    return Workload(kind=kind, texts=load_texts(Path(texts)) if texts else BUILTIN_TEXTS, seed=seed,
                    model=model)


def _flag(args: list[str], flag: str) -> str | None:
    """A flag's value among launch's options (before the engine's `--`)."""
    own = args[:args.index("--")] if "--" in args else args
    for i, arg in enumerate(own):
        if arg == flag and i + 1 < len(own):
            return own[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _writable(out: str) -> None:
    path = Path(out)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        fail("bench", f"--out {out}: cannot make the directory ({exc.strerror or exc})")
    if not os.access(path, os.W_OK):
        fail("bench", f"--out {out}: not writable")


def _run(runner_class, settings, url, run_dir, specs, launch_args, finished):
    """Run with a progress display on stderr (stdout stays the result's); `finished` gets the
    results so far as each configuration ends."""
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task("starting", total=None)

        def said(line: str) -> None:
            progress.update(task, description=line[:120])
            progress.console.print(f"omni-dp bench: {line}", highlight=False, markup=False)

        runner = runner_class(settings, progress=said)
        if url is not None:
            results = [runner.run_url(url, Path(run_dir) if run_dir else None)]
        else:
            results = runner.run_configs(specs, launch_args, finished=finished)
    return results, runner.interrupted


def _report(results, settings):
    from omni_dp.bench.results import BenchResult
    from omni_dp.bench.scaling import premise_text, scaling

    configs = tuple(results[0])
    return BenchResult(workload=settings.workload.describe(), configs=configs,
                       scaling=scaling(configs), premise=premise_text(configs),
                       machine=_machine(), settings=settings.to_json())


def _machine() -> dict:
    """What the numbers were measured on: host, CPUs, the first GPU NVML sees (or none)."""
    from omni_dp.gpus import query_gpus

    inventory = query_gpus()
    gpu = inventory.gpus[0] if inventory.gpus else None
    return {"host": platform.node(), "cpus": len(os.sched_getaffinity(0)),
            "gpu": {"name": gpu.name, "memory_bytes": gpu.memory_total_bytes,
                    "count": len(inventory.gpus)} if gpu else None}


def _show(report, out: str | None, fmt: str, complete: bool) -> None:
    from omni_dp.bench.report import print_report, render_png, to_json

    data = {**to_json(report), "complete": complete}
    if out is not None:
        _write_json(report, Path(out), complete=complete)
        render_png(report, Path(out) / "bench.png")
    if fmt == "json":  # the tables for the person watching, on stderr
        print_report(report, "table", sys.stderr)
        click.echo(json.dumps(data, indent=2))
    else:
        print_report(report, fmt)
    if out is not None:
        click.echo(f"omni-dp bench: wrote {Path(out) / 'bench.json'} and "
                   f"{Path(out) / 'bench.png'}", err=True)


def _write_json(report, directory: Path, complete: bool) -> None:
    """bench.json, whole; written as each configuration ends, so a sweep killed later keeps
    what it finished (`complete` false until the last one, or after an interruption)."""
    from omni_dp.bench.report import to_json
    from omni_dp.files import atomic_write

    data = {**to_json(report), "complete": complete}
    atomic_write(directory / "bench.json", json.dumps(data, indent=2) + "\n", mode=0o644)


def _exit_code(report, interrupted: str | None) -> int:
    if interrupted:
        return 130
    return ExitCode.OK if all(c.status == "ok" for c in report.configs) else 1
