"""Process identity survives a step of the wall clock.

A CI machine's clock stepped during a run; psutil's create_time() (start after boot + the boot
time the kernel derives from the wall clock) then read differently than when it was recorded,
and three tests saw live replicas as dead. These tests step psutil's boot time instead.
"""

from __future__ import annotations

import shutil
import subprocess
import time

import psutil
import pytest

from omni_dp.procs import EPOCH_FLOOR, ProcessIdentity, identify, is_alive, start_of


@pytest.fixture
def sleeper(tmp_path):
    # A name with ") " in it: /proc/<pid>/stat puts the name in parentheses, unescaped.
    binary = tmp_path / "a) b (c"
    shutil.copy(shutil.which("sleep"), binary)
    proc = subprocess.Popen([str(binary), "60"], stdin=subprocess.DEVNULL)
    yield proc
    proc.kill()
    proc.wait()


@pytest.fixture
def clock_step(monkeypatch):
    """The wall clock (so the boot time psutil reads) stepped forward 7 s from now on."""
    import psutil._pslinux as linux

    real = linux.boot_time

    def step() -> None:
        monkeypatch.setattr(linux, "boot_time", lambda: real() + 7.0)
    return step


def test_a_process_recorded_before_a_clock_step_is_still_itself(sleeper, clock_step):
    recorded = identify(sleeper.pid)
    assert recorded is not None and recorded.create_time < EPOCH_FLOOR
    clock_step()
    assert is_alive(recorded)
    assert identify(sleeper.pid) == recorded  # the same record, read again after the step


def test_the_start_is_the_kernels_count_after_boot(sleeper):
    uptime = time.clock_gettime(time.CLOCK_BOOTTIME)
    started = start_of(sleeper.pid)
    assert started is not None and 0 < started <= uptime
    assert started == pytest.approx(psutil.Process(sleeper.pid).create_time()
                                    - psutil.boot_time(), abs=1.5)


def test_another_start_or_a_dead_or_zombie_process_is_not_the_recorded_one(sleeper):
    recorded = identify(sleeper.pid)
    assert not is_alive(ProcessIdentity(sleeper.pid, recorded.create_time + 0.01))
    sleeper.kill()
    time.sleep(0.2)  # a zombie until waited for
    assert psutil.Process(sleeper.pid).status() == psutil.STATUS_ZOMBIE
    assert not is_alive(recorded)
    sleeper.wait()
    assert not is_alive(recorded)
    assert identify(sleeper.pid) is None and start_of(sleeper.pid) is None


def test_a_record_written_with_psutils_epoch_time_is_still_read(sleeper, clock_step):
    """Records written before omni-dp read starttime hold seconds since the epoch; compared to
    the second, a clock step of more than that makes them stale (as they always were)."""
    epoch = ProcessIdentity(sleeper.pid, psutil.Process(sleeper.pid).create_time())
    assert epoch.create_time > EPOCH_FLOOR
    assert is_alive(epoch)
    assert not is_alive(ProcessIdentity(sleeper.pid, epoch.create_time - 60))
    clock_step()
    assert not is_alive(epoch)
