"""`python -m omni_dp.launcher.processes.numeric_gate --python PY --device D --record FILE --
PROGRAM ARGS…`: a capped replica's numeric check, then the replica.

Runs bf16_gemm_check.py with the replica's own interpreter, environment (its MPS caps) and CPU
block, writes what the check found to FILE (the launcher reports it once the replica is
healthy), and only when the check passed becomes PROGRAM — exec keeps the pid, so the launcher's
record stays valid. A replica whose check fails never starts: its log says why and what to do.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from omni_dp.contract import ExitCode
from omni_dp.launcher.processes.pin import EXEC_FAILED

CHECK_SCRIPT = Path(__file__).with_name("bf16_gemm_check.py")
CHECK_TIMEOUT_S = 300.0  # torch's import and a first CUDA context under MPS: seconds, not minutes


def run_check(python: str, device: str) -> dict:
    """The check's facts; a check that could not run is a failed one, saying why."""
    try:
        done = subprocess.run([python, str(CHECK_SCRIPT), "--device", device],
                              capture_output=True, text=True, timeout=CHECK_TIMEOUT_S,
                              stdin=subprocess.DEVNULL, check=False)
    except subprocess.TimeoutExpired:
        return {"passed": False, "error": f"no answer within {CHECK_TIMEOUT_S:.0f} s"}
    except OSError as exc:
        return {"passed": False, "error": f"cannot run {python}: {exc}"}
    lines = done.stdout.strip().splitlines()
    try:
        facts = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        facts = None
    if not isinstance(facts, dict):
        detail = (done.stderr.strip() or done.stdout.strip() or "no output")[-800:]
        return {"passed": False, "error": f"exit status {done.returncode}: {detail}"}
    facts["passed"] = bool(facts.get("passed")) and done.returncode == 0
    return facts


def verdict(facts: dict) -> str:
    caps = ", ".join(f"{name}={value}" for name, value in (facts.get("caps") or {}).items()
                     if value is not None) or "no cap set"
    if facts.get("error"):
        return (f"omni-dp numeric check: could NOT run the BF16 GEMM check under this "
                f"replica's MPS caps ({caps}): {facts['error']}; the replica does not start")
    shown = (f"BF16 GEMM {'x'.join(map(str, facts.get('shape', [])))} on {facts.get('device')}: "
             f"relative error {facts.get('relative_error', float('nan')):.4f} (limit "
             f"{facts.get('threshold', float('nan')):g}) under {caps}")
    if facts["passed"]:
        return f"omni-dp numeric check: passed, {shown}"
    return (f"omni-dp numeric check: FAILED, {shown}: cuBLAS gives wrong BF16 results under "
            "this SM cap, so the replica does not start; launch with another "
            "--mps-thread-percentage, or none")


def main(argv: list[str]) -> int:
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        print("usage: python -m omni_dp.launcher.processes.numeric_gate --python PY --device D "
              "--record FILE -- PROGRAM [ARGS…]", file=sys.stderr)
        return ExitCode.USAGE
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="omni-dp numeric gate")
    parser.add_argument("--python", required=True)
    parser.add_argument("--device", required=True)
    parser.add_argument("--record", required=True, type=Path)
    args = parser.parse_args(argv[:split])
    program = argv[split + 1:]
    facts = run_check(args.python, args.device)
    print(verdict(facts), flush=True)
    try:
        args.record.write_text(json.dumps(facts) + "\n")
    except OSError as exc:
        print(f"omni-dp numeric check: cannot record it in {args.record}: {exc}", flush=True)
        return ExitCode.RUNTIME
    if not facts["passed"]:
        return ExitCode.CHECK_FAILED
    try:
        os.execvp(program[0], program)
    except OSError as exc:
        print(f"omni-dp numeric gate: cannot run {program[0]}: {exc}", file=sys.stderr)
        return EXEC_FAILED


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
