"""The one device call: every step bounded, in the order of what its evidence is worth, and all
it finds in at most eight files under $OUT, however it ends.

$OUT holds exactly these (the device tool brings back at most 8 files):
  summary.md        the headline figures first, then one row per step; rewritten after each step
  results.json      every figure, machine-readable; rewritten after each step
  console.log       every step's output as it came (capped at 8 MiB)
  artifacts.tar.gz  each step's output, every run's files (run.json, events, mps_attach.*, MPS
                    and replica logs, the run token never) and bench.json; repacked after each
                    step, so a call killed by its own timeout still brings back the last one
  headline.png      the DP figure of `omni-dp bench`, once it exists
(and for an instant, while one of the first four is rewritten, its `.part`).

No step may stop the others: a failed, timed-out or skipped step is a row, and the next runs.
Each step is a process group of its own with a limit (never past the budget less the teardown
reserve); SIGTERM/SIGINT stop the step in progress and go straight to the teardown. The
teardown quits the smoke test's daemon, downs every run left in the state directory and names
any process of this call still running. Configured by environment (bench/gpu_run.sh says
which); the steps themselves are bench/gpu_steps.py.

Exit 0 every step ok, 1 a step failed, timed out or had no budget left, 3 a process of this call
is still running (named in summary.md; the work directory is kept).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from artifacts import copy_artifacts
from gpu_steps import Settings, Step, headline_lines, steps

OUT_FILES = ("summary.md", "results.json", "console.log", "artifacts.tar.gz", "headline.png")
CONSOLE_MAX_BYTES = 8 * 1024**2
ARTIFACT_FILE_MAX_BYTES = 512 * 1024  # the tail of a long log is what matters
ARTIFACTS_MAX_BYTES = 15 * 1024**2  # the device tool brings back at most 16 MiB a file
COLLECT_EVERY_S = 2.0
GRACE_S = 15  # after SIGTERM, before SIGKILL: the step downs the run it had started


@dataclass
class StepResult:
    name: str
    verdict: str = "not run"  # ok | exit N | timed out after N s | skipped: why
    rc: int | None = None
    seconds: float = 0.0
    figures: dict = field(default_factory=dict)
    counts_as_failure: bool = False

    @property
    def ok(self) -> bool:
        return self.verdict == "ok"


class Outputs:
    """The files under $OUT, each written whole (a `.part`, then renamed)."""

    def __init__(self, out: Path, work: Path) -> None:
        self.out, self.work = out, work
        self.console = (out / "console.log").open("ab")
        self.console_bytes = 0

    def say(self, line: str) -> None:
        print(line, flush=True)
        data = (line + "\n").encode(errors="replace")
        if self.console_bytes + len(data) <= CONSOLE_MAX_BYTES:
            self.console.write(data)
            self.console.flush()
        self.console_bytes += len(data)

    def write(self, name: str, data: bytes) -> None:
        part = self.out / f".{name}.part"
        part.write_bytes(data)
        os.replace(part, self.out / name)

    def pack(self) -> None:
        """Every file under the work directory's steps/, artifacts/ and headline/, newest
        state; files dropped whole past the size limit, said in the archive's index."""
        buffer = io.BytesIO()
        skipped = []
        with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
            for folder in ("steps", "artifacts", "headline", "smoke/log"):
                root = self.work / folder
                for path in sorted(root.rglob("*")) if root.is_dir() else []:
                    if not path.is_file() or path.is_symlink():
                        continue
                    if buffer.tell() > ARTIFACTS_MAX_BYTES:
                        skipped.append(str(path.relative_to(self.work)))
                        continue
                    tar.add(path, arcname=str(path.relative_to(self.work)))
            index = ("files left out (the archive reached its size limit):\n"
                     + "\n".join(skipped) + "\n" if skipped else "complete\n").encode()
            info = tarfile.TarInfo("INDEX.txt")
            info.size = len(index)
            tar.addfile(info, io.BytesIO(index))
        self.write("artifacts.tar.gz", buffer.getvalue())


class Collector:
    """Copies every run directory under the state directory into artifacts/ every few seconds
    while a step runs: `down` removes a run's directory, and its logs are the evidence."""

    def __init__(self, state: Path, artifacts: Path) -> None:
        self.state, self.artifacts = state, artifacts
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None

    def sweep(self) -> None:
        runs = self.state / "runs"
        for run in sorted(runs.iterdir()) if runs.is_dir() else []:
            with contextlib.suppress(OSError):
                copy_artifacts(run, self.artifacts / run.name, ARTIFACT_FILE_MAX_BYTES)

    def __enter__(self) -> Collector:
        self.stop_event.clear()

        def loop() -> None:
            while not self.stop_event.wait(COLLECT_EVERY_S):
                self.sweep()

        self.thread = threading.Thread(target=loop, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_event.set()
        if self.thread:
            self.thread.join(10)
        self.sweep()


class Stopped(Exception):
    """SIGTERM or SIGINT: the step in progress was stopped; go to the teardown."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class DeviceCall:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.started = time.monotonic()
        self.started_utc = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
        self.results: list[StepResult] = []
        self.signal: int | None = None  # the signal that stopped the call
        self.current: subprocess.Popen | None = None
        self.work = settings.work
        self.out = Outputs(settings.out, self.work)
        self.exit_code: int | None = None
        self.stopped_by: str | None = None

    # --- time -------------------------------------------------------------------------------
    def left_s(self) -> float:
        return self.settings.budget_s - (time.monotonic() - self.started)

    # --- one step ---------------------------------------------------------------------------
    def run(self, step: Step, limit: float | None = None) -> StepResult:
        """Run `step` within its limit and the budget (or exactly `limit`, the teardown's)."""
        result = StepResult(step.name)
        self.results.append(result)
        skip = step.skip(self.results)
        room = self.left_s() - self.settings.teardown_reserve_s
        if skip is None and limit is None and room < step.min_s:
            skip = f"budget spent ({max(room, 0):.0f} s left, the step needs {step.min_s:.0f})"
            result.counts_as_failure = True
        if skip is not None:
            result.verdict = f"skipped: {skip}"
            self.out.say(f"### {step.name}: {result.verdict}")
            self.save()
            return result
        limit = min(step.limit_s, room) if limit is None else limit
        log = self.work / "steps" / f"{step.name.replace(' ', '_')}.txt"
        self.out.say(f"### {step.name}: {' '.join(step.argv)} (limit {limit:.0f} s)")
        t0 = time.monotonic()
        with Collector(self.settings.state, self.work / "artifacts"):
            rc, timed_out = self.execute(step, limit, log)
        result.seconds = round(time.monotonic() - t0, 1)
        result.rc = rc
        result.verdict = (f"timed out after {limit:.0f} s" if timed_out else
                          "ok" if rc == 0 else f"exit {rc}")
        result.counts_as_failure = rc != 0
        try:
            result.figures = step.read(log.read_text(errors="replace"), self.work)
        except Exception as exc:  # a reader must never cost the call its other results
            result.figures = {"read_error": f"{type(exc).__name__}: {exc}"}
        os.environ.update(step.exports(result.figures))
        self.out.say(f"### {step.name}: {result.verdict} ({result.seconds} s)")
        self.save()
        if self.signal:
            raise Stopped(self.signal)
        return result

    def execute(self, step: Step, limit: float, log: Path) -> tuple[int, bool]:
        """The step's process group, its output to `log` and the console as it comes."""
        log.parent.mkdir(parents=True, exist_ok=True)
        # a step's temporary files in the work directory, which the teardown removes: a step
        # killed at its limit cannot remove its own
        tmp = self.work / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "TMPDIR": str(tmp), **step.env}
        with log.open("w") as own:
            proc = subprocess.Popen(step.argv, cwd=step.cwd, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            self.current = proc
            reader = threading.Thread(target=self._copy, args=(proc, own), daemon=True)
            reader.start()
            timed_out = False
            try:
                proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                timed_out = True
                self.stop_group(proc, step.grace_s)
            finally:
                self.current = None
            reader.join(10)
        return proc.returncode, timed_out

    def _copy(self, proc: subprocess.Popen, own) -> None:
        for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            own.write(line + "\n")
            own.flush()
            self.out.say(line)

    @staticmethod
    def stop_group(proc: subprocess.Popen, grace_s: float) -> None:
        """SIGTERM to the step's group (its own teardown runs), SIGKILL after `grace_s`."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def on_signal(self, signum: int, frame) -> None:
        self.signal = signum
        proc = self.current
        if proc is not None:
            threading.Thread(target=self.stop_group, args=(proc, GRACE_S), daemon=True).start()

    # --- the whole call ---------------------------------------------------------------------
    def main(self) -> int:
        signal.signal(signal.SIGTERM, self.on_signal)
        signal.signal(signal.SIGINT, self.on_signal)
        self.save()
        stopped: Stopped | None = None
        try:
            for step in steps(self.settings):
                if step.name == "teardown":
                    break
                self.run(step)
        except Stopped as exc:
            stopped = exc
            self.stopped_by = str(exc)
            self.out.say(f"### stopped by {exc}: going to the teardown")
        finally:
            self.teardown(stopped)
        return self.exit_code

    def teardown(self, stopped: Stopped | None) -> None:
        """The last step, whatever happened; exit 128+signal after a signal, 3 when anything
        is left running."""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        self.signal = None
        [last] = [s for s in steps(self.settings) if s.name == "teardown"]
        # what is left of the budget, and at least its reserve
        result = self.run(last, limit=max(self.left_s(), self.settings.teardown_reserve_s))
        left = result.figures.get("left_behind") or []
        if not result.ok or left:
            self.exit_code = 3
        else:
            shutil.rmtree(self.work, ignore_errors=True)
            failed = any(r.counts_as_failure for r in self.results)
            self.exit_code = 128 + stopped.signum if stopped else int(failed)
        self.save(final=True)

    def save(self, final: bool = False) -> None:
        s = self.settings
        state = {"schema": 1, "started_utc": self.started_utc, "finished": final,
                 "exit": self.exit_code, "stopped_by": self.stopped_by,
                 "elapsed_s": round(time.monotonic() - self.started, 1),
                 "budget_s": s.budget_s, "settings": s.to_json(),
                 "steps": [asdict(r) for r in self.results]}
        self.out.write("results.json", (json.dumps(state, indent=1, default=str) + "\n").encode())
        self.out.write("summary.md", summary(state, self.results).encode())
        if self.work.exists():
            self.out.pack()
        png = self.work / "headline" / "bench.png"
        if png.is_file():
            shutil.copyfile(png, s.out / "headline.png")


def summary(state: dict, results: list[StepResult]) -> str:
    """The headline figures first, then one row per step."""
    s = state["settings"]
    status = (f"exit {state['exit']}" if state["finished"] else
              f"in progress after {state['elapsed_s']:.0f} s")
    if state["stopped_by"]:
        status += f" (stopped by {state['stopped_by']})"
    kept = " (kept: something is left running)" if state["exit"] == 3 else ""
    lines = [f"# omni-dp's device call: GPU {s['gpu']}, {state['started_utc']} UTC",
             "",
             f"model `{s['model']}`, budget {state['budget_s']:.0f} s, {status}, "
             f"work dir {s['work']}{kept}", "", "## Headline", ""]
    lines += [f"- {line}" for line in headline_lines(results)] or ["- (no figure yet)"]
    lines += ["", "## Steps", "", "| step | result | s |", "|---|---|---|"]
    lines += [f"| {r.name} | {r.verdict} | {r.seconds:g} |" for r in results]
    lines += ["", "Every figure: results.json. Each step's output: console.log and "
              "artifacts.tar.gz (steps/).", ""]
    return "\n".join(lines)


def main() -> int:
    settings = Settings.from_env(os.environ)
    settings.out.mkdir(parents=True, exist_ok=True)
    settings.work.mkdir(parents=True, exist_ok=True)
    return DeviceCall(settings).main()


if __name__ == "__main__":
    sys.exit(main())
