"""The per-unit statistics on the workers of a real ``dask.distributed`` cluster (``--workers``).

After the Gram pass, conflict, oscillation and drift run their per-unit function
through :func:`~gradforensics.analysis.toolkit.parallel.map_units`; under a client it
ships the units, in batches sized by their Gram matrices' bytes, to the workers. Shown
here on a real ``LocalCluster`` of two worker processes (no mocks):

* the tables and flags are the threads' within float64 rounding (:data:`_findings.RTOL`:
  the same Gram matrices, the same per-unit functions), from Python (with the Gram
  matrices spilled to files, so the units are read from memory maps and shipped as
  arrays) and from ``gradforensics analyze --workers 2`` (its CSV tables and
  ``flags.json``), and the per-unit tasks ran on the workers (the scheduler saw them);
* results come back in the units' order, batches respect their byte and unit caps;
* a worker that dies is one :class:`~gradforensics.errors.WorkerLostError` line naming
  the units and what to do; an error the function raises arrives as it was raised.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pytest
from _findings import RTOL, close_findings, close_values

distributed = pytest.importorskip("distributed")

import dask  # noqa: E402

import gradforensics as gf  # noqa: E402
from gradforensics.analysis.toolkit import parallel  # noqa: E402
from gradforensics.analysis.toolkit.parallel import BATCH_BYTES, BATCH_UNITS, map_units, unit_threads  # noqa: E402
from gradforensics.cli import main  # noqa: E402
from gradforensics.errors import SpecError, WorkerLostError  # noqa: E402
from gradforensics.testing.planted_directions import planted_conflict, q_name  # noqa: E402

ONLY = "conflict,oscillation,drift,noise,nonfinite"


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("workers") / "conflict.zarr")
    planted_conflict(n=64, n_layers=3).write(path)     # 3 layers x (q in 4 heads + mlp): 18 units
    return path


@pytest.fixture(scope="module")
def client():
    # a worker that dies fails its task at once (the default reruns it 3 times elsewhere);
    # the scheduler of a LocalCluster runs in this process, so the setting reaches it
    with dask.config.set({"distributed.scheduler.allowed-failures": 0}), \
            distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                     dashboard_address=None) as cluster, distributed.Client(cluster) as c:
        yield c


@pytest.mark.slow
def test_per_unit_statistics_on_the_workers_are_the_threads(planted, client) -> None:
    opts = {"engine": {"persist": False}}
    threads = gf.analyze(planted, only=ONLY, progress=False, options=opts)
    spilled = gf.analyze(planted, only=ONLY, progress=False, client=client,
                         options={"engine": {"persist": False, "spill": True, "unit_statistics": "workers"}})
    assert spilled.header["scheduler"] == "distributed"
    close_findings(spilled, threads)
    prefixes = client.run_on_scheduler(lambda dask_scheduler: sorted(dask_scheduler.task_prefixes))
    assert "run_batch" in prefixes               # the per-unit statistics ran as tasks on the workers
    sick = {(f.tensor, f.head) for f in threads.flags if f.kind == "conflict" and f.severity >= 0.5}
    assert {(q_name(1), 1), (q_name(1), 2)} <= sick     # the planted trouble is what both found


@pytest.mark.slow
def test_units_go_to_local_workers_only_when_they_add_cores_or_are_told(client) -> None:
    from gradforensics.analysis.engine.options import EngineOptions
    from gradforensics.analysis.engine.schedule import units_client
    from gradforensics.analysis.toolkit.parallel import available_cores, workers_add_cores

    adds = available_cores() < 2                 # two one-thread workers on this host
    assert workers_add_cores(client) is adds
    assert (units_client(EngineOptions(), client) is client) is adds
    assert units_client(EngineOptions(unit_statistics="workers"), client) is client
    assert units_client(EngineOptions(unit_statistics="client"), client) is None
    assert units_client(EngineOptions(unit_statistics="workers"), None) is None
    with pytest.raises(SpecError, match="unit_statistics must be one of"):
        EngineOptions(unit_statistics="gpu")


@pytest.mark.slow
def test_analyze_workers_2_writes_the_threads_tables_and_flags(planted, tmp_path) -> None:
    outs = {}
    for label, extra in (("threads", []), ("workers", ["--workers", "2"])):
        out = tmp_path / label
        assert main(["analyze", planted, "--out", str(out), "--only", ONLY, "--quiet", *extra]) == 0
        outs[label] = {p: pd.read_csv(out / "tables" / p) for p in sorted(os.listdir(out / "tables"))}
        outs[label]["flags.json"] = json.loads((out / "flags.json").read_text())
    assert set(outs["threads"]) >= {"conflict.csv", "oscillation.csv", "drift.csv", "flags.json"}
    assert sorted(outs["workers"]) == sorted(outs["threads"])
    for name, want in outs["threads"].items():
        got = outs["workers"][name]
        if name == "flags.json":
            close_values(got, want, name, RTOL, 1e-4)          # severities saved to 4 decimals
        else:
            pd.testing.assert_frame_equal(got, want, check_exact=False, rtol=RTOL, obj=name)


@dataclass(frozen=True)
class _Item:
    i: int
    gram: np.ndarray


def _square(x: _Item) -> tuple[int, float]:
    return x.i, float(np.sum(x.gram @ x.gram))


def test_batches_keep_order_and_their_caps() -> None:
    side = 256                                   # 512 KiB a unit: the byte cap binds before the unit cap
    items = [_Item(i, np.full((side, side), float(i))) for i in range(40)]
    batches = list(parallel.worker_batches(items))
    assert [x.i for _, b in batches for x in b] == list(range(40))
    assert [s for s, _ in batches] == [sum(len(b) for _, b in batches[:k]) for k in range(len(batches))]
    assert all(sum(x.gram.nbytes for x in b) <= BATCH_BYTES for _, b in batches)
    assert len(batches[0][1]) == BATCH_BYTES // (side * side * 8)
    small = [_Item(i, np.zeros((2, 2))) for i in range(100)]
    assert [len(b) for _, b in parallel.worker_batches(small)] == [BATCH_UNITS] * 3 + [100 - 3 * BATCH_UNITS]
    huge = [_Item(0, np.zeros((1100, 1100)))]                       # larger than a batch: a batch of its own
    assert [len(b) for _, b in parallel.worker_batches(huge + small[:3])] == [1, 3]


@pytest.mark.slow
def test_map_units_on_a_client_in_order_and_its_errors(client) -> None:
    items = [_Item(i, np.random.default_rng(i).standard_normal((64, 64))) for i in range(150)]
    with unit_threads(2, client):
        on_workers = map_units(_square, items)
    assert on_workers == [_square(x) for x in items]                 # one function on one input: equal, in order
    with unit_threads(2, client), pytest.raises(SpecError, match=r"^unit 77 is malformed$"):
        map_units(functools.partial(_fail_at, 77), items)
    with unit_threads(2, client), pytest.raises(WorkerLostError) as exc:
        map_units(os._exit, [3])                 # the worker process exits: as if killed for memory
    line = str(exc.value)
    assert "\n" not in line and "a dask worker died running the per-unit statistics of 3" in line
    assert "more memory" in line and "threads" in line and "1 attempts, the last on tcp://" in line
    client.wait_for_workers(2, timeout=60)       # the nanny restarted it
    with unit_threads(2, client):
        assert map_units(_square, items[:5]) == [_square(x) for x in items[:5]]


def _fail_at(bad: int, x: _Item) -> int:
    if x.i == bad:
        raise SpecError(f"unit {bad} is malformed")
    return x.i


@pytest.mark.slow
def test_a_worker_dying_in_the_gram_pass_is_one_line(client) -> None:
    import dask

    from gradforensics.analysis.engine.schedule import compute_collections

    with pytest.raises(WorkerLostError) as exc:
        compute_collections([dask.delayed(os._exit)(3)], client, False, None)     # a task of the pass whose worker exits
    line = str(exc.value)
    assert "\n" not in line and "a dask worker died running the Gram pass" in line and "more memory" in line
    client.wait_for_workers(2, timeout=60)
