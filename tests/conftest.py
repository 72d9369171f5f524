"""Fixtures of the tests in more than one directory: real `omni-dp serve` processes on
loopback (support/replica.py), started and stopped by pid. Each directory's conftest.py holds
the fixtures only its own tests use; plain helpers live in the `support` package."""

from __future__ import annotations

import getpass
import os
import shutil
import signal
import tempfile
from pathlib import Path

import psutil
import pytest

from omni_dp.engine.options import DEFAULT_MODEL_ENV

from support.mps import daemons_under
from support.order import longest_first
from support.replica import Replica

# `omni-dp serve`'s default model is the trained voice where it is installed; the tests of the
# seeded engine rely on the preset `tiny` (deterministic, resumable, KV-sized), so every server
# a test starts without --model serves tiny. The voice's tests name it (tests/test_voice_run.py).
os.environ.setdefault(DEFAULT_MODEL_ENV, "tiny")

# The session's own temporary directory, fresh (/tmp/odp-suite-PID-XXXXXXXX): every test, and every
# process it starts, makes its temporary files there (TMPDIR, tempfile.tempdir), and the default
# run state directory lies there too (rundir.py's ${XDG_RUNTIME_DIR:-/tmp}/omni-dp-UID). Other
# processes on the machine use /tmp as they like: what is in this directory is this session's
# alone, and at the end nothing may be (nothing_left_in_tmp). Short, for the Unix sockets made
# under it (108 bytes a path). pytest's tmp_path stays where it was, under pytest's retention.
# Not covered: a path named outright (tempfile.mkdtemp(dir="/tmp") in tests/launcher/conftest.py
# and tests/mps/test_mps_control_terminate.py, for short socket paths; each removes its own).
SUITE_TMP_PREFIX = "odp-suite-"
_SUITE_TMP_ENV = ("TMPDIR", "XDG_RUNTIME_DIR")
# What libraries make there once per user or machine (in /tmp otherwise), not a test's leftover:
LIBRARY_FILES = {
    ".ses": "onnxruntime's telemetry SDK writes its session file in TMPDIR on import",
    "pulse": "libpulse's runtime directory, made under XDG_RUNTIME_DIR by espeak-ng's audio",
    f"torchinductor_{getpass.getuser()}": "torch's cache directory (torch.distributed makes it)",
}
_suite_tmp: dict = {}


# The machine's own temporary directory, as the first pytest process found it: the workers of
# pytest-xdist inherit the controller's TMPDIR (its suite directory), and must make theirs beside
# it, not in it (a deeper path leaves less of a Unix socket's 108 bytes to the tests).
_SYSTEM_TMP_ENV = "OMNI_DP_TEST_SYSTEM_TMP"


def pytest_configure(config):
    system = os.environ.setdefault(_SYSTEM_TMP_ENV, tempfile.gettempdir())
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", system)  # tmp_path: where it always was
    sweep_dead_sessions(Path(system))
    suite = tempfile.mkdtemp(prefix=f"{SUITE_TMP_PREFIX}{os.getpid()}-", dir=system)
    _suite_tmp.update(path=Path(suite), env={k: os.environ.get(k) for k in _SUITE_TMP_ENV},
                      tempdir=tempfile.tempdir)
    os.environ.update(dict.fromkeys(_SUITE_TMP_ENV, suite))
    tempfile.tempdir = suite


def pytest_collection_modifyitems(session, config, items):
    items[:] = longest_first(items)  # the longest files start first: support/order.py


def sweep_dead_sessions(root: Path) -> None:
    """A session killed before its end (SIGKILL; `timeout`'s SIGTERM, which pytest does not
    catch) leaves its directory: removed by the next session, once its pytest (the pid in its
    name) is gone. A directory of a live pid, or another user's, is left alone."""
    for path in root.glob(f"{SUITE_TMP_PREFIX}*-*"):
        pid = path.name.removeprefix(SUITE_TMP_PREFIX).partition("-")[0]
        try:
            mine = path.lstat().st_uid == os.getuid()
        except OSError:
            continue
        if pid.isdigit() and mine and not _running(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:  # not ours to read: alive, for all we know
        return True


def pytest_unconfigure(config):
    if not _suite_tmp:
        return
    shutil.rmtree(_suite_tmp["path"], ignore_errors=True)
    for name, value in _suite_tmp["env"].items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    tempfile.tempdir = _suite_tmp["tempdir"]
    _suite_tmp.clear()


def left_in(directory: Path) -> list[str]:
    """Each entry of `directory`; a directory's with (the first few of) the files in it."""
    left = []
    for entry in sorted(directory.iterdir()):
        files = sorted(str(p.relative_to(entry)) for p in entry.rglob("*") if not p.is_dir()) \
            if entry.is_dir() and not entry.is_symlink() else None
        if files is None:
            left.append(entry.name)
        else:
            more = f" and {len(files) - 5} more" if len(files) > 5 else ""
            left.append(f"{entry.name}/ ({', '.join(files[:5]) or 'empty'}{more})")
    return left


@pytest.fixture(scope="session", autouse=True)
def nothing_left_in_tmp():
    """The session's temporary directory is empty once every other fixture is torn down (set
    up first, torn down last): a test that leaves a file or a directory in TMPDIR — or a
    bench, a server or a run it started — fails the session (an error at teardown, so pytest
    exits 1), naming what was left, which is then removed."""
    yield
    suite = _suite_tmp.get("path")
    if suite is None or not suite.is_dir():
        return
    left = [entry for entry in left_in(suite) if entry.split("/")[0] not in LIBRARY_FILES]
    for entry in suite.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    if left:
        pytest.fail(f"the tests left {len(left)} thing(s) in the session's temporary directory "
                    f"{suite} (TMPDIR), now removed: {'; '.join(left)}", pytrace=False)


@pytest.fixture(autouse=True)
def no_mps_daemon_left_behind(request):
    """A test that starts a real MPS control daemon in its tmp_path must stop it: one that
    failed before its cleanup once left three running. Set up first, so this runs after
    every other fixture's teardown; a leaked daemon is stopped here and fails the test."""
    yield
    tmp_path = request.node.funcargs.get("tmp_path")
    if tmp_path is None:
        return
    leaked = daemons_under(tmp_path)
    _, alive = psutil.wait_procs(leaked, timeout=3)  # one that was told to quit may be exiting
    for process in alive:
        process.kill()
    assert not alive, (f"the test left MPS control daemon(s) {[p.pid for p in alive]} running "
                       "(now killed)")


@pytest.fixture
def start_replica(tmp_path):
    """Start replicas with given serve flags; every one is stopped by pid at teardown, and the
    stage sockets' directory of one killed with -9 (it cleans nothing up; the next replica of
    this user would sweep it) is swept then."""
    started: list[Replica] = []

    def start(*args: str, ready: bool = True) -> Replica:
        replica = Replica(tmp_path / f"replica_{len(started)}.log", *args)
        started.append(replica)
        return replica.wait_ready() if ready else replica

    yield start
    for replica in started:
        replica.stop(signal.SIGKILL if replica.proc.poll() is None else signal.SIGTERM)
    from omni_dp.engine.stage_group import sweep_stale_socket_dirs

    sweep_stale_socket_dirs(Path(tempfile.gettempdir()))


@pytest.fixture(scope="session")
def replica(tmp_path_factory):
    """A default tiny CPU replica shared by the tests that only send requests."""
    replica = Replica(tmp_path_factory.mktemp("shared") / "replica.log").wait_ready()
    yield replica
    replica.stop()
