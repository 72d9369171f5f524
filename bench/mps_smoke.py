"""MPS smoke test: one torch client under a private control daemon. Prints facts, not verdicts.

What the launcher's attachment proof rests on, asked of the real driver:
- which control/server pair is found (PATH, the driver's folder, next to nvidia-smi) and their
  versions; does the daemon start the server binary it was given?
- is a client listed by `get_client_list` after `cuInit` only, and after a context exists?
- what NVML lists for it: the compute process list or the MPS one?
- what the control and server logs say;
- with --concurrency S: do two processes' kernels run at once, without MPS and under it
  (bench/kernel_pair.py: each kernel timed alone, then as a pair, for about S seconds each).
Without a GPU (CI) the same steps run against the real control daemon: the client cannot
initialise CUDA, and an explicit `start_server` shows that no server can start.

    python bench/mps_smoke.py --work /tmp/smoke [--gpu 0] [--mps-control PATH] [--json]
        [--concurrency 1.0]
    python bench/mps_smoke.py --work /tmp/smoke --cleanup   # quit what a killed run left

Exit 0 when every step ran (whatever the facts), 2 when no control binary was found, 3 when a
step could not run (the facts so far are printed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import kernel_pair

from omni_dp.gpus import query_gpu
from omni_dp.mps.binaries import locate_mps_binaries
from omni_dp.mps.control import BinaryNotFound, MpsControl, MpsControlError
from omni_dp.mps.daemon import CONTROL_LOG, DaemonRecord, MpsDaemon, MpsDaemonError
from omni_dp.procs import is_alive

PHASE_TIMEOUT_S = 90  # a first CUDA context under MPS starts the server: seconds, not minutes
RECORD = "daemon.json"
# Every front-end call of ours logs these; the lines between them are the facts.
UI_CHATTER = re.compile(r"Accepting connection|NEW UI|UI closed|Cmd:get_server_list|"
                        r"Cmd:get_client_list|Cmd:get_default_active_thread_percentage|\] 100\.0$")

# The client: each phase prints one JSON line, then waits for a line on stdin, so the daemon
# and NVML are asked while the client holds exactly that state.
CLIENT = r"""
import ctypes, json, sys
def say(**facts):
    print(json.dumps(facts), flush=True)
    sys.stdin.readline()
try:
    say(phase="cuinit", rc=ctypes.CDLL("libcuda.so.1").cuInit(0))
except OSError as exc:
    say(phase="cuinit", error=f"cannot load libcuda.so.1: {exc}")
try:
    import torch
    x = torch.ones(1 << 20, device="cuda")
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    say(phase="context", device=torch.cuda.get_device_name(0), sum=float(x.sum()),
        mem_free=free, mem_total=total)
except Exception as exc:
    say(phase="context", error=f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
say(phase="exit")
"""


class Interrupted(Exception):
    pass


def _interrupted(signum, frame) -> None:
    raise Interrupted(signal.Signals(signum).name)


class Smoke:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = Path(args.work).resolve()
        self.facts: dict = {}

    def fact(self, key: str, value) -> None:
        self.facts[key] = value
        if not self.args.json:
            print(f"{key}: {json.dumps(value)}", flush=True)

    # --- reads ----------------------------------------------------------------------------
    def daemon_view(self, control: MpsControl) -> dict:
        view: dict = {}
        try:
            servers = control.server_list()
            view["servers"] = servers
            view["clients"] = {str(s): control.client_list(s) for s in servers}
        except MpsControlError as exc:
            view["error"] = str(exc)
        return view

    def nvml_view(self, uuid: str | None) -> dict:
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception as exc:
            return {"error": f"NVML unavailable: {exc}"}
        try:
            handle = (pynvml.nvmlDeviceGetHandleByUUID(uuid) if uuid
                      else pynvml.nvmlDeviceGetHandleByIndex(int(self.args.gpu)))
            view = {}
            for key, fn in (("compute", "nvmlDeviceGetComputeRunningProcesses"),
                            ("mps", "nvmlDeviceGetMPSComputeRunningProcesses")):
                try:
                    view[key] = [{"pid": p.pid, "used_bytes": p.usedGpuMemory}
                                 for p in getattr(pynvml, fn)(handle)]
                except Exception as exc:
                    view[key] = f"error: {exc}"
            return view
        except Exception as exc:
            return {"error": str(exc)}
        finally:
            with contextlib.suppress(Exception):
                pynvml.nvmlShutdown()

    # --- the steps ------------------------------------------------------------------------
    def run(self) -> int:
        try:
            binaries = locate_mps_binaries(self.args.mps_control)
        except BinaryNotFound as exc:
            self.fact("binaries", {"error": str(exc)})
            return 2
        self.fact("binaries", {"control": binaries.control, "server": binaries.server,
                               "origin": binaries.origin,
                               "control_version": binaries.control_version,
                               "driver_version": binaries.driver_version,
                               "versions_differ": binaries.mismatch})
        gpu, problems, _ = query_gpu(self.args.gpu)
        self.fact("gpu", {"uuid": gpu.uuid, "name": gpu.name, "compute_mode": gpu.compute_mode,
                          "mig": gpu.mig_enabled} if gpu else
                  {"error": "; ".join(p.message for p in problems) or "none"})
        uuid = gpu.uuid if gpu else None

        control = MpsControl(binaries.control, str(self.work / "pipe"), str(self.work / "log"),
                             server_binary=binaries.server)
        daemon = MpsDaemon(control)
        try:
            record = daemon.start(gpu_uuid=uuid)
        except MpsDaemonError as exc:
            self.fact("daemon", {"error": str(exc)})
            return 3
        (self.work / RECORD).write_text(json.dumps(record.to_json()))
        try:
            self.fact("daemon", {"pid": record.identity.pid,
                                 "path_first": control.env()["PATH"].split(os.pathsep)[0],
                                 "pid_file": (self.work / "pipe" /
                                              "nvidia-cuda-mps-control.pid").exists(),
                                 "before_any_client": self.daemon_view(control)})
            self.fact("static_partitions", self.partition_probe(control))
            self.client(control, uuid)
            if not self.facts.get("after_context", {}).get("daemon", {}).get("servers"):
                self.start_server_by_hand(control)
            if self.args.concurrency > 0:
                self.kernel_pairs(control, uuid)
        finally:
            self.stop(daemon, record)
        return 0

    def partition_probe(self, control: MpsControl) -> dict:
        """Does this daemon know static SM partitions? Asked, never assumed from a version:
        its answers to `help` and to a bare `sm_partition` (which lists or explains, and adds
        nothing), as they are. omni-dp offers no static partition until a GPU run says how."""
        answers = {}
        for command in ("help", "sm_partition"):
            try:
                answers[command] = control.run(command)
            except MpsControlError as exc:
                answers[command] = f"{type(exc).__name__}: {exc}"
        answers["known"] = "Unknown command" not in answers["sm_partition"]
        return answers

    def client(self, control: MpsControl, uuid: str | None) -> None:
        env = control.env()
        if uuid:
            env["CUDA_VISIBLE_DEVICES"] = uuid
        proc = subprocess.Popen([sys.executable, "-c", CLIENT], env=env, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)
        self.fact("client_pid", proc.pid)
        try:
            for phase in ("cuinit", "context", "exit"):
                line = self.read_line(proc)
                said = json.loads(line) if line.startswith("{") else {"output": line}
                time.sleep(0.5)  # the daemon logs and lists a new client asynchronously
                daemon = self.daemon_view(control)
                listed = any(proc.pid in c for c in daemon.get("clients", {}).values())
                self.fact(f"after_{phase}", {"client": said, "daemon": daemon,
                                             "client_listed": listed,
                                             "nvml": self.nvml_view(uuid)})
                proc.stdin.write("\n")
                proc.stdin.flush()
            proc.wait(30)
            time.sleep(0.5)
            self.fact("after_client_exit", {"rc": proc.returncode,
                                            "daemon": self.daemon_view(control)})
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)

    def kernel_pairs(self, control: MpsControl, uuid: str | None) -> None:
        """Two processes' kernels, without MPS (a pipe directory no daemon serves: the silent
        fallback) and as clients of this daemon."""
        plain = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS_")}
        nowhere = self.work / "no-daemon"
        nowhere.mkdir(exist_ok=True)
        plain["CUDA_MPS_PIPE_DIRECTORY"] = str(nowhere)
        served = control.env()
        if uuid:
            plain["CUDA_VISIBLE_DEVICES"] = served["CUDA_VISIBLE_DEVICES"] = uuid

        def clients_of(pids: list[int]) -> dict:
            time.sleep(0.5)  # the daemon lists a new client asynchronously
            view = self.daemon_view(control)
            listed = {c for clients in view.get("clients", {}).values() for c in clients}
            return {"daemon": view, "pair_listed": [pid in listed for pid in pids]}

        facts = kernel_pair.concurrency_facts(plain, served, clients_of, self.args.concurrency)
        self.fact("concurrency", facts)

    def read_line(self, proc: subprocess.Popen) -> str:
        ready, _, _ = select.select([proc.stdout], [], [], PHASE_TIMEOUT_S)
        if not ready:
            raise TimeoutError(f"the client said nothing for {PHASE_TIMEOUT_S} s")
        line = proc.stdout.readline().strip()
        if not line:
            raise RuntimeError(f"the client exited early (rc {proc.wait(10)})")
        return line

    def start_server_by_hand(self, control: MpsControl) -> None:
        """No client got a server: can the daemon start one at all (binary found, libcuda)?"""
        before = self._log_lines(control)
        try:
            reply = control.run(f"start_server -uid {os.getuid()}")
        except MpsControlError as exc:
            reply = f"error: {exc}"
        time.sleep(1.0)
        self.fact("start_server_by_hand", {
            "reply": reply, "daemon": self.daemon_view(control),
            "control_log": [line for line in self._log_lines(control)[len(before):]
                            if "erver" in line]})

    def _log_lines(self, control: MpsControl) -> list[str]:
        try:
            return Path(control.log_dir, CONTROL_LOG).read_text(errors="replace").splitlines()
        except OSError:
            return []

    def stop(self, daemon: MpsDaemon, record: DaemonRecord) -> None:
        try:
            stopped = daemon.stop(record, force=True)
            self.fact("quit", {"stopped": stopped, "alive_after": is_alive(record.identity)})
        except MpsDaemonError as exc:
            self.fact("quit", {"error": str(exc)})
        logs = {}
        for name in (CONTROL_LOG, "server.log"):
            with contextlib.suppress(OSError):
                lines = Path(record.log_dir, name).read_text(errors="replace").splitlines()
                logs[name] = [line for line in lines if not UI_CHATTER.search(line)][-40:]
        self.fact("logs", logs)


def cleanup(work: Path) -> int:
    """Quit the daemon a killed smoke test left (recorded pid + create time only)."""
    try:
        record = DaemonRecord.from_json(json.loads((work / RECORD).read_text()))
    except (OSError, ValueError, KeyError):
        print("mps_smoke cleanup: no daemon record, nothing to stop")
        return 0
    if not is_alive(record.identity):
        print(f"mps_smoke cleanup: daemon {record.identity.pid} already gone")
        return 0
    try:
        MpsDaemon(record.control()).stop(record, force=True)
    except MpsDaemonError as exc:
        print(f"mps_smoke cleanup: {exc}")
        return 3
    print(f"mps_smoke cleanup: daemon {record.identity.pid} stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", required=True,
                        help="a directory for the daemon's pipe and logs (short path)")
    parser.add_argument("--gpu", default="0", help="index or UUID")
    parser.add_argument("--mps-control", default=None)
    parser.add_argument("--json", action="store_true", help="one JSON object at the end")
    parser.add_argument("--cleanup", action="store_true")
    parser.add_argument("--concurrency", type=float, default=0.0, metavar="SECONDS",
                        help="also time two processes' kernels of about SECONDS each, without "
                             "MPS and under the daemon (0: not)")
    args = parser.parse_args(argv)
    work = Path(args.work)
    if args.cleanup:
        return cleanup(work)
    work.mkdir(parents=True, exist_ok=True, mode=0o700)
    signal.signal(signal.SIGTERM, _interrupted)
    smoke = Smoke(args)
    try:
        rc = smoke.run()
    except (Interrupted, TimeoutError, RuntimeError, OSError, MpsControlError) as exc:
        smoke.fact("stopped_early", f"{type(exc).__name__}: {exc}")
        rc = 3
    if args.json:
        print(json.dumps(smoke.facts, indent=1))
    return rc


if __name__ == "__main__":
    sys.exit(main())
