"""A process's memory budget against what it holds, before its KV pool (engine/budget.py).

No GPU: the measurement is a fake `Held`, the device an object whose `.type` is "cuda"."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from omni_dp.engine.budget import (
    FREE_MEMORY_MARGIN_BYTES,
    BudgetExceeded,
    Held,
    check_before_pool,
    check_pool,
)
from omni_dp.sizes import GiB

MiB = 1024**2
CUDA = SimpleNamespace(type="cuda", index=0)
CPU = SimpleNamespace(type="cpu", index=None)
WHY = "NVML does not list this process"


def must_not_measure(device):
    raise AssertionError(f"measured {device} where nothing should be measured")


# --- check_pool -------------------------------------------------------------------------------
def test_a_pool_that_fits_says_nvml_and_the_sizes():
    message = check_pool("talker", 8 * GiB, 3 * GiB, Held(2 * GiB, 70 * GiB))
    assert message == ("process talker: holds 2.00 GiB (NVML) + KV 3.00 GiB within its budget "
                       "of 8.00 GiB")


def test_a_pool_that_fills_the_budget_to_the_byte_fits():
    check_pool("talker", 8 * GiB, 6 * GiB, Held(2 * GiB, 70 * GiB))
    with pytest.raises(BudgetExceeded):
        check_pool("talker", 8 * GiB, 6 * GiB + 1, Held(2 * GiB, 70 * GiB))


def test_a_pool_over_the_budget_names_the_process_budget_held_and_the_fix():
    with pytest.raises(BudgetExceeded) as caught:
        check_pool("talker", 8 * GiB, 7 * GiB, Held(2 * GiB, 70 * GiB))
    assert str(caught.value) == (
        "process talker: its budget is 8.00 GiB and it holds 2.00 GiB after loading (NVML), "
        "which leaves 6.00 GiB for a KV pool of 7.00 GiB; raise its stages' "
        "gpu_memory_fraction or lower --max-total-tokens")


def test_a_process_already_over_its_budget_leaves_nothing_not_a_negative_size():
    with pytest.raises(BudgetExceeded, match=r"which leaves 0 B for a KV pool of 1\.00 GiB"):
        check_pool("engine", 2 * GiB, GiB, Held(3 * GiB, 70 * GiB))


def test_without_per_process_accounting_the_pool_is_checked_against_free_memory():
    free = 10 * GiB
    room = free - FREE_MEMORY_MARGIN_BYTES
    message = check_pool("talker", 16 * GiB, room, Held(None, free, WHY))
    assert message == (
        f"process talker: per-process accounting is unavailable ({WHY}); checked the KV pool "
        "of 9.75 GiB against free memory (10.00 GiB) instead of its budget")


def test_without_per_process_accounting_a_pool_over_free_memory_is_refused():
    free = 10 * GiB
    with pytest.raises(BudgetExceeded) as caught:
        check_pool("talker", 8 * GiB, free - FREE_MEMORY_MARGIN_BYTES + 1,
                   Held(None, free, "NVML is not available"))
    assert str(caught.value) == (
        "process talker: per-process accounting is unavailable (NVML is not available) and free "
        "memory (10.00 GiB) cannot take a KV pool of 9.75 GiB plus 256.00 MiB of margin")


# --- check_before_pool ------------------------------------------------------------------------
def test_nothing_is_measured_on_the_cpu_or_without_a_budget(caplog):
    caplog.set_level(logging.DEBUG)
    check_before_pool("talker", 8 * GiB, 100 * GiB, CPU, measure=must_not_measure)
    check_before_pool("talker", None, 100 * GiB, CUDA, measure=must_not_measure)
    check_before_pool("talker", 8 * GiB, 100 * GiB, object(), measure=must_not_measure)
    assert caplog.records == []


def test_a_measured_fit_is_logged_at_info(caplog):
    seen = []

    def measure(device):
        seen.append(device)
        return Held(GiB, 60 * GiB)

    caplog.set_level(logging.INFO, logger="omni_dp.serve")
    check_before_pool("talker", 4 * GiB, 2 * GiB, CUDA, measure=measure)
    assert seen == [CUDA]
    [record] = caplog.records
    assert (record.name, record.levelno) == ("omni_dp.serve", logging.INFO)
    assert record.getMessage() == ("memory budget: process talker: holds 1.00 GiB (NVML) + KV "
                                   "2.00 GiB within its budget of 4.00 GiB")


def test_the_free_memory_fallback_is_logged_as_a_warning(caplog):
    caplog.set_level(logging.INFO, logger="omni_dp.serve")
    check_before_pool("vocoder", 4 * GiB, 512 * MiB, CUDA,
                      measure=lambda device: Held(None, 60 * GiB, WHY))
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert "per-process accounting is unavailable (NVML does not list this process)" in (
        record.getMessage())
    assert "instead of its budget" in record.getMessage()


@pytest.mark.parametrize("held", [Held(3 * GiB, 60 * GiB), Held(None, GiB, WHY)])
def test_a_pool_that_does_not_fit_raises_before_anything_is_logged(caplog, held):
    caplog.set_level(logging.INFO, logger="omni_dp.serve")
    with pytest.raises(BudgetExceeded, match="process talker: "):
        check_before_pool("talker", 4 * GiB, 2 * GiB, CUDA, measure=lambda device: held)
    assert caplog.records == []
