"""The placement forms on real `omni-dp serve` processes (CPU): the same seeded requests give
byte-identical audio in every form, each process is on /get_server_info, and a stage process
killed with -9 fails its replica at once, with a terminal error for the request in flight.

Each form is one replica started with its dotted options; two requests at once, so that two
vocoder processes each get one (bound to the least-loaded)."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import signal
import time
import urllib.parse

import psutil
import pytest

from support.http_client import get, post_json
from support.wait import wait_for

SPEECH = "/v1/audio/speech"
CPU = ("--device", "cpu", "--threads", "1", "--max-total-tokens", "2048")
REQUESTS = (
    {"input": "Cut me off.", "seed": 82, "max_new_tokens": 40},
    {"input": "Two stages, two processes.", "seed": 7, "max_new_tokens": 30},
)
FORMS = {
    "split": ("--preprocess.process", "pre", "--talker.process", "talker",
              "--vocoder.process", "vocoder"),
    "colocated": ("--talker.process", "talker", "--vocoder.process", "vocoder",
                  "--talker.gpu_memory_fraction", "0.6", "--vocoder.gpu_memory_fraction", "0.2",
                  "--placement.cpu_device_memory_bytes", "4GiB"),
    "fused": ("--talker.process", "engine", "--vocoder.process", "voc",
              "--placement.fused_stages", "talker,vocoder"),
    "vocoders2": ("--vocoder.process", "voc", "--vocoder.replicas", "2"),
    # Form ④, float64 on the CPU: byte-identical too. The all-reduce sums each layer's partial
    # outputs in another order than one matmul does, which moves the logits by ~1e-15
    # (test_tensor_parallel measures it); sampling compares a uniform with the CDF, so a code
    # could only differ if a uniform fell within that of a boundary — and the vocoder is not
    # split, so equal codes are equal bytes. A mismatch here would fail, never pass wrongly.
    "tp2": ("--talker.tp_size", "2"),
}
# role → stages of each form's processes, as /get_server_info lists them
TABLES = {
    "one": {"main": ["preprocess", "talker", "vocoder"]},
    "split": {"main": [], "pre": ["preprocess"], "talker": ["talker"], "vocoder": ["vocoder"]},
    "colocated": {"main": ["preprocess"], "talker": ["talker"], "vocoder": ["vocoder"]},
    "fused": {"main": ["preprocess"], "engine": ["talker", "vocoder"]},
    "vocoders2": {"main": ["preprocess", "talker"], "voc-r0": ["vocoder"],
                  "voc-r1": ["vocoder"]},
    "tp2": {"main": ["preprocess", "vocoder"], "talker-tp0": ["talker"],
            "talker-tp1": ["talker"]},
}


def health(url: str) -> int | None:
    """/health's status; None once nothing answers (the replica has exited)."""
    try:
        return get(url + "/health", timeout=1.0)[0]
    except OSError:
        return None


def synthesize_all(url: str) -> list[bytes]:
    bodies = [{**body, "response_format": "pcm", "stream": False} for body in REQUESTS]
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(lambda body: post_json(url + SPEECH, body), bodies))
    assert [status for status, _, _ in answers] == [200] * len(bodies), answers
    return [pcm for _, _, pcm in answers]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Form ①'s audio: every stage in one process, the behaviour before placements."""
    from support.replica import Replica

    replica = Replica(tmp_path_factory.mktemp("one") / "replica.log", *CPU).wait_ready()
    try:
        table = {row["role"]: row["stages"] for row in replica.info()["processes"]}
        assert table == TABLES["one"]
        yield synthesize_all(replica.url)
    finally:
        replica.stop()


def stopped_by_the_front(replica, pids: list[int]) -> None:
    """SIGTERM to the front alone: exit 0, its stage processes gone."""
    assert replica.stop() == 0
    wait_for("every stage process gone", lambda: not any(map(psutil.pid_exists, pids)), 10)


def drained_by_sigterm_to_every_process(replica, pids: list[int]) -> None:
    """As the launcher's stop (and a terminal's Ctrl-C) do: the signal reaches the whole
    process group. The stage processes leave it to the front, which drains: the request in
    flight finishes whole, exit 0."""
    body = {"input": "Cut me off.", "seed": 82, "max_new_tokens": 150, "stream": False,
            "response_format": "pcm"}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(post_json, replica.url + SPEECH, body)
        wait_for("the request running", lambda: replica.metric(
            "omni_dp_requests_running", 0) == 1, 30, 0.01)
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        status, _, pcm = answer.result(60)
    assert status == 200 and len(pcm) == 150 * 960 * 2  # every token spoken: drained
    assert replica.proc.wait(30) == 0
    wait_for("every stage process gone", lambda: not any(map(psutil.pid_exists, pids)), 10)


def killed_with_minus_9(replica, pids: list[int]) -> None:
    """The front killed with -9: PR_SET_PDEATHSIG takes its stage processes along (nobody has
    to find them)."""
    os.kill(replica.pid, signal.SIGKILL)
    replica.proc.wait(10)
    wait_for("the stage processes gone", lambda: not any(map(psutil.pid_exists, pids)), 10)


# How each form's replica ends once its bytes are compared: the launcher's stop for most; the
# signal to every process and the -9 to the front each on a form with stage processes too (one
# replica serves both checks: a start of several processes fewer each).
ENDINGS = {"split": drained_by_sigterm_to_every_process, "vocoders2": killed_with_minus_9}


@pytest.mark.slow
@pytest.mark.parametrize("form", list(FORMS))
def test_every_form_speaks_the_same_bytes_and_ends_cleanly(start_replica, reference, form):
    replica = start_replica(*CPU, *FORMS[form])
    rows = replica.info()["processes"]
    assert {row["role"]: row["stages"] for row in rows} == TABLES[form]
    pids = [row["pid"] for row in rows]
    assert pids[0] == replica.pid and len(set(pids)) == len(pids)
    # Every stage process is the replica's child, in its session (the launcher finds them).
    assert {p.pid for p in psutil.Process(replica.pid).children()} == set(pids[1:])
    assert synthesize_all(replica.url) == reference
    ENDINGS.get(form, stopped_by_the_front)(replica, pids)


@pytest.mark.slow
def test_a_killed_stage_process_fails_the_replica_at_once(start_replica):
    replica = start_replica(*CPU, *FORMS["split"])
    talker = next(r["pid"] for r in replica.info()["processes"] if r["role"] == "talker")
    others = [r["pid"] for r in replica.info()["processes"] if r["pid"] != talker]
    # Seed 82 speaks all 1000 tokens of this input (no early end of audio): seconds of work,
    # so the stream is still running at the kill (else this fails with a whole body).
    url = urllib.parse.urlsplit(replica.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    conn.request("POST", SPEECH, json.dumps({"input": "Cut me off.", "seed": 82,
                                              "max_new_tokens": 1000, "response_format": "pcm"}))
    response = conn.getresponse()
    assert response.status == 200
    assert response.read(4096)  # audio is flowing
    killed = time.monotonic()
    os.kill(talker, signal.SIGKILL)
    wait_for("/health not 200", lambda: health(replica.url) != 200, 5, 0.01)
    unhealthy = time.monotonic() - killed
    assert replica.proc.wait(10) == 3  # a stage failure: the supervisor restarts the replica
    print(f"stage kill -9 -> unhealthy in {unhealthy * 1000:.0f} ms, exit 3 in "
          f"{(time.monotonic() - killed) * 1000:.0f} ms")
    assert unhealthy < 1
    with pytest.raises(http.client.IncompleteRead):  # a terminal error, never a short success
        response.read()
    conn.close()
    assert f"stage process talker (pid {talker}) was killed by signal 9" in replica.log_text()
    wait_for("the other processes gone", lambda: not any(map(psutil.pid_exists, others)), 10)


@pytest.mark.slow
def test_a_signal_while_the_stages_start_stops_at_once(start_replica):
    """SIGTERM before the stage processes are up: the front kills them while they build (they
    hold no request) instead of waiting for them to come up first, and exits 0."""
    replica = start_replica(*CPU, *FORMS["split"], ready=False)
    wait_for("the stage processes started", lambda: replica.log_text().count(
        "starting") >= 3 and "stage process vocoder (pid" in replica.log_text(), 60, 0.01)
    pids = [p.pid for p in psutil.Process(replica.pid).children()]
    replica.proc.send_signal(signal.SIGTERM)
    assert replica.proc.wait(30) == 0
    log = replica.log_text()
    # Killed while they built: none of them ever said it serves (it takes them ~1.5 s here).
    assert ": talker on cpu" not in log and ": vocoder on cpu" not in log, log
    assert "never retrieved" not in log and "Traceback" not in log, log
    wait_for("every stage process gone", lambda: not any(map(psutil.pid_exists, pids)), 10)
