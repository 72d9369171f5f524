"""The direct proof that MPS runs two processes' kernels at once: two processes, each one long
kernel on a single SM, let go together; without MPS the GPU time-slices between their
contexts, under MPS both run side by side.

Two kinds of kernel, because they can disagree:
- `sleep`: torch.cuda._sleep(cycles), a spin on the SM's clock counter. Its length is time on
  the SM's clock, so a time-sliced context switched out while that clock runs on can finish
  "early" and look concurrent without MPS;
- `spin`: a fixed count of dependent multiply-adds (a jiterator kernel on 32 elements: one
  block), whose length is work done, not time passed: time-sliced, a pair takes about twice as
  long as one.
Each is timed alone first (its work calibrated to about `target_s`), then as a pair without MPS
and as a pair under the daemon. Facts, recorded by bench/mps_smoke.py; nothing is asserted.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass

KINDS = ("sleep", "spin")
CALIBRATION_WORK = {"sleep": 50_000_000, "spin": 2_000_000}  # tens of ms on an H100
START_TIMEOUT_S = 60  # import torch, a context, the jiterator's compile

# One client: makes its context, compiles and warms both kernels, says {"ready": true}, then
# answers one stdin line at a time: `calibrate KIND` (how long CALIBRATION_WORK takes) or
# `run KIND WORK` (the kernel's start and end on the monotonic clock, which every process of
# the machine shares). EOF ends it.
CLIENT = r"""
import json, sys, time
def say(**facts):
    print(json.dumps(facts), flush=True)
try:
    import torch
    x = torch.zeros(32, device="cuda")
    code = ("template <typename T> T omni_dp_spin(T x, T n) { "
            "for (long i = 0; i < (long)n; ++i) { x = x * T(0.999) + T(0.001); } return x; }")
    spin = torch.cuda.jiterator._create_jit_fn(code, n=1.0)
    kernels = {"sleep": lambda n: torch.cuda._sleep(n), "spin": lambda n: spin(x, n=float(n))}
    for run in kernels.values():
        run(1000)
    torch.cuda.synchronize()
except Exception as exc:
    say(error=f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
    sys.exit(1)
say(ready=True)
calibration = json.loads(sys.argv[1])
for line in sys.stdin:
    verb, kind, *work = line.split()
    n = int(work[0]) if work else calibration[kind]
    t0 = time.monotonic(); kernels[kind](n); torch.cuda.synchronize(); t1 = time.monotonic()
    say(t0=t0, t1=t1)
"""


@dataclass(frozen=True)
class PairTiming:
    """Two kernels' intervals on one clock, against the length of one alone."""

    alone_s: float
    wall_s: float  # first start to last end
    overlap_s: float  # how long both ran at once
    durations_s: tuple[float, float]

    @property
    def wall_vs_alone(self) -> float:
        """~1.0: side by side; ~2.0: one after the other (or taking turns)."""
        return self.wall_s / self.alone_s

    def to_json(self) -> dict:
        return {**asdict(self), "wall_vs_alone": round(self.wall_vs_alone, 3)}


def pair_timing(intervals: list[tuple[float, float]], alone_s: float) -> PairTiming:
    """The timing of two kernels from their (start, end) intervals."""
    if len(intervals) != 2 or alone_s <= 0:
        raise ValueError(f"two intervals and a positive alone time, got {intervals}, {alone_s}")
    (a0, a1), (b0, b1) = intervals
    return PairTiming(alone_s=alone_s, wall_s=max(a1, b1) - min(a0, b0),
                      overlap_s=max(0.0, min(a1, b1) - max(a0, b0)),
                      durations_s=(a1 - a0, b1 - b0))


class ClientFailed(Exception):
    """A client said an error, said nothing in time, or exited early."""


class Clients:
    """Client processes started with `envs`, each ready once the context is made."""

    def __init__(self, envs: list[Mapping[str, str]]) -> None:
        self.procs = [subprocess.Popen([sys.executable, "-c", CLIENT,
                                        json.dumps(CALIBRATION_WORK)], env=dict(env), text=True,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       stderr=subprocess.DEVNULL) for env in envs]

    def __enter__(self) -> Clients:
        try:
            for proc in self.procs:
                self._said(proc, START_TIMEOUT_S)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def ask(self, line: str, timeout: float) -> list[dict]:
        """Send `line` to every client at once; each one's answer."""
        for proc in self.procs:
            proc.stdin.write(line + "\n")
            proc.stdin.flush()
        return [self._said(proc, timeout) for proc in self.procs]

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)

    @staticmethod
    def _said(proc: subprocess.Popen, timeout: float) -> dict:
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        line = proc.stdout.readline().strip() if ready else ""
        if not line:
            raise ClientFailed(f"client {proc.pid} exited (rc {proc.poll()})" if ready else
                               f"client {proc.pid} said nothing in {timeout:.0f} s")
        said = json.loads(line)
        if "error" in said:
            raise ClientFailed(said["error"])
        return said


def _interval(said: dict) -> tuple[float, float]:
    return said["t0"], said["t1"]


def concurrency_facts(plain_env: Mapping[str, str], mps_env: Mapping[str, str],
                      clients_of: Callable[[list[int]], dict], target_s: float = 1.0) -> dict:
    """Each kind alone, as a pair without MPS and as a pair under the daemon (`clients_of`
    says what the daemon lists while that pair is ready). An error is a fact too."""
    facts: dict = {kind: {} for kind in KINDS}
    limit = START_TIMEOUT_S + 10 * target_s
    try:
        with Clients([plain_env]) as alone:
            for kind in KINDS:
                [took] = alone.ask(f"calibrate {kind}", limit)
                work = int(CALIBRATION_WORK[kind] * target_s / max(took["t1"] - took["t0"], 1e-6))
                [ran] = alone.ask(f"run {kind} {work}", limit)
                facts[kind] = {"work": work, "alone_s": round(ran["t1"] - ran["t0"], 4)}
        for name, env in (("without_mps", plain_env), ("with_mps", mps_env)):
            with Clients([env, env]) as pair:
                listed = clients_of(pair.pids) if name == "with_mps" else None
                for kind in KINDS:
                    said = pair.ask(f"run {kind} {facts[kind]['work']}", limit)
                    timing = pair_timing([_interval(s) for s in said], facts[kind]["alone_s"])
                    facts[kind][name] = {**timing.to_json(),
                                         **({"daemon": listed} if listed is not None else {})}
    except (ClientFailed, OSError, ValueError, KeyError) as exc:
        facts["error"] = f"{type(exc).__name__}: {exc}"
    return facts


def describe(facts: dict) -> list[str]:
    """One line per kind (and the error, if any), for a summary."""
    lines = []
    for kind in KINDS:
        found = facts.get(kind) or {}
        if "alone_s" not in found:
            continue
        parts = [f"alone {found['alone_s']:.2f} s"]
        for name in ("without_mps", "with_mps"):
            if name in found:
                parts.append(f"pair {name.replace('_', ' ')}: wall "
                             f"{found[name]['wall_vs_alone']:.2f}x alone")
        lines.append(f"{kind}: " + "; ".join(parts))
    if "error" in facts:
        lines.append(f"error: {facts['error']}")
    return lines


if __name__ == "__main__":  # by hand, no daemon: both pairs are plain
    import os

    print(json.dumps(concurrency_facts(os.environ, os.environ, lambda pids: {}), indent=1))
