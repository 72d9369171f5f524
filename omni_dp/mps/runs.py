"""Reading a run's state for `omni-dp verify-mps`, and re-proving its attachment, GPU by GPU.

The launcher writes the run state (docs/contracts.md: `<state dir>/runs/<run-id>/`); it is read
through omni_dp/runfile.py, the one reader, like every other reader of it. What verify-mps uses
of a `RunRecord`: its run id, its GPUs (`gpus`: slot, label "GPU-<uuid>"/index/"cpu", index),
each GPU's MPS daemon (`daemons`, by slot), each replica's GPU slot and declared processes; and
the run token (also in each replica's environment). A run has one private daemon per GPU, so
each GPU's replicas are proven against that GPU's daemon, and each GPU's proof is written to
its own files (`rundir.attach_stem`: mps_attach.txt/.json in a one-GPU run,
mps_attach.gpu<INDEX>.txt/.json per GPU of a run over several).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from omni_dp.gpus import nvml_gpu_pids
from omni_dp.mps.attach import (
    AttachReport,
    ReplicaProcesses,
    format_text,
    verify_attachment,
    write_artifacts,
)
from omni_dp.mps.daemon import DaemonRecord
from omni_dp.procs import is_alive
from omni_dp.rundir import attach_stem, runs_dir, state_dir
from omni_dp.runfile import (
    GpuRecord,
    RunFileError,
    RunNotFound,
    RunRecord,
    StoredRun,
    find_run_dir,
    stored_runs,
)
from omni_dp.runfile import pick_run as pick_one

PASS, FAIL, CANNOT_CHECK = "PASS", "FAIL", "CANNOT_CHECK"


class CannotCheck(Exception):
    """verify-mps cannot give a verdict on the run at all (exit 2); the message says why."""


@dataclass(frozen=True)
class GpuVerdict:
    """One GPU of the run: its replicas proven against its daemon, or why they could not be
    (`reason`: no daemon recorded for it, or its daemon is not running)."""

    gpu: GpuRecord
    proof: str  # the stem of its proof files in the run directory
    daemon_pid: int | None
    report: AttachReport | None = None
    reason: str | None = None

    @property
    def result(self) -> str:
        if self.report is None:
            return CANNOT_CHECK
        return PASS if self.report.passed else FAIL

    def to_json(self) -> dict:
        data = {"gpu": self.gpu.slot, "index": self.gpu.index, "label": self.gpu.label,
                "name": self.gpu.name, "daemon_pid": self.daemon_pid,
                "proof": f"{self.proof}.txt" if self.report else None}
        if self.report is None:
            return {**data, "result": CANNOT_CHECK, "reason": self.reason}
        return {**data, **self.report.to_json()}


@dataclass(frozen=True)
class RunVerdict:
    """The run's verdict over the GPUs checked: FAIL if any GPU failed, else CANNOT_CHECK if
    any could not be checked (a GPU nobody checked is not a PASS), else PASS."""

    run_id: str
    gpus: tuple[GpuVerdict, ...]
    several: bool  # the run has more than one GPU: its output names each

    @property
    def result(self) -> str:
        results = {v.result for v in self.gpus}
        return next((r for r in (FAIL, CANNOT_CHECK) if r in results), PASS)

    @property
    def unchecked(self) -> tuple[GpuVerdict, ...]:
        return tuple(v for v in self.gpus if v.report is None)

    def reason(self) -> str | None:
        """Why some GPU could not be checked, naming it; None when every one was."""
        if not self.unchecked:
            return None
        return "; ".join(v.reason or "" for v in self.unchecked)

    def to_json(self) -> dict:
        data: dict = {"run_id": self.run_id, "result": self.result}
        if len(self.gpus) == 1 and self.gpus[0].report is not None:
            # As before runs spanned GPUs: scripts read the one report's keys at the top.
            data.update(self.gpus[0].report.to_json())
        if self.unchecked:
            data["reason"] = self.reason()
        data["gpus"] = [v.to_json() for v in self.gpus]
        return data


def format_verdict(verdict: RunVerdict) -> str:
    """The text of `verify-mps`. One GPU: the map and `RESULT:` line as before runs spanned
    GPUs. Several: one block per GPU (its heading gives its verdict), then the run's one
    `RESULT:` line, so that a `grep RESULT:` still reads the run's verdict alone."""
    if not verdict.several and len(verdict.gpus) == 1 and verdict.gpus[0].report is not None:
        return f"run {verdict.run_id}\n{format_text(verdict.gpus[0].report)}"
    lines = [f"run {verdict.run_id}: each GPU's replicas against that GPU's MPS daemon"]
    for gpu in verdict.gpus:
        lines += _gpu_block(gpu)
    lines.append(_result_line(verdict))
    return "\n".join(lines) + "\n"


def _gpu_name(gpu: GpuRecord) -> str:
    """`GPU 1 (NVIDIA H200) [GPU-…]`: the title people read, the label --gpu takes."""
    return gpu.title if gpu.index is None else f"{gpu.title} [{gpu.label}]"


def _gpu_block(gpu: GpuVerdict) -> list[str]:
    daemon = f", daemon pid {gpu.daemon_pid}" if gpu.daemon_pid is not None else ""
    if gpu.report is None:
        return [f"{_gpu_name(gpu.gpu)}{daemon}: {CANNOT_CHECK}", f"    {gpu.reason}"]
    body = format_text(gpu.report).rstrip("\n").splitlines()
    assert body[-1].startswith("RESULT:"), body[-1]
    return ([f"{_gpu_name(gpu.gpu)}{daemon}: {gpu.result}   ({gpu.proof}.txt)"]
            + [f"    {line}" if line else "" for line in body[:-1]])


def _result_line(verdict: RunVerdict) -> str:
    """The run's verdict, naming the GPUs that decided it."""
    failed = [v.gpu.title for v in verdict.gpus if v.result == FAIL]
    unchecked = [v.gpu.title for v in verdict.unchecked]
    if failed:
        also = f"; not checked: {', '.join(unchecked)}" if unchecked else ""
        return (f"RESULT: {FAIL} on {', '.join(failed)}: not every CUDA process of its "
                f"replicas is a client of that GPU's one MPS server{also}")
    if unchecked:
        return f"RESULT: {CANNOT_CHECK}: {verdict.reason()}"
    return (f"RESULT: {PASS}: on each of the {len(verdict.gpus)} GPU(s) checked, every CUDA "
            "process of its replicas is a client of that GPU's one MPS server")


def pick_mps_run(run_id: str | None, root: Path | None = None) -> StoredRun:
    """The named run, or the only live run (omni_dp.runfile's one meaning) with at least one
    MPS daemon recorded; CannotCheck saying why there is none to check."""
    root = root or state_dir()
    try:
        if run_id is not None:
            return StoredRun.read(find_run_dir(run_id, root))
        # Unreadable directories are listed by `omni-dp status`, not here.
        candidates = [run for run in stored_runs(root)
                      if run.live and run.record is not None and run.record.daemons]
        return pick_one(candidates, what="live run with an MPS daemon", plural="live runs",
                        none=f"no live run with an MPS daemon under {runs_dir(root)}",
                        example="omni-dp verify-mps")
    except RunNotFound:
        raise  # nothing there: not a verdict of any kind (the command exits 1 on it)
    except RunFileError as exc:
        raise CannotCheck(str(exc)) from None


def describe_gpus(record: RunRecord) -> str:
    """The run's GPUs as --gpu accepts them: `0 (GPU-…), 1 (GPU-…)`, or `cpu`."""
    return ", ".join(g.label if g.index is None else f"{g.index} ({g.label})"
                     for g in record.gpus)


def select_gpus(record: RunRecord, wanted: str | None) -> tuple[GpuRecord, ...]:
    """Every GPU of the run, or the one --gpu names by NVML index or label (UUID, any case);
    CannotCheck naming the run's GPUs when it has no such GPU."""
    if wanted is None:
        return record.gpus
    key = wanted.strip().lower()
    found = tuple(g for g in record.gpus
                  if key == g.label.lower() or (g.index is not None and key == str(g.index)))
    if not found:
        raise CannotCheck(f"run {record.run_id} has no GPU {wanted!r}; its GPUs: "
                          f"{describe_gpus(record)} (--gpu takes an index or a UUID)")
    return found


def verify_run(run: StoredRun, *, gpu: str | None = None,
               use_nvml: bool = True) -> RunVerdict:
    """Re-prove a run's attachment on every GPU (or the one `gpu` names), each GPU's replicas
    against that GPU's daemon, and rewrite each GPU's proof files."""
    record = run.record
    if record is None or run.token is None:
        raise CannotCheck(run.error or f"the state of run {run.run_id} cannot be read")
    if not record.plan.mps and not record.daemons:
        raise CannotCheck(f"run {run.run_id} was started without --mps: nothing to verify")
    several = len(record.gpus) > 1
    verdicts = tuple(_verify_gpu(run, record, g, several, use_nvml)
                     for g in select_gpus(record, gpu))
    return RunVerdict(record.run_id, verdicts, several)


def _verify_gpu(run: StoredRun, record: RunRecord, gpu: GpuRecord, several: bool,
                use_nvml: bool) -> GpuVerdict:
    """One GPU's verdict; a daemon never recorded or not running is CANNOT_CHECK, said how."""
    assert run.token is not None
    daemon = record.daemon(gpu.slot)
    proof = attach_stem(record.gpu_key(gpu.slot))
    where = f"{gpu.title} of run {run.run_id}" if several else f"run {run.run_id}"
    if daemon is None:
        return GpuVerdict(gpu, proof, None, reason=(
            f"no MPS daemon is recorded for {where} (its bring-up stopped before it started?)"))
    if not is_alive(daemon.identity):
        return GpuVerdict(gpu, proof, daemon.identity.pid, reason=(
            f"the MPS daemon of {where} (pid {daemon.identity.pid}) is not running"))
    replicas = [r.declared() for r in record.replicas_on(gpu.slot)]
    elsewhere = {r.index: record.gpu_record(r.gpu).title for r in record.replicas
                 if r.gpu != gpu.slot}
    report = verify_and_record(daemon, replicas, run.token, gpu.label, run.directory,
                               use_nvml=use_nvml, stem=proof, elsewhere=elsewhere)
    return GpuVerdict(gpu, proof, daemon.identity.pid, report)


def verify_and_record(daemon: DaemonRecord, replicas: list[ReplicaProcesses], run_token: str,
                      gpu: str, directory: Path, *, use_nvml: bool = True,
                      stem: str = "mps_attach",
                      elsewhere: Mapping[int, str] | None = None) -> AttachReport:
    """The attachment verdict over these replicas (one GPU's, against its daemon), written as
    the run's artifacts STEM.txt/.json. A run on "cpu" has no GPU for NVML to list.

    `elsewhere` names the run's replicas on other GPUs (index -> the GPU's title): a process
    of one of them among this daemon's clients reached the wrong GPU's server, which fails
    this GPU (its own daemon's check only sees it missing, if it is missing at all)."""
    control = daemon.control()
    gpu_pids = (lambda: nvml_gpu_pids(gpu)) if use_nvml and gpu != "cpu" else None
    report = verify_attachment(replicas, run_token, control, gpu_pids=gpu_pids)
    report = _flag_other_gpus(report, elsewhere or {})
    write_artifacts(report, directory, stem)
    return report


def _flag_other_gpus(report: AttachReport, elsewhere: Mapping[int, str]) -> AttachReport:
    strays = [m for m in report.clients if m.replica in elsewhere]
    if not strays:
        return report
    problems = [f"MPS client {m.pid} belongs to replica {m.replica}, which runs on "
                f"{elsewhere[m.replica]}: it reached this GPU's daemon, not its own GPU's"
                for m in strays]
    return replace(report, passed=False, problems=[*report.problems, *problems])
