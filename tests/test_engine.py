"""The engine: one compute per pass, every gradient byte read once, the same answer on a
process LocalCluster for both backends, persisted findings, option checking, the CLI."""

from __future__ import annotations

import json

import dask
import numpy as np
import pandas as pd
import pytest

import gradforensics as gf
from gradforensics.analysis.contract.model import Findings
from gradforensics.analysis.engine.options import EngineOptions, select_analyses
from gradforensics.analysis.engine.results import load_grams, read_findings
from gradforensics.analysis.engine.run import analyze
from gradforensics.cli import main
from gradforensics.errors import EmptyStoreError, GradforensicsError, SpecError
from gradforensics.store import handles
from gradforensics.store.backends import ArrayHandle
from gradforensics.store.reader import Store
from gradforensics.store.schema import new_meta
from gradforensics.store.writer import StoreWriter
from gradforensics.testing.planted import healthy_store, nonfinite_store

ONLY = ("noise", "nonfinite")


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    d = tmp_path_factory.mktemp("engine")
    return {s: nonfinite_store(d / f"nf{s}", 3, n_records=24, head=1, tensor="layers.0.attn.q.weight",
                               weights_every=None, activations=False)
            for s in (".zarr", ".h5")}


def _graph(dsk):
    """The task mapping a scheduler ``get`` receives (a dict, or an expression holding one)."""
    return dsk.__dask_graph__() if hasattr(dsk, "__dask_graph__") else dsk


def _tables_equal(a: Findings, b: Findings, rtol: float = 1e-9) -> None:
    assert set(a.results) == set(b.results)
    for name in a.results:
        pd.testing.assert_frame_equal(a.table(name), b.table(name), check_exact=False, rtol=rtol)
    key = lambda f: (f.kind, f.tensor, f.head, f.sources, f.records, round(f.severity, 3))  # noqa: E731
    assert [key(f) for f in a.flags] == [key(f) for f in b.flags]


def test_one_compute_and_each_gradient_byte_read_once(stores, monkeypatch) -> None:
    path = stores[".zarr"].path
    calls = []
    read_bytes: dict[str, int] = {}
    original_read = ArrayHandle.read_raw

    def counting_get(dsk, keys, **kwargs):
        calls.append(keys)
        return dask.threaded.get(dsk, keys, **kwargs)

    def counting_read(self, sel):
        out = original_read(self, sel)
        read_bytes[self.name] = read_bytes.get(self.name, 0) + out.nbytes
        return out

    original_many = handles.read_zarr_many

    def counting_many(reads):            # small tensors are read many a task (engine/plan_small.py)
        out = original_many(reads)
        for (_, name, _), x in zip(reads, out, strict=True):
            read_bytes[name] = read_bytes.get(name, 0) + x.nbytes
        return out

    monkeypatch.setattr(ArrayHandle, "read_raw", counting_read)
    monkeypatch.setattr(handles, "read_zarr_many", counting_many)
    with dask.config.set(scheduler=counting_get):
        findings = analyze(path, only=ONLY, progress=False, options={"engine": {"persist": False}})
    assert len(calls) == 1, f"expected one compute, got {len(calls)}"
    store = Store(path)
    grads = {i.name: i.nbytes for i in store.grads.values()}
    assert {k: v for k, v in read_bytes.items() if k.startswith("grads/")} == grads
    assert findings.flags and findings.flags[0].kind == "nonfinite"


@pytest.mark.slow
@pytest.mark.parametrize("slab_bytes", [1 << 16, 128 << 20])
def test_slab_reductions_share_the_single_gradient_read(tmp_path, monkeypatch, slab_bytes) -> None:
    """spectral and precision fold their gradient reductions into the Gram pass: every gradient
    region is read once, every record of it in one task (at 64 KiB slabs too), in one compute,
    with the same tables as when each analysis runs alone."""
    from gradforensics.testing.planted_units import planted_spectral_store

    path = planted_spectral_store(tmp_path / "s.zarr", collapse=True, n_records=16, d=64).path
    only = ("noise", "nonfinite", "spectral", "precision")
    opts = {"engine": {"persist": False, "slab_bytes": slab_bytes}}
    alone = {name: analyze(path, only=[name], progress=False, options=opts) for name in only}
    calls, reads = [], []
    original_read = ArrayHandle.read_raw

    def counting_get(dsk, keys, **kwargs):
        calls.append(keys)
        return dask.threaded.get(dsk, keys, **kwargs)

    def counting_read(self, sel):
        out = original_read(self, sel)
        if self.name.startswith("grads/"):
            reads.append((self.name, tuple((s.start, s.stop) for s in sel), out.nbytes))
        return out

    original_many = handles.read_zarr_many

    def counting_many(many):            # one-slab tensors are read many a task (engine/plan_small.py)
        out = original_many(many)
        for (_, name, sel), x in zip(many, out, strict=True):
            if name.startswith("grads/"):
                reads.append((name, tuple((s.start, s.stop) for s in sel), x.nbytes))
        return out

    monkeypatch.setattr(ArrayHandle, "read_raw", counting_read)
    monkeypatch.setattr(handles, "read_zarr_many", counting_many)
    with dask.config.set(scheduler=counting_get):
        findings = analyze(path, only=only, progress=False, options=opts)
    assert len(calls) == 1, f"expected one compute, got {len(calls)}"
    regions = [(name, sel) for name, sel, _ in reads]
    assert len(regions) == len(set(regions)), "a gradient region was read more than once"
    store = Store(path)
    per_array: dict[str, int] = {}
    for name, _, nbytes in reads:
        per_array[name] = per_array.get(name, 0) + nbytes
    assert per_array == {i.name: i.nbytes for i in store.grads.values()}
    # the record axis is never split here (a chunk no larger than its Gram matrices is read whole; the old
    # assertion that some read was record-split held only through dask's empty meta reads)
    assert all(sel[0] == (0, store.n_records) for _, sel in regions)
    for name in only:
        pd.testing.assert_frame_equal(findings.table(name), alone[name].table(name), check_exact=False, rtol=1e-9)
    assert {"gradient"} <= set(findings.table("spectral")["matrix"])
    assert findings.table("precision")["lost_share"].notna().all()


def test_slab_reduction_keys_must_not_collide_with_lazy(tmp_path) -> None:
    from dataclasses import replace

    from gradforensics.analysis import REGISTRY
    from gradforensics.analysis.engine.run import compute_pass
    from gradforensics.testing.planted_units import planted_spectral_store

    store = Store(planted_spectral_store(tmp_path / "s.zarr", n_records=8, d=32).path)
    spectral = REGISTRY["spectral"]
    clash = replace(spectral, lazy=lambda st: {**spectral.lazy(st), **dict.fromkeys(spectral.slab_reductions(st))})
    with pytest.raises(SpecError, match="both lazy and slab_reductions"):
        compute_pass(store, [clash], EngineOptions(persist=False), None, False)


def test_mixed_collections_keep_their_order() -> None:
    """dask 2026.8 regroups the results of a mixed Array/Delayed compute when it optimizes; the pass must not."""
    import dask.array as da

    from gradforensics.analysis.engine.schedule import compute_collections

    x = da.ones((10, 4), chunks=5)
    d1 = dask.delayed(lambda: "D1")()
    d2 = dask.delayed(list)([dask.delayed(np.sum)(x[0:5].mean(axis=0))])
    a = da.stack([x[0:5].mean(axis=0), x[5:].mean(axis=0)])
    out = compute_collections([d1, a, d2, x.sum()], None, False, None)
    assert [type(v).__name__ for v in out] == ["str", "ndarray", "list", "float64"]


def test_graph_has_few_tasks(stores, monkeypatch) -> None:
    sizes = []

    def counting_get(dsk, keys, **kwargs):
        sizes.append(len(_graph(dsk)))
        return dask.threaded.get(dsk, keys, **kwargs)

    with dask.config.set(scheduler=counting_get):
        analyze(stores[".zarr"].path, only=ONLY, progress=False, options={"engine": {"persist": False}})
    store = Store(stores[".zarr"].path)
    n_arrays_blocks = sum(i.heads or 1 for i in store.grads.values())
    assert sizes[0] <= 3 * n_arrays_blocks + 2 * len(store.grads)


@pytest.mark.slow
def test_local_cluster_processes_both_backends(stores) -> None:
    distributed = pytest.importorskip("distributed")
    opts = {"engine": {"persist": False}}
    local = {suffix: analyze(planted.path, only=ONLY, progress=False, options=opts) for suffix, planted in stores.items()}
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  dashboard_address=":0") as cluster, distributed.Client(cluster) as client:
        for suffix, planted in stores.items():
            on_cluster = analyze(planted.path, client=client, only=ONLY, progress=True, options=opts)
            # the client of the with-block is dask's default one: analyze without a client runs there too,
            # and its header says so (the pass, the per-unit statistics and the header resolve it once)
            by_default = analyze(planted.path, only=ONLY, progress=False, options=opts)
            _tables_equal(on_cluster, local[suffix])
            _tables_equal(by_default, local[suffix])
            assert local[suffix].header["scheduler"] == "threads", suffix
            assert on_cluster.header["scheduler"] == by_default.header["scheduler"] == "distributed", suffix
            assert on_cluster.flags[0].tensor == "layers.0.attn.q.weight"


@pytest.mark.parametrize("suffix", [".zarr", ".h5"])
def test_findings_and_grams_persist(stores, suffix) -> None:
    path = stores[suffix].path
    findings = analyze(path, only=ONLY, options={"engine": {"save_grams": "all"}}, progress=False)
    store = Store(path, check_chunks=False)
    again = read_findings(store)
    assert again.flags_json() == json.loads(json.dumps(findings.flags_json()))
    for name in ONLY:
        pd.testing.assert_frame_equal(again.table(name), findings.table(name), check_dtype=False)
    grams = load_grams(store)
    assert ("layers.0.attn.q.weight", 1) in grams and ("layers.0.attn.q.weight", None) in grams
    assert grams[("layers.0.attn.q.weight", 1)].nonfinite.sum() == 6
    h = findings.header
    assert h["records"] == 24 and set(h["sources"]) == {"a", "b", "c"}
    assert abs(sum(h["sources"].values()) - 1) < 1e-6
    assert {"gradforensics", "numpy", "dask", "zarr", "h5py"} <= set(h["versions"])


def test_context_is_built_once_in_registry_order(stores) -> None:
    names = [a.name for a in select_analyses(None)]
    assert [a.name for a in select_analyses("nonfinite,noise")] == [n for n in names if n in ONLY]
    assert [a.name for a in select_analyses(["noise"])] == ["noise"]


def test_bad_options_and_names(stores) -> None:
    path = stores[".zarr"].path
    with pytest.raises(SpecError, match=r"only= must name analyses among .*noise"):
        analyze(path, only=["noise", "bogus"], progress=False)
    with pytest.raises(SpecError, match="options keys"):
        analyze(path, only=ONLY, options={"nosie": {}}, progress=False)
    with pytest.raises(SpecError, match="engine options must be among"):
        analyze(path, only=ONLY, options={"engine": {"slab": 3}}, progress=False)
    with pytest.raises(SpecError, match="split_every must be >= 2"):
        EngineOptions(split_every=1)
    with pytest.raises(SpecError, match="noise options must be among"):
        analyze(path, only=ONLY, options={"noise": {"bogus": 1}, "engine": {"persist": False}}, progress=False)


class _EmptyStore(Store):
    """A valid store that has committed no record yet (as while a writer is still buffering)."""

    def __init__(self) -> None:
        self.path = "empty.zarr"
        self.meta = new_meta(["a"], "replay")


def test_empty_store_is_an_error(tmp_path) -> None:
    w = StoreWriter(tmp_path / "e.zarr", new_meta(["a"], "replay"))
    w.close()
    with pytest.raises(GradforensicsError, match=r"incomplete|no complete record|holds no record"):
        analyze(tmp_path / "e.zarr", progress=False)
    with pytest.raises(EmptyStoreError, match="no complete record"):
        analyze(_EmptyStore(), progress=False)


def test_slab_size_does_not_change_results(stores) -> None:
    path = stores[".h5"].path
    small = analyze(path, only=ONLY, progress=False, options={"engine": {"slab_bytes": 1 << 16, "split_every": 2,
                                                                         "persist": False}})
    big = analyze(path, only=ONLY, progress=False, options={"engine": {"persist": False, "num_workers": 1,
                                                                       "precision": "float64"}})
    _tables_equal(small, big, rtol=1e-4)   # float32 products vs float64 products


def test_public_api_and_progress_to_stderr(stores, capsys) -> None:
    f = gf.analyze(stores[".zarr"].path, only=["nonfinite"], progress=True, options={"engine": {"persist": False}})
    assert list(f.results) == ["nonfinite"]
    assert capsys.readouterr().out == ""


# -------------------------------------------------------------------- CLI
def test_cli_analyze_exit_codes(tmp_path, capsys) -> None:
    bad = nonfinite_store(tmp_path / "nf.zarr", 1, n_records=16, weights_every=None, activations=False)
    ok = healthy_store(tmp_path / "ok.zarr", 1, n_records=16, weights_every=None, activations=False)
    out = tmp_path / "out"
    assert main(["analyze", bad.path, "--out", str(out), "--only", "noise,nonfinite", "--quiet"]) == 0
    flags = json.loads((out / "flags.json").read_text())
    assert flags["n_records"] == 16 and flags["flags"][0]["kind"] == "nonfinite"
    assert (out / "tables" / "noise.csv").is_file() and (out / "tables" / "nonfinite.csv").is_file()
    header = (out / "tables" / "noise.csv").read_text().splitlines()[0].split(",")
    assert header[:3] == ["tensor", "head", "source"] and {"b_simple", "snr"} <= set(header)
    assert main(["analyze", bad.path, "--out", str(out), "--only", "nonfinite", "--quiet", "--fail-on", "0.5"]) == 1
    assert main(["analyze", ok.path, "--out", str(out), "--only", "nonfinite", "--quiet", "--fail-on", "0.5"]) == 0
    capsys.readouterr()
    assert main(["analyze", str(tmp_path / "missing.zarr"), "--out", str(out)]) == 2
    assert main(["analyze", ok.path, "--out", str(out), "--only", "bogus"]) == 2
    err = capsys.readouterr().err
    assert "missing.zarr" in err and "bogus" in err and "Traceback" not in err


@pytest.mark.slow
def test_cli_scheduler_address(tmp_path) -> None:
    distributed = pytest.importorskip("distributed")
    store = nonfinite_store(tmp_path / "nf.h5", 2, n_records=12, records=(3, 7), weights_every=None, activations=False)
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False, protocol="tcp",
                                  dashboard_address=None) as cluster:
        rc = main(["analyze", store.path, "--out", str(tmp_path / "o"), "--only", "nonfinite", "--quiet",
                   "--scheduler", cluster.scheduler_address, "--fail-on", "high"])
        sched_file = tmp_path / "scheduler.json"          # as `dask scheduler --scheduler-file` writes it
        sched_file.write_text(json.dumps({"address": cluster.scheduler_address}))
        rc_file = main(["analyze", store.path, "--out", str(tmp_path / "o2"), "--only", "nonfinite", "--quiet",
                        "--scheduler", str(sched_file), "--fail-on", "0.6"])
    assert rc == 0   # 2 of 12 records -> severity ~0.68 < 0.75
    assert rc_file == 1
    assert json.loads((tmp_path / "o2" / "flags.json").read_text())["flags"][0]["tensor"] == "layers.1.mlp.up.weight"
    doc = json.loads((tmp_path / "o" / "flags.json").read_text())
    assert doc["flags"][0]["tensor"] == "layers.1.mlp.up.weight"
    assert np.isclose(doc["flags"][0]["severity"], 0.6 + 0.3 * 2 / 12 + 0.1 * np.log10(2) / 2, atol=1e-3)
