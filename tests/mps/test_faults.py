"""The MPS fault patterns against the lines drivers really write (control.log, server.log) and
the ones torch prints in a replica's log: a false positive restarts every replica of the GPU, a
false negative leaves a broken server serving."""

from __future__ import annotations

import pytest

from omni_dp.mps.faults import fault_lines, is_fault_line

STAMP = "[2026-02-06 09:34:36.380 Control   261]"

FAULTS = [
    # control.log (drivers 535 and 580)
    f"{STAMP} Server 92 exited with status 1",
    "[2024-12-10 06:38:01.222 Control    64] Server 95 exited with status 139",
    f"{STAMP} server 95 exited with exit code 2",
    "[2024-12-10 06:38:01.158 Control    64] Server encountered a fatal exception. Shutting down",
    f"{STAMP} FAULT",
    "[2026-02-06 09:40:00.000 Server   337] Server is in FAULT state",
    # a replica's log, as torch words the server-level MPS errors (cudaGetErrorString)
    "RuntimeError: CUDA error: MPS client failed to connect to the MPS control daemon or the MPS "
    "server",
    "torch.AcceleratorError: CUDA error: the remote procedural call between the MPS server and "
    "the MPS client failed",
    "RuntimeError: CUDA error: MPS server is not ready to accept new MPS client requests",
    "UserWarning: CUDA initialization: Unexpected error from cudaGetDeviceCount(). Error 805: "
    "MPS client failed to connect to the MPS control daemon or the MPS server",
    "CUDA driver error: the MPS RPC call failed",
    # and by name
    "RuntimeError: CUDA error: cudaErrorMpsRpcFailure",
    "cudaErrorMpsServerNotReady",
    "CUresult CUDA_ERROR_MPS_CONNECTION_FAILED",
]

NOT_FAULTS = [
    # control.log of a healthy run
    f"{STAMP} Starting control daemon using socket /run/x/pipe/control",
    f"{STAMP} To connect CUDA applications to this daemon, set env CUDA_MPS_PIPE_DIRECTORY=/x",
    f"{STAMP} CUDA MPS Control binary version: 13000",
    f"{STAMP} Accepting connection...",
    f"{STAMP} User did not send valid credentials",
    f"{STAMP} NEW CLIENT 11801 from user 1000: Server is not ready, push client to pending list",
    f"{STAMP} NEW CLIENT 0 from user 0: Server already exists",
    f"{STAMP} Starting new server 337 for user 0",
    f"{STAMP} NEW SERVER 11803: Ready",
    f"{STAMP} Server 337 exited with status 0",
    f"{STAMP} Cmd:set_default_active_thread_percentage 50",
    f"{STAMP} Exit with status 0",
    # server.log of a healthy run (driver 580)
    "[2026-04-28 18:20:41.704 Other 4428] Startup",
    "[2026-04-28 18:20:41.704 Other 4428] MPS Server connecting to control daemon on socket: /x",
    "[2026-04-28 18:20:41.855 Server 4428] Creating server context on device 0 (NVIDIA H100)",
    "[2026-04-28 18:20:41.986 Server 4428] Device pinned memory limit for device 0 set to "
    "0x140000000 bytes",
    "[2026-04-28 18:20:41.986 Server 4428] Server has started",
    "[2026-04-28 18:20:41.986 Server 4428] Client {PID: 4267, Context ID: 0} connected",
    "[2026-04-28 18:20:42.001 Server 4428] Volta MPS: status of client {4267, 1} is ACTIVE",
    "[2026-04-28 18:21:00.000 Server 4428] Client {4267, 1} exit",
    # a replica's log: words that contain FAULT, and the client-level MPS errors
    "compute mode DEFAULT, page size 16",
    "SEGFAULT handler installed; FAULTS=0",
    "RuntimeError: CUDA error: the MPS client has been terminated by the server",
    "cudaErrorMpsClientTerminated",
    "the hardware resources required to create MPS client have been exhausted",
    "cudaErrorMpsMaxClientsReached",
    "stage process vocoder exited 3",
    "CUDA_MPS_PIPE_DIRECTORY=/run/x/pipe failed to import optional module",
]


@pytest.mark.parametrize("line", FAULTS)
def test_a_fault_line_is_one(line):
    assert is_fault_line(line), line


@pytest.mark.parametrize("line", NOT_FAULTS)
def test_a_healthy_line_is_no_fault(line):
    assert not is_fault_line(line), line


def test_fault_lines_names_the_log_and_keeps_only_faults():
    text = "\n".join([NOT_FAULTS[5], FAULTS[0], NOT_FAULTS[-3], "  " + FAULTS[7] + "  "])
    assert fault_lines("control.log", text) == [f"control.log: {FAULTS[0]}",
                                               f"control.log: {FAULTS[7]}"]
