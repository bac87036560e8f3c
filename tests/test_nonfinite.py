"""Non-finite gradients: planted NaN/Inf found with the right tensor, head, records and
source; a finding (severity >= 0.5), not an error; excluded from direction statistics."""

from __future__ import annotations

import numpy as np
import pytest

import gradforensics as gf
from gradforensics.analysis.kinds.nonfinite import severity
from gradforensics.testing.contracts import AnalysisContract
from gradforensics.testing.planted import healthy_store, nonfinite_store, write_store

OPTS = {"engine": {"persist": False}}


def run(path, only=("nonfinite",)):
    return gf.analyze(path, only=list(only), options=OPTS, progress=False)


@pytest.mark.parametrize("suffix", [".zarr", ".h5"])
def test_planted_tensor_records_and_source(tmp_path, suffix) -> None:
    store = nonfinite_store(tmp_path / f"s{suffix}", 0, records=(3, 11, 20), source="c", n_records=24)
    f = run(store.path)
    assert len(f.flags) == 1
    flag = f.flags[0]
    assert (flag.kind, flag.tensor, flag.head) == ("nonfinite", "layers.1.mlp.up.weight", None)
    assert flag.sources == ("c",) and flag.records == (3, 20)
    assert flag.severity >= 0.5
    ev = flag.evidence
    assert ev["records_nonfinite"] == 3 and ev["elements_nonfinite"] == 9 and ev["first_record"] == 3
    assert "3 of 24 records" in flag.summary and "source c" in flag.summary
    t = f.table("nonfinite")
    row = t[(t["tensor"] == flag.tensor) & (t["source"] == "")].iloc[0]
    assert row["first_step"] == 3 and row["last_record"] == 20 and row["first_sources"] == "c"
    clean = t[(t["tensor"] != flag.tensor) & (t["source"] == "")]
    assert (clean["records_nonfinite"] == 0).all() and clean["first_record"].isna().all()


def test_planted_head_only(tmp_path) -> None:
    store = nonfinite_store(tmp_path / "s.zarr", 1, tensor="layers.0.attn.q.weight", head=3, records=(7,),
                            values=(np.nan,), n_records=16)
    f = run(store.path, only=("nonfinite", "noise"))
    flags = [x for x in f.flags if x.kind == "nonfinite"]
    assert len(flags) == 1 and flags[0].evidence["heads"] == [3]
    t = f.table("nonfinite")
    rows = t[(t["tensor"] == "layers.0.attn.q.weight") & (t["source"] == "")]
    assert dict(zip(rows["head"].astype("float").fillna(-1).astype(int), rows["records_nonfinite"])) == \
        {-1: 1, 0: 0, 1: 0, 2: 0, 3: 1}
    # excluded from the direction statistics of head 3 and the whole tensor, not of head 0
    noise = f.table("noise")
    n_of = lambda h: int(noise[(noise.tensor == "layers.0.attn.q.weight") & (noise.source == "")  # noqa: E731
                              & ((noise["head"] == h) if h is not None else noise["head"].isna())]["n"].iloc[0])
    assert n_of(None) == 15 and n_of(3) == 15 and n_of(0) == 16
    assert np.isfinite(noise[["g2", "trace_sigma", "snr"]].to_numpy(float)).all()


def test_inf_only_and_every_record(tmp_path) -> None:
    store = nonfinite_store(tmp_path / "s.zarr", 2, records=range(12), values=(np.inf,), n_records=12)
    f = run(store.path)
    flag = f.flags[0]
    assert flag.evidence["records_nonfinite"] == 12 and flag.severity > 0.9
    assert set(flag.sources) == {"b"}


def test_healthy_store_has_no_flag_and_zero_counts(tmp_path) -> None:
    store = healthy_store(tmp_path / "s.zarr", 3, n_records=16, weights_every=None, activations=False)
    f = run(store.path)
    assert f.flags == []
    assert (f.table("nonfinite")["records_nonfinite"] == 0).all()


def test_mixed_batch_names_every_source_involved(tmp_path) -> None:
    rng = np.random.default_rng(0)

    def grads(i, src, r):
        g = rng.standard_normal((4, 4)).astype(np.float32)
        if i == 2:
            g[0, 0] = np.nan
        return {"w": g}

    mix = lambda i: {"a": 0.5, "b": 0.5} if i == 2 else "a"  # noqa: E731
    store = write_store(tmp_path / "s.zarr", grads, 6, ("a", "b", "c"), source_of=mix)
    flag = run(store.path).flags[0]
    assert set(flag.sources) == {"a", "b"}
    assert flag.evidence["per_source"] == {"a": 1, "b": 1}


def test_sketch_only_counts_sketch_entries(tmp_path) -> None:
    def grads(i, src, r):
        g = r.standard_normal((8, 8)).astype(np.float32)
        if i == 1:
            g[2, 2] = np.nan
        return {"w": g}

    store = write_store(tmp_path / "s.zarr", grads, 4, ("a",), sketch={"k": 16})
    flag = run(store.path).flags[0]
    assert flag.evidence["from_sketch"] and flag.records == (1, 1)
    assert "sketch entries" in flag.summary


def test_severity_scale() -> None:
    assert severity(0, 100) == 0.0
    assert severity(1, 1000) == pytest.approx(0.6003)
    assert 0.5 <= severity(1, 10) < severity(5, 10) < severity(10, 10) <= 1.0


def test_plot_shows_counts(tmp_path) -> None:
    from matplotlib.figure import Figure

    from gradforensics.analysis.kinds.nonfinite import plot

    store = nonfinite_store(tmp_path / "s.zarr", 0, n_records=24)
    f = run(store.path)
    ax = Figure().add_subplot()
    plot(f.results["nonfinite"], f.flags[0], ax)
    heights = ax.collections[0].get_segments()
    assert sorted(i for i, seg in enumerate(heights) if seg[1][1] > 0) == [5, 17]


class TestNonfiniteContract(AnalysisContract):
    analysis_name = "nonfinite"
    factory = staticmethod(nonfinite_store)
