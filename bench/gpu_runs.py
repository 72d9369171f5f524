"""Run-based checks of the device call, each through the command line a user has (`launch
--detach`, `verify-mps`, a request, `down`), each printing `@@json {...}` facts as it ends:

- `overlap`: two built-in replicas on one GPU, with --mps and then without; `verify-mps
  --overlap` on each. Recorded, not gated: launch-bound steps overlap even time-sliced, so
  "without must fail" would not be a sound test;
- `form3`: two replicas whose talker and vocoder run in processes of their own on the GPU
  (placement form ③) under MPS: every CUDA process proven attached, one request;
- `tp2`: a tensor-parallel talker over two ranks. On one GPU that is refused before anything
  starts (NCCL takes one GPU per rank): `serve --dry-run` must say so, exit 2;
- `gpus2`: one run over GPUs 0 and 1 (a daemon each), where the machine has two;
- `caps`: two replicas under --mps-thread-percentage and --mps-memory-limit: the caps each
  daemon read back, each replica's BF16 GEMM check under its cap (its error, the SM count and
  `cudaMemGetInfo` as a capped client sees them: whether it reports the memory cap is not
  documented), attachment, one request.

Every run is downed here whatever happened (`finish_run`); bench/gpu_run.py's cleanup downs
what a killed check left in the state directory.

    python bench/gpu_runs.py overlap --gpu 0 --model small --state-dir /tmp/s
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from launch_scaling import Interrupted, _raise_interrupted, finish_run, free_port_block, omni_dp

LAUNCH_TIMEOUT_S = 150
VERIFY_TIMEOUT_S = 90


class Checks:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.state = Path(args.state_dir).resolve()
        self.env = {**os.environ, "OMNI_DP_STATE_DIR": str(self.state)}

    def launch(self, run_id: str, count: int, replicas: list[str], launch: list[str],
               serve: list[str], facts: dict) -> int | None:
        """`launch --detach` of `count` replicas; the router's port, or None (the reason in
        `facts`)."""
        base = free_port_block(count + 1)
        argv = ["launch", *replicas, "--run-id", run_id, "--base-port", str(base),
                "--router-port", str(base + count), "--detach", "--start-timeout", "90",
                *launch, "--", "--model", self.args.model, *serve]
        print(f"--- omni-dp {shlex.join(argv)}", flush=True)
        done = omni_dp(*argv, env=self.env, timeout=LAUNCH_TIMEOUT_S)
        print(done.stdout[-2000:], done.stderr[-2000:], sep="\n", flush=True)
        facts["launch_rc"] = done.returncode
        if done.returncode != 0:
            facts["launch_error"] = done.stderr.strip().splitlines()[-5:]
            return None
        return base + count

    def verify(self, run_id: str, *flags: str) -> dict:
        done = omni_dp("verify-mps", run_id, "--json", *flags, env=self.env,
                       timeout=VERIFY_TIMEOUT_S)
        print(done.stdout[-3000:], done.stderr[-1000:], sep="\n", flush=True)
        try:
            report = json.loads(done.stdout)
        except ValueError:
            report = (done.stdout + done.stderr).strip()[-500:]
        return {"rc": done.returncode, "report": report}

    def overlap(self) -> dict:
        facts: dict = {}
        for mode in ("mps", "plain"):
            run_id = f"overlap-{mode}-{os.getpid()}"
            found: dict = facts.setdefault(mode, {})
            try:
                flags = ["--mps", "--on-mps-fault", "fail"] if mode == "mps" else []
                if self.launch(run_id, 2, ["--gpu", self.args.gpu, "--replicas", "2"],
                               [*flags, "--max-total-tokens", "4096"], [], found):
                    found["verify_overlap"] = self.verify(
                        run_id, "--overlap", "--duration", str(self.args.duration),
                        "--concurrency", str(self.args.concurrency))
            finally:
                finish_run(self.state, self.env, run_id, found, None)
        return facts

    def form3(self) -> dict:
        serve = ["--talker.process", "talker", "--vocoder.process", "vocoder",
                 "--talker.gpu_memory_fraction", "0.2", "--vocoder.gpu_memory_fraction", "0.05"]
        return self._mps_run("form3", 2, ["--gpu", self.args.gpu, "--replicas", "2"], [],
                             serve, {})

    def gpus2(self) -> dict:
        return self._mps_run("gpus2", 4, ["--gpus", "0,1", "--replicas-per-gpu", "2"], [], [],
                             {})

    def caps(self) -> dict:
        facts: dict = {"thread_percentage": self.args.cap_percentage,
                       "memory_limit": self.args.cap_memory}
        caps = ["--mps-thread-percentage", str(self.args.cap_percentage),
                "--mps-memory-limit", self.args.cap_memory]
        return self._mps_run("caps", 2, ["--gpu", self.args.gpu, "--replicas", "2"], caps, [],
                             facts, read_events=self._cap_events)

    def _cap_events(self, run_id: str, facts: dict) -> None:
        """What the daemons read back and each replica's numeric check, from the run's events."""
        events = self.state / "runs" / run_id / "events.jsonl"
        with contextlib.suppress(OSError, ValueError):
            lines = [json.loads(line) for line in events.read_text().splitlines()]
            facts["daemon_limits"] = [e.get("limits") for e in lines
                                      if e["event"] == "mps_daemon_started"]
            facts["numeric_checks"] = [e for e in lines
                                       if e["event"] == "replica_numeric_check"]

    def _mps_run(self, name: str, count: int, replicas: list[str], launch: list[str],
                 serve: list[str], facts: dict, read_events=None) -> dict:
        """A run under MPS: launched, (its events read), verify-mps, one speech request; downed
        whatever happened."""
        run_id = f"{name}-{os.getpid()}"
        try:
            router = self.launch(run_id, count, replicas,
                                 ["--mps", "--on-mps-fault", "fail", "--max-total-tokens", "4096",
                                  *launch], serve, facts)
            if read_events is not None:
                read_events(run_id, facts)
            if router:
                facts["verify_mps"] = self.verify(run_id)
                facts["speech_status"] = speech(router)
        finally:
            finish_run(self.state, self.env, run_id, facts, None)
        return facts

    def tp2(self) -> dict:
        argv = [sys.executable, "-m", "omni_dp", "serve", "--dry-run", "--device", "cuda",
                "--model", self.args.model, "--talker.tp_size", "2", "--talker.devices", "0,0"]
        done = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=120,
                              check=False)
        said = (done.stdout + done.stderr).strip().splitlines()[-6:]
        print(*said, sep="\n", flush=True)
        return {"dry_run_rc": done.returncode, "said": said,
                "refused_as_expected": done.returncode == 2
                and any("share a GPU" in line for line in said)}


def speech(router: int) -> int | str:
    body = json.dumps({"input": "One more process on the GPU.", "seed": 3}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{router}/v1/audio/speech", body,
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            answer.read()
            return answer.status
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("check", choices=("overlap", "form3", "tp2", "gpus2", "caps"))
    parser.add_argument("--gpu", default="0")
    parser.add_argument("--model", default="small")
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--duration", type=float, default=6.0, help="overlap: seconds of load")
    parser.add_argument("--concurrency", type=int, default=32, help="overlap: streams")
    parser.add_argument("--cap-percentage", type=float, default=50.0,
                        help="caps: each replica's --mps-thread-percentage")
    parser.add_argument("--cap-memory", default="16GiB",
                        help="caps: each replica's --mps-memory-limit")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_interrupted)
    checks = Checks(args)
    try:
        facts = getattr(checks, args.check)()
    except (Interrupted, KeyboardInterrupt) as exc:
        print(f"interrupted ({exc or 'SIGINT'}): the run in progress was torn down", flush=True)
        return 130
    except subprocess.TimeoutExpired as exc:
        facts = {"error": f"timed out: {shlex.join(map(str, exc.cmd))}"}
    print("@@json " + json.dumps(facts), flush=True)
    return 0 if ok(args.check, facts) else 1


def ok(check: str, facts: dict) -> bool:
    """Whether the check itself worked (overlap: both runs measured, whatever they showed)."""
    if check == "tp2":
        return bool(facts.get("refused_as_expected"))
    runs = [facts[m] for m in ("mps", "plain")] if check == "overlap" else [facts]
    return all(r.get("launch_rc") == 0 and r.get("down_rc") == 0 and not r.get("left_behind")
               and (check == "overlap" or (r.get("verify_mps", {}).get("rc") == 0
                                           and r.get("speech_status") == 200))
               for r in runs)


if __name__ == "__main__":
    sys.exit(main())
