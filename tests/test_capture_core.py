"""Framework-agnostic capture pieces against NumPy oracles: heads, sketches, activation statistics."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import scipy.stats

import gradforensics as gf
from gradforensics.errors import SpecError, StoreClosedError
from gradforensics.recording.actstats import act_stats, make_range
from gradforensics.recording.heads import parse_head_spec
from gradforensics.recording.sketch import Sketcher
from gradforensics.store.heads import HeadSpec
from gradforensics.store.reader import Store


# ----------------------------------------------------------------- heads
def test_plain_head_split_rows() -> None:
    w = np.arange(8 * 3).reshape(8, 3).astype(np.float32)
    blocks = HeadSpec(4).split(w)
    assert blocks.shape == (4, 2, 3)
    np.testing.assert_array_equal(blocks[1], w[2:4])


def test_head_split_along_columns() -> None:
    w = np.arange(3 * 8).reshape(3, 8).astype(np.float32)
    blocks = HeadSpec(2, axis=1).split(w)
    np.testing.assert_array_equal(blocks[1], w[:, 4:8])
    np.testing.assert_array_equal(HeadSpec(2, axis=1).merge(blocks), w)


def test_fused_qkv_blocks_gpt2_layout() -> None:
    # Conv1D weight (in, 3*hidden), columns q|k|v, each hidden = H*d.
    h, d, n_in = 2, 3, 4
    w = np.arange(n_in * 3 * h * d).reshape(n_in, 3 * h * d).astype(np.float32)
    spec = HeadSpec(h, axis=1, fused=3)
    blocks = spec.split(w)
    assert spec.labels() == ["q0", "q1", "k0", "k1", "v0", "v1"]
    np.testing.assert_array_equal(blocks[3], w[:, h * d + d: h * d + 2 * d])  # k1
    np.testing.assert_array_equal(spec.merge(blocks), w)


def test_fused_interleaved_neox_layout() -> None:
    # Linear (3*hidden, in), rows ordered [head][q|k|v][d].
    h, d, n_in = 2, 3, 4
    w = np.arange(3 * h * d * n_in).reshape(3 * h * d, n_in).astype(np.float32)
    spec = HeadSpec(h, axis=0, fused=3, interleaved=True)
    blocks = spec.split(w)
    # k of head 1: rows of head 1 start at 1*3*d, k part at +d
    np.testing.assert_array_equal(blocks[h + 1], w[3 * d + d: 3 * d + 2 * d])
    np.testing.assert_array_equal(spec.merge(blocks), w)


HEAD_LAYOUTS = [HeadSpec(4), HeadSpec(2, axis=1, role="o"), HeadSpec(2, axis=1, role="qkv", fused=3),
                HeadSpec(2, axis=0, role="qkv", fused=3, interleaved=True), HeadSpec(3, axis=-1, role="k")]


@pytest.mark.parametrize("spec", HEAD_LAYOUTS, ids=repr)
@pytest.mark.parametrize("suffix", [".zarr", ".h5"])
def test_head_attrs_round_trip_through_a_store(tmp_path: Path, spec: HeadSpec, suffix: str) -> None:
    assert HeadSpec.from_attrs(spec.attrs()) == spec
    shape = (6, 12) if spec.axis in (1, -1) else (12, 6)
    g = np.arange(72, dtype=np.float32).reshape(shape)
    with gf.Recorder(tmp_path / f"h{suffix}", sources=["a"], heads={"t": spec}, background=False) as rec:
        rec.record(source="a", grads={"t": g, "plain": g})
    store = gf.open_store(tmp_path / f"h{suffix}")
    stored = HeadSpec.from_attrs(store.grads["t"].attrs)
    assert stored == spec
    np.testing.assert_array_equal(stored.merge(store.grad("t")[0].compute()), g)
    assert HeadSpec.from_attrs(store.grads["plain"].attrs) is None


def test_head_spec_errors() -> None:
    with pytest.raises(SpecError, match="not divisible by 3 heads"):
        HeadSpec(3).validate("attn.q", (8, 4))
    with pytest.raises(SpecError, match="role must be one of"):
        parse_head_spec("x", {"heads": 2, "role": "z"})
    with pytest.raises(SpecError, match="int or a dict"):
        parse_head_spec("x", "auto")


# --------------------------------------------------------------- sketches
@pytest.mark.slow
@pytest.mark.parametrize("method", ["countsketch", "gaussian"])
def test_sketch_preserves_cosines_to_jl_bound(method: str) -> None:
    rng = np.random.default_rng(0)
    d, k, n = 1 << 14, 1024, 24
    base = rng.standard_normal(d)
    x = np.stack([base * rng.uniform(-1, 1) + rng.standard_normal(d) * rng.uniform(0.2, 2) for _ in range(n)])
    sk = Sketcher(k=k, seed=3, method=method)
    y = np.stack([sk.project(v.astype(np.float32)) for v in x]).astype(np.float64)

    def cos(m: np.ndarray) -> np.ndarray:
        u = m / np.linalg.norm(m, axis=1, keepdims=True)
        return u @ u.T

    c, ch = cos(x), cos(y)
    iu = np.triu_indices(n, 1)
    err = np.abs(ch[iu] - c[iu])
    bound = np.sqrt((1 + c[iu] ** 2) / k)  # one standard deviation of the estimate
    assert np.mean(err <= 2 * bound) >= 0.9          # ~95% within 2 sd
    assert np.mean(err) <= 1.25 * np.mean(bound)     # mean |error| ~ 0.8 sd
    # regenerable: the same seed gives bit-identical sketches, another seed does not
    assert np.array_equal(Sketcher(k=k, seed=3, method=method).project(x[0].astype(np.float32)), y[0].astype(np.float32))
    assert not np.array_equal(Sketcher(k=k, seed=4, method=method).project(x[0].astype(np.float32)), y[0].astype(np.float32))


def test_sketch_only_store(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    g = rng.standard_normal((6, 32, 16)).astype(np.float32)
    with gf.Recorder(tmp_path / "s.zarr", sources=["a"], heads={"q": 4}, sketch={"k": 64, "seed": 7}) as rec:
        for x in g:
            rec.record(source="a", grads={"q": x})
    s = Store(tmp_path / "s.zarr")
    assert not s.grads and set(s.sketches) == {"q"}
    sk = s.sketch("q").compute()
    assert sk.shape == (6, 4, 64)
    np.testing.assert_allclose(sk[2, 1], Sketcher(k=64, seed=7).project(g[2].reshape(4, 8, 16)[1]), rtol=1e-6)
    assert s.sketches["q"].attrs["seed"] == 7 and s.sketches["q"].attrs["method"] == "countsketch"


# ----------------------------------------------------- activation statistics
@pytest.mark.parametrize("bounds", [None, (-1.0, 1.0), (0.0, 1.0)])
def test_act_stats_match_numpy(bounds: tuple[float, float] | None) -> None:
    rng = np.random.default_rng(2)
    first = rng.standard_normal((200, 12)).astype(np.float32)
    a = rng.standard_normal((300, 12)).astype(np.float32) * 1.5
    if bounds == (-1.0, 1.0):
        first, a = np.tanh(first), np.tanh(a)
    elif bounds == (0.0, 1.0):
        first, a = 1 / (1 + np.exp(-first)), 1 / (1 + np.exp(-3 * a))
    a[5, 3] = np.nan
    r = make_range(first, bounds)
    got = act_stats(a, r)
    ok = ~np.isnan(a)
    s = np.abs(np.where(ok, a, np.nan))
    if bounds is None:
        scale = np.percentile(np.abs(first), 99)
        high = s >= 0.9 * scale
    else:
        scale = max(abs(bounds[0]), abs(bounds[1]))
        lo, hi = bounds
        high = (a >= 0.9 * hi) | ((a <= 0.9 * lo) if lo < 0 else False)
    assert np.isclose(r.scale, scale, rtol=1e-6)
    n = ok.sum(0)
    np.testing.assert_allclose(got["frac_low"], (s <= 0.05 * scale).sum(0) / n, rtol=1e-6)
    np.testing.assert_allclose(got["frac_high"], (high & ok).sum(0) / n, rtol=1e-6)
    np.testing.assert_allclose(got["mean"], np.nanmean(a, 0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["std"], np.nanstd(a, 0), rtol=1e-4, atol=1e-6)
    hist, _ = np.histogram(a[ok], bins=np.asarray(r.edges))
    np.testing.assert_array_equal(got["hist"], hist)
    assert got["hist"].sum() == ok.sum()
    # excess kurtosis of every finite value: SciPy's (Fisher, biased) on the same values, to 1e-5 relative
    assert got["kurtosis"].shape == (1,)
    np.testing.assert_allclose(got["kurtosis"][0], scipy.stats.kurtosis(a[ok].astype(np.float64)), rtol=1e-5)


def test_activations_recorded_per_unit(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    acts = [np.maximum(rng.standard_normal((50, 8)), 0).astype(np.float32) for _ in range(4)]
    with gf.Recorder(tmp_path / "a.h5", sources=["a"]) as rec:
        for a in acts:
            rec.record(source="a", grads={"w": np.ones(2, np.float32)}, activations={"mlp.act": a})
    s = Store(tmp_path / "a.h5")
    assert s.act_modules == ["mlp.act"]
    np.testing.assert_allclose(s.act("mlp.act", "mean"), np.stack([a.mean(0) for a in acts]), rtol=1e-5)
    kurt = s.act("mlp.act", "kurtosis")
    assert kurt.shape == (4, 1)
    np.testing.assert_allclose(kurt[:, 0], [scipy.stats.kurtosis(a.ravel().astype(np.float64)) for a in acts],
                               rtol=1e-5)
    attrs = s.act_attrs("mlp.act")
    assert attrs["scale"] == pytest.approx(np.percentile(acts[0], 99), rel=1e-6)


# ------------------------------------------------------------ recorder API
def test_record_needs_exactly_one_of_source_or_mixture(tmp_path: Path) -> None:
    with gf.Recorder(tmp_path / "r.zarr", sources=["a", "b"]) as rec:
        with pytest.raises(SpecError, match="exactly one of source= or mixture="):
            rec.record(grads={"w": np.ones(2, np.float32)})
        with pytest.raises(SpecError, match="source 'c' is not one of the store's sources"):
            rec.record(source="c", grads={"w": np.ones(2, np.float32)})
    with pytest.raises(StoreClosedError, match="record\\(\\) after close"):
        rec.record(source="a", grads={"w": np.ones(2, np.float32)})


def test_recorder_option_errors(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="sources must be distinct; \\['a'\\] given more than once"):
        gf.Recorder(tmp_path / "x.zarr", sources=["a", "a"])
    with pytest.raises(SpecError, match="dtype must be one of"):
        gf.Recorder(tmp_path / "y.zarr", sources=["a"], dtype="int8")
    with pytest.raises(gf.GradforensicsError, match=r"unknown store suffix '\.npz'"):
        gf.Recorder(tmp_path / "z.npz", sources=["a"])


def test_writer_error_surfaces_on_caller_thread(tmp_path: Path) -> None:
    rec = gf.Recorder(tmp_path / "e.zarr", sources=["a"], heads={"q": 3})
    rec.record(source="a", grads={"q": np.ones((4, 2), np.float32)})  # 4 rows, 3 heads: fails in the writer
    with pytest.raises(SpecError, match="not divisible by 3 heads"):
        rec.close()


def test_backpressure_bounds_the_queue(tmp_path: Path) -> None:
    rec = gf.Recorder(tmp_path / "q.zarr", sources=["a"], queue_size=2)
    for _ in range(10):
        rec.record(source="a", grads={"w": np.ones(1000, np.float32)})
        assert rec._queue is not None and rec._queue.qsize() <= 2
    rec.close()
    assert Store(tmp_path / "q.zarr").n_records == 10
