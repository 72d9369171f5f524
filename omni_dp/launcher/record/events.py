"""The names of the events a run writes to events.jsonl: one enum, for the writer
(RunState.event takes nothing else, so an event no reader knows cannot be written by a typo) and
for the readers that act on them by name (changes/follow.py). docs/contracts.md says what each
carries."""

from __future__ import annotations

import enum


class Event(str, enum.Enum):
    """An event's `event` in events.jsonl; a str, so a line read back compares to it as it is."""

    BRINGUP_FAILED = "bringup_failed"

    CHANGE_DONE = "change_done"
    CHANGE_DRAINED = "change_drained"
    CHANGE_FAILED = "change_failed"
    CHANGE_NOT_WAITING = "change_not_waiting"
    CHANGE_REFUSED = "change_refused"
    CHANGE_STARTED = "change_started"
    CHANGE_STEP = "change_step"
    CHANGE_STEP_DONE = "change_step_done"
    CHANGE_WAITED = "change_waited"
    CHANGE_WAITING = "change_waiting"

    GATEWAY_ADMIN_FAILED = "gateway_admin_failed"
    GATEWAY_DEREGISTERED = "gateway_deregistered"
    GATEWAY_REGISTERED = "gateway_registered"

    HANDOFF_FAILED = "handoff_failed"

    KV_CHECKED = "kv_checked"

    MEMORY_MEASURE_FAILED = "memory_measure_failed"
    MEMORY_MEASURED = "memory_measured"

    MPS_CLIENTS_TERMINATED = "mps_clients_terminated"
    MPS_DAEMON_STARTED = "mps_daemon_started"
    MPS_DAEMON_STOPPED = "mps_daemon_stopped"
    MPS_FAULT = "mps_fault"
    MPS_RESTART_FAILED = "mps_restart_failed"
    MPS_RESTARTED = "mps_restarted"
    MPS_VERIFIED = "mps_verified"

    REPLICA_FAILED = "replica_failed"
    REPLICA_HEALTHY = "replica_healthy"
    REPLICA_HUNG = "replica_hung"
    REPLICA_NUMERIC_CHECK = "replica_numeric_check"
    REPLICA_PROCESSES = "replica_processes"
    REPLICA_STARTED = "replica_started"
    REPLICA_STOP_INCOMPLETE = "replica_stop_incomplete"

    REPLICAS_STOPPED = "replicas_stopped"
    REPLICAS_STOPPING = "replicas_stopping"

    RESTART_COMPLETED = "restart_completed"
    RESTART_DEFERRED = "restart_deferred"
    RESTART_FAILED = "restart_failed"
    RESTART_LEFT_OUT = "restart_left_out"
    RESTART_STARTED = "restart_started"

    ROUTER_ADDED = "router_added"
    ROUTER_ADMIN_FAILED = "router_admin_failed"
    ROUTER_DIED = "router_died"
    ROUTER_DISABLED = "router_disabled"
    ROUTER_ENABLED = "router_enabled"
    ROUTER_FAILED = "router_failed"
    ROUTER_READY = "router_ready"
    ROUTER_REMOVED = "router_removed"
    ROUTER_RESTART_FAILED = "router_restart_failed"

    RUN_CREATED = "run_created"
    RUN_READY = "run_ready"

    SHARE_ATTACHED = "share_attached"
    SHARE_PUBLISHED = "share_published"
    SHARE_SEGMENT_REMOVED = "share_segment_removed"

    SUPERVISOR_CHECK_FAILED = "supervisor_check_failed"
    SUPERVISOR_FAILED = "supervisor_failed"
    SUPERVISOR_RESUME_FAILED = "supervisor_resume_failed"
    SUPERVISOR_RESUMED = "supervisor_resumed"
    SUPERVISOR_STARTED = "supervisor_started"
    SUPERVISOR_SUPERVISING = "supervisor_supervising"
    SUPERVISOR_TAKEOVER_FAILED = "supervisor_takeover_failed"

    TEARDOWN_FINISHED = "teardown_finished"
    TEARDOWN_STARTED = "teardown_started"

    UNPROVEN_ORPHAN = "unproven_orphan"
