"""Start, gate and stop one replica of a run, from its record in run.json.

Bring-up and the supervisor's restarts both go through `ReplicaSet`, so a restarted replica gets
the same argv, environment, CPU block and port, and passes the same gates.
"""

from __future__ import annotations

import subprocess
import time

from omni_dp.launcher.gates import GateFailed, kv_problems, server_info, wait_healthy
from omni_dp.launcher.processes import child_env, spawn, stop_processes
from omni_dp.launcher.state import RunState, append_private
from omni_dp.logs import json_line
from omni_dp.mps.attach import AttachReport, ReplicaProcesses
from omni_dp.mps.runs import verify_and_record
from omni_dp.runfile import ReplicaState


class ReplicaSet:
    def __init__(self, state: RunState) -> None:
        self.state = state
        self.popens: dict[int, subprocess.Popen] = {}  # children of this process, to reap

    def url(self, index: int) -> str:
        return self.state.replica(index).url

    def start(self, index: int) -> None:
        record = self.state.replica(index)
        log = self.state.logs / record.log
        banner = f"--- omni-dp: starting replica {index} at {time.strftime('%F %T')} ---"
        if self.state.plan.log_format == "json":  # every line of the log is JSON then
            banner = json_line("omni_dp.launch", f"starting replica {index}")
        with append_private(log) as f:
            f.write(banner.encode() + b"\n")
        started = spawn(record.argv, child_env(record.env, self.state.token), log)
        self.popens[index] = started.popen
        self.state.update_replica(index, identity=started.identity, pgid=started.pid,
                                  processes=(), state=ReplicaState.STARTING, kv_tokens=None,
                                  mps_attached=None)
        self.state.event("replica_started", replica=index, pid=started.pid,
                         cpus=record.cpus, port=record.port)

    def wait_healthy(self, index: int, timeout_s: float) -> None:
        record = self.state.replica(index)
        assert record.identity is not None, "start() first"
        popen = self.popens.get(index)
        seconds = wait_healthy(record.url, record.identity, self.state.logs / record.log,
                               timeout_s, exit_code=popen.poll if popen else lambda: None)
        self.state.event("replica_healthy", replica=index, seconds=round(seconds, 2))

    def read_kv(self, index: int) -> int:
        """Record the replica's KV capacity and process list from /get_server_info."""
        info = server_info(self.url(index))
        tokens = int(info["max_total_num_tokens"])
        processes = ReplicaProcesses.from_json(index, info["processes"]).processes
        self.state.update_replica(index, kv_tokens=tokens, processes=processes)
        return tokens

    def check_kv(self, indices: list[int]) -> None:
        expected = self.state.plan.expected_kv_tokens
        tokens = {i: self.read_kv(i) for i in indices}
        problems = kv_problems(tokens, expected)
        self.state.event("kv_checked", tokens={str(i): t for i, t in tokens.items()},
                         expected=expected, ok=not problems)
        if problems:
            raise GateFailed(problems[0])

    def verify_attachment(self) -> AttachReport:
        """Every CUDA process of every started replica must be a client of the run's server."""
        record = self.state.record
        assert record.mps is not None, "a run without --mps has no attachment to verify"
        started = [r for r in record.replicas if r.processes]
        report = verify_and_record(record.mps, [r.declared() for r in started],
                                   self.state.token, record.gpu, self.state.directory)
        verdicts = {v.index: v for v in report.replicas}
        for r in started:
            verdict = verdicts.get(r.index)
            self.state.update_replica(r.index, mps_attached=bool(
                report.passed and verdict is not None and verdict.passed))
        self.state.event("mps_verified", result=report.result, problems=report.problems)
        return report

    def stop(self, indices: list[int], timeout_s: float) -> None:
        """Stop these replicas' process groups (drain on SIGTERM, then SIGKILL)."""
        identities = [self.state.replica(i).identity for i in indices]
        live = [i for i in identities if i is not None]
        reap = [self.popens[i] for i in indices if i in self.popens]
        stop_processes(live, self.state.token, timeout_s, reap=reap)
        for i in indices:
            self.state.update_replica(i, state=ReplicaState.STOPPED)
