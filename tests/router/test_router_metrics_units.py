"""The router's metrics without a router: the multiprocess replica series and the guards
around sharing them between workers."""

from __future__ import annotations

import multiprocessing

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from omni_dp.router import workers
from omni_dp.router.config import RouterConfig
from omni_dp.router.metrics import MULTIPROC_ENV, RouterMetrics, _SharedReplicaMetrics
from omni_dp.router.replicas import Replica


def counted(registry: CollectorRegistry, series: str, rid: str) -> float:
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith(f'{series}{{replica="{rid}"}}'):
            return float(line.split()[-1])
    raise AssertionError(f"no {series} series for {rid}")


@pytest.mark.parametrize("count, series", [
    ("num_ejections", "omni_dp_router_ejections_total"),
    ("num_hangs", "omni_dp_router_hangs_total"),
])
@pytest.mark.parametrize("written_between", [True, False],
                         ids=["written-while-removed", "removed-and-added-between-writes"])
def test_a_replica_added_again_has_its_ejections_and_hangs_counted_from_its_first(
        count, series, written_between):
    """A replica removed and added again under its id is a new record, counting from 0: its
    ejections and hangs must add to the series at once, not only once they pass the old
    record's; also when both happened between two writes (a worker writes once a second, or
    at a scrape)."""
    registry = CollectorRegistry()
    current: list[Replica] = [Replica("0", "http://127.0.0.1:1")]
    shared = _SharedReplicaMetrics(lambda: current, registry)
    setattr(current[0], count, 3)
    shared.write()
    current.clear()
    if written_between:
        shared.write()  # removed
    current.append(Replica("0", "http://127.0.0.1:1"))
    setattr(current[0], count, 1)
    shared.write()
    assert counted(registry, series, "0") == 4


def test_shared_metrics_without_the_environment_are_refused(monkeypatch, tmp_path):
    monkeypatch.delenv(MULTIPROC_ENV, raising=False)
    with pytest.raises(ValueError, match=MULTIPROC_ENV):
        RouterMetrics(lambda: [], multiprocess_dir=str(tmp_path))


def test_a_worker_that_cannot_start_leaves_no_metrics_directory(monkeypatch, tmp_path):
    class Refused:
        def __init__(self, *args, **kwargs) -> None: ...

        def start(self) -> None:
            raise OSError("no more processes")

    class Context:
        Pipe = staticmethod(multiprocessing.Pipe)
        Process = Refused

    monkeypatch.setattr(workers.multiprocessing, "get_context", lambda kind: Context())
    monkeypatch.setattr(workers.tempfile, "tempdir", str(tmp_path))
    config = RouterConfig(workers=2)
    with pytest.raises(OSError, match="no more processes"):
        workers._run_children(config, 1.0)
    assert list(tmp_path.iterdir()) == []
