"""The pyzmq links between stage processes, on real ipc sockets (engine/links.py)."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import zmq

from omni_dp.engine.links import IPC_PATH_MAX, Inbox, Outbox, endpoint, socket_dir
from omni_dp.engine.wire import WireError, register


@register(tag="test_links.Seq")
@dataclass(frozen=True)
class Seq:
    sender: str
    n: int


@register(tag="test_links.TensorMsg")
@dataclass(frozen=True)
class TensorMsg:
    name: str
    tensor: torch.Tensor
    pcm: bytes


@pytest.fixture
def directory() -> Iterator[Path]:
    path = socket_dir()
    yield path
    shutil.rmtree(path)


@pytest.fixture
def inbox(directory: Path) -> Iterator[Inbox]:
    with Inbox(endpoint(directory, "main")) as box:
        yield box


@pytest.fixture
def outbox() -> Iterator[Outbox]:
    box = Outbox()
    yield box
    box.close_all()


def receive(inbox: Inbox, count: int) -> list:
    got = []
    for _ in range(count):
        message = inbox.recv(timeout_s=5)
        assert message is not None, f"only {len(got)} of {count} messages came"
        got.append(message)
    return got


def test_socket_dir_is_private(directory: Path) -> None:
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert directory.name.startswith("omni-dp-stages-")


def test_endpoint_and_its_limits(directory: Path) -> None:
    assert endpoint(directory, "talker") == f"ipc://{directory}/talker.sock"
    long = "x" * (IPC_PATH_MAX - len(f"{directory}/.sock"))
    assert len(endpoint(directory, long)) == len("ipc://") + IPC_PATH_MAX
    with pytest.raises(ValueError, match="at most 107 bytes on Linux"):
        endpoint(directory, long + "x")
    for bad in ("", "a/b"):
        with pytest.raises(ValueError, match="not usable"):
            endpoint(directory, bad)


def test_one_sender_keeps_its_order(inbox: Inbox, outbox: Outbox) -> None:
    for n in range(1000):
        outbox.send(inbox.endpoint, Seq("a", n))
    assert [m.n for m in receive(inbox, 1000)] == list(range(1000))
    assert inbox.recv(timeout_s=0) is None


def test_each_thread_keeps_its_own_order(inbox: Inbox, outbox: Outbox) -> None:
    def send(name: str) -> None:
        for n in range(500):
            outbox.send(inbox.endpoint, Seq(name, n))
        outbox.close()  # this thread's socket; what it queued is still delivered

    threads = [threading.Thread(target=send, args=(name,)) for name in ("t1", "t2")]
    for thread in threads:
        thread.start()
    got = receive(inbox, 1000)
    for thread in threads:
        thread.join(5)
    for name in ("t1", "t2"):
        assert [m.n for m in got if m.sender == name] == list(range(500))


def test_messages_sent_before_the_inbox_binds_are_delivered(directory: Path,
                                                           outbox: Outbox) -> None:
    where = endpoint(directory, "late")
    outbox.send(where, Seq("early", 1))
    with Inbox(where) as late:
        assert receive(late, 1) == [Seq("early", 1)]


def test_recv_times_out_with_none(inbox: Inbox) -> None:
    start = time.monotonic()
    assert inbox.recv(timeout_s=0.1) is None
    assert 0.09 <= time.monotonic() - start < 1.0


def test_a_live_endpoint_is_not_taken_over_and_close_removes_the_file(
        directory: Path, inbox: Inbox) -> None:
    with pytest.raises(ValueError, match="already bound by a live process"):
        Inbox(inbox.endpoint)
    path = directory / "main.sock"
    assert path.exists()
    inbox.close()
    assert not path.exists()
    with pytest.raises(RuntimeError, match="closed"):
        inbox.recv(0)


def test_a_stale_socket_file_is_replaced(directory: Path, outbox: Outbox) -> None:
    where = endpoint(directory, "stale")
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(directory / "stale.sock"))  # as a crashed process leaves it: nobody listens
    dead.close()
    with Inbox(where) as again:
        outbox.send(where, Seq("s", 0))
        assert receive(again, 1) == [Seq("s", 0)]


def test_bad_messages_fail_before_sending(inbox: Inbox, outbox: Outbox) -> None:
    with pytest.raises(WireError, match="cannot encode type object"):
        outbox.send(inbox.endpoint, Seq("x", object()))  # type: ignore[arg-type]
    outbox.close_all()
    with pytest.raises(RuntimeError, match="Outbox is closed"):
        outbox.send(inbox.endpoint, Seq("x", 1))


def test_frames_that_are_no_message_raise_and_the_next_recv_goes_on(inbox: Inbox,
                                                                    outbox: Outbox) -> None:
    raw = zmq.Context.instance().socket(zmq.PUSH)
    try:
        raw.connect(inbox.endpoint)
        raw.send_multipart([b"\xc1", b"junk"])
        with pytest.raises(WireError, match="not msgpack"):
            inbox.recv(timeout_s=5)
    finally:
        raw.close(linger=0)
    outbox.send(inbox.endpoint, Seq("ok", 1))
    assert receive(inbox, 1) == [Seq("ok", 1)]


def test_received_tensor_is_a_view_of_its_frame(inbox: Inbox, outbox: Outbox) -> None:
    t = torch.randn(512, 512)  # 1 MiB: above pyzmq's copy threshold on both ends
    outbox.send(inbox.endpoint, TensorMsg("big", t, b"\x01" * 4096))
    (got,) = receive(inbox, 1)
    assert torch.equal(got.tensor, t) and got.pcm == b"\x01" * 4096
    got.tensor[0, 0] = 1.0  # writable: a zmq frame, not a copy into read-only bytes


CHILD = textwrap.dedent("""
    import sys
    from dataclasses import dataclass

    import torch
    import zmq

    from omni_dp.engine.links import Outbox
    from omni_dp.engine.wire import register

    @register(tag="test_links.TensorMsg")
    @dataclass(frozen=True)
    class TensorMsg:
        name: str
        tensor: torch.Tensor
        pcm: bytes

    outbox = Outbox()
    t = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4).to(torch.bfloat16)
    outbox.send(sys.argv[1], TensorMsg("child", t, bytes(range(256)) * 8))
    outbox.close_all()
    zmq.Context.instance().term()  # waits until the message is out (or the linger passed)
""")


def test_a_tensor_crosses_processes(inbox: Inbox) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    subprocess.run([sys.executable, "-c", CHILD, inbox.endpoint], check=True, timeout=60,
                   env=env)  # the child has exited: what it sent was flushed before
    got = inbox.recv(timeout_s=5)
    assert isinstance(got, TensorMsg) and got.name == "child"
    expected = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4).to(torch.bfloat16)
    assert got.tensor.dtype == torch.bfloat16 and torch.equal(got.tensor, expected)
    assert got.pcm == bytes(range(256)) * 8
