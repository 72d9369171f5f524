"""After an MPS fault on one GPU every client of that GPU's daemon is suspect, and only they:
the replicas that depend on the daemon (that GPU's) are taken out of the router and stopped,
the daemon is replaced (its old logs set aside, so their faults do not condemn the new one), and
the replicas come back through the gates of bring-up, verified against the new daemon. The other
GPUs' daemons and replicas are not touched. A failure here stops the run: there is nothing left
to fall back on.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path

from omni_dp.launcher.bringup.steps import BringUpFailed, start_daemon, start_replicas
from omni_dp.launcher.engines.replica_api import GateFailed
from omni_dp.launcher.processes.ours import stop_processes
from omni_dp.launcher.record.events import Event
from omni_dp.launcher.supervision.crew import Crew
from omni_dp.launcher.supervision.outcomes import GatesPassed, Outcomes
from omni_dp.launcher.supervision.router_link import RouterLink
from omni_dp.mps.daemon import CONTROL_LOG, DaemonRecord, MpsDaemon, MpsDaemonError
from omni_dp.mps.faults import FaultScanner


class GroupRestart:
    def __init__(self, crew: Crew, router: RouterLink, scanners: Mapping[int, FaultScanner],
                 outcomes: Outcomes) -> None:
        self.crew = crew
        self.router = router
        self.scanners = scanners  # by GPU slot: each daemon's watch reads its own logs
        self.outcomes = outcomes  # each replica that passed every gate, for the loop

    def __call__(self, record: DaemonRecord, fault: str, indices: list[int],
                 delay: float = 0.0) -> None:
        """The restart thread's body: the daemon of record (GPU slot record.gpu) and these
        replicas, its clients."""
        try:
            for i in indices:  # restarting, recorded by the loop when it handed them over
                self.router.set_disabled(i, True)
            if self.crew.stop.wait(delay) or not self._replace_daemon(record, indices):
                return
            self._bring_back(record.gpu, indices)
        except (BringUpFailed, GateFailed, MpsDaemonError, OSError) as exc:
            gpu = self.crew.state.record.gpu_title(record.gpu)
            self.crew.state.event(Event.MPS_RESTART_FAILED, gpu=record.gpu, error=str(exc))
            self.crew.say("restarting after the MPS fault" + (f" on {gpu}" if gpu else "")
                          + f" failed: {exc}; stopping the run")
            self.crew.fail()

    def _replace_daemon(self, record: DaemonRecord, indices: list[int]) -> bool:
        """False when teardown began meanwhile (nothing was started)."""
        crew = self.crew
        crew.replicas.stop(indices, crew.drain_timeout)
        try:
            MpsDaemon(record.control()).stop(record, force=True)
        except MpsDaemonError:
            stop_processes([record.identity], None, 5.0)
        logs = [crew.state.logs / crew.state.replica(i).log for i in indices]
        self.scanners[record.gpu].set_aside([Path(record.log_dir, CONTROL_LOG), *logs],
                                            int(time.time()))
        with crew.gate.open() as may:
            if not may:
                return False
            start_daemon(crew.state, record.gpu, record.binary, record.server_binary)
        return True

    def _bring_back(self, gpu: int, indices: list[int]) -> None:
        crew = self.crew
        start_replicas(crew.state, crew.replicas, indices,
                       sequential=crew.state.plan.start == "sequential",
                       timeout_s=crew.state.supervision.start_timeout, say=crew.say)
        named = crew.state.record.gpu_title(gpu)
        if not crew.replicas.verify_attachment(gpu).passed:
            raise BringUpFailed("MPS attachment FAILED after the daemon restart"
                                + (f" on {named}" if named else ""))
        for i in indices:  # the fault is resolved for every replica
            self.outcomes.report(GatesPassed(i))
            crew.state.update_replica(i, last_error=None)
        out = [i for i in indices if not self.router.set_disabled(i, False)]
        self.router.left_out(out)
        crew.state.event(Event.MPS_RESTARTED, gpu=gpu, replicas=indices, not_in_router=out)
        done = ("MPS daemon and every replica restarted and verified" if named is None else
                f"MPS daemon of {named} and its replica(s) {', '.join(map(str, indices))} "
                "restarted and verified")
        crew.say(done + (f"; replica(s) {', '.join(map(str, out))} NOT back in the router "
                         "(above), retried at every sweep" if out else "; all back in the router"))
