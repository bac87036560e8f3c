"""Issue 28: noise's per-unit estimates over a slab of units give each unit the single-unit floats.

Noise's pooled estimates (``noisescale.noise_parts``) of every unit of a slab with the same
records run as one stacked pass (``noise_parts_stack``), and the jackknife standard errors of
every row in one pass (``summaries``).  Checked here with ``==`` (NaN equal to NaN), never a
tolerance: against the single-unit code as it was before (written out below), on random Gram
matrices of many sizes, scales, batch sizes and with non-finite entries, and the whole noise
table of the planted stores against each unit's own rows.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from gradforensics.analysis.kinds import noise as nz
from gradforensics.analysis.toolkit import noisescale as ns

SIZES = [0, 1, 2, 3, 4, 5, 8, 17, 31, 32, 33, 64, 127, 128, 129, 257]


# ------------------------------------------------------- the single-unit code as it was
def _noise_parts_before(gram: np.ndarray, n_samples: np.ndarray) -> ns.Parts:
    k = np.asarray(gram, dtype=np.float64)
    b = np.asarray(n_samples, dtype=np.float64)
    n = b.size
    if n < 2:
        return ns.Parts(math.nan, math.nan, None, None)
    d = np.diag(k)
    v = k @ b
    w1, w2, bd = b.sum(), (b * b).sum(), (b * d).sum()
    g2 = (b @ v - (b * b * d).sum()) / (w1 * w1 - w2)
    tr = (bd - g2 * w1) / n
    if n < 3:
        return ns.Parts(float(g2), float(tr), None, None)
    with np.errstate(divide="ignore", invalid="ignore"):
        g2_m = (b @ v - (b * b * d).sum() - 2 * b * (v - b * d)) / ((w1 - b) ** 2 - (w2 - b * b))
        tr_m = (bd - b * d - g2_m * (w1 - b)) / (n - 1)
    return ns.Parts(float(g2), float(tr), g2_m, tr_m)


def _jackknife_se_before(loo: np.ndarray) -> float:
    n = loo.size
    return float(np.sqrt((n - 1) / n * ((loo - loo.mean()) ** 2).sum()))


def _summarize_before(parts: ns.Parts, batch_size: float, n: int, estimator: str = "pooled") -> dict:
    out: dict = dict.fromkeys(ns.FIELDS, math.nan)
    out.update(n=n, batch_size=batch_size, estimator=estimator, snr_note="", g2=parts.g2, trace_sigma=parts.trace,
               trace_between=parts.between)
    if n < 2 or not math.isfinite(parts.g2):
        return out
    snr = parts.g2 * batch_size / parts.trace if parts.trace > 0 else (math.inf if parts.g2 > 0 else math.nan)
    se = lo = hi = math.nan
    if parts.g2_loo is not None and parts.trace_loo is not None:
        with np.errstate(divide="ignore", invalid="ignore"):
            snr_m = parts.g2_loo * batch_size / parts.trace_loo
        if np.all(np.isfinite(parts.trace_loo)):
            out["trace_sigma_se"] = _jackknife_se_before(parts.trace_loo)
        if np.all(np.isfinite(snr_m)):
            se = _jackknife_se_before(snr_m)
            lo, hi = snr - ns.Z90 * se, snr + ns.Z90 * se
    resolved = snr > 0 and not (se >= snr)
    upper = max(hi, 0.0) if math.isfinite(hi) else math.nan
    out.update(snr_se=se, snr_upper=upper)
    if not resolved:
        out.update(snr_note=ns.BELOW_RESOLUTION, snr_lo=0.0, snr_hi=upper,
                   b_simple_lo=_b(batch_size, upper), b_simple_hi=math.inf)
        return out
    lo = max(lo, 0.0) if math.isfinite(lo) else lo
    out.update(snr=snr, b_simple=_b(batch_size, snr), snr_lo=lo, snr_hi=hi, b_simple_lo=_b(batch_size, hi),
               b_simple_hi=_b(batch_size, lo))
    return out


def _b(batch: float, snr: float) -> float:
    if math.isnan(snr):
        return math.nan
    return batch / snr if snr > 0 else math.inf


# ------------------------------------------------------------------ helpers
def _same(a: object, b: object) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return x.shape == y.shape and x.tobytes() == y.tobytes() if not np.isnan(x).any() else \
        bool(np.array_equal(x, y, equal_nan=True)) and np.array_equal(np.signbit(x), np.signbit(y))


def _same_parts(a: ns.Parts, b: ns.Parts) -> bool:
    return all(_same(getattr(a, f), getattr(b, f)) for f in ("g2", "trace", "g2_loo", "trace_loo", "between"))


def _same_row(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)


def _grams(rng: np.random.Generator, m: int, n: int, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """m Gram matrices of n records and their batch sizes: random, planted signal, constant, non-finite."""
    scale = 10.0 ** rng.uniform(-6, 6)
    d = int(rng.integers(1, 40))
    mean = rng.standard_normal(d) * rng.uniform(0, 3)
    X = (mean + rng.standard_normal((m, n, d))) * scale
    K = np.matmul(X, np.swapaxes(X, 1, 2))
    if kind == "constant" and n:
        K[:] = scale
    if kind == "nonfinite" and n > 1:
        K[rng.integers(0, m), rng.integers(0, n), rng.integers(0, n)] = rng.choice([np.inf, -np.inf, np.nan])
    b = np.full(n, float(rng.integers(1, 64))) if rng.random() < 0.5 else rng.integers(1, 64, n).astype(np.float64)
    return np.ascontiguousarray(K), b


KINDS = ["random", "random", "constant", "nonfinite"]


# ------------------------------------------------------------------ tests
def test_stacked_parts_and_summaries_are_the_single_calls_as_they_were() -> None:
    rng = np.random.default_rng(28)
    checked = 0
    for t in range(160):
        n, m = SIZES[t % len(SIZES)], int(rng.integers(1, 9))
        K, b = _grams(rng, m, n, KINDS[t % len(KINDS)])
        got = ns.noise_parts_stack(K, b)
        want = [_noise_parts_before(K[i], b) for i in range(m)]
        assert all(_same_parts(g, w) for g, w in zip(got, want, strict=True)), (n, m, t)
        assert all(_same_parts(ns.noise_parts(K[i], b), w) for i, w in enumerate(want)), (n, t)
        bs = [float(rng.choice([b.mean() if n else math.nan, rng.uniform(1, 100)])) for _ in range(m)]
        items = [(p, bb, n, "pooled") for p, bb in zip(want, bs, strict=True)]
        rows = ns.summaries(items)
        assert all(_same_row(r, _summarize_before(*it)) for r, it in zip(rows, items, strict=True)), (n, m, t)
        assert all(_same_row(ns.summarize(*it), _summarize_before(*it)) for it in items)
        checked += m
    assert checked > 500


def test_summaries_mixed_lengths_and_the_within_estimator() -> None:
    """One summaries call over rows of several lengths, pooled and within-source parts, with and without
    delete-one values: each row is its single call's."""
    rng = np.random.default_rng(7)
    items = []
    for t in range(60):
        n = int(rng.integers(2, 40))
        K, b = _grams(rng, 1, n, KINDS[t % len(KINDS)])
        src = np.arange(n) % 2
        if t % 3 == 0 and n >= 4:
            p = ns.mixture_parts(K[0], b, src, np.array([0.5, 0.5]))
            items.append((p, float(b.mean()), n, "within sources"))
        else:
            items.append((_noise_parts_before(K[0], b), float(b.mean()), n, "pooled"))
    rng.shuffle(items)
    for r, it in zip(ns.summaries(items), items, strict=True):
        assert _same_row(r, _summarize_before(*it))


def test_a_different_float_would_be_seen() -> None:
    """The check can fail: the jackknife SE with its sum taken in another order is not always the same float."""
    rng = np.random.default_rng(3)
    differ = 0
    for _ in range(200):
        x = rng.standard_normal(int(rng.integers(20, 300))) * 1e3
        a = _jackknife_se_before(x)
        b = float(np.sqrt((x.size - 1) / x.size * math.fsum((x - x.mean()) ** 2)))
        differ += a != b
    assert differ > 0


@pytest.mark.parametrize("mode", ["training", "replay"])
def test_noise_table_is_each_units_own_rows(mode: str) -> None:
    """The noise table from the slabs against each unit's rows run alone through the code as it was."""
    rng = np.random.default_rng(11 if mode == "training" else 12)
    n, S = 40, 3
    grams = {}
    for t in range(6):
        for h in [None, 0, 1, 2]:
            K, _ = _grams(rng, 1, n, "nonfinite" if (t, h) == (2, 1) else "random")
            finite = np.ones(n, bool)
            if (t, h) == (4, None):
                finite[[3, 17]] = False
            grams[(f"model.layers.{t}.w", h)] = _G(K[0], finite, f"model.layers.{t}.w", h)
    src = np.arange(n) % S
    bsz = rng.integers(4, 32, n).astype(np.float64)
    bsz[5] = 0.0
    sources = ("a", "b", "c")
    d = nz.design(bsz, None, src, sources, mode)
    table = nz.noise_table(grams, bsz, src, sources, None, mode)
    keys = sorted(grams, key=lambda k: (k[0], -1 if k[1] is None else k[1]))
    own = [r for r in table.to_dict("records") if r["tensor"] != nz.MODEL]
    ref = [(key, row) for key in keys for row in _rows_before(grams[key], d)]
    assert len(own) == len(ref) > len(keys)
    for r, (key, w) in zip(own, ref, strict=True):
        assert (r["tensor"], None if pd.isna(r["head"]) else int(r["head"])) == key
        assert _same_row({k: r[k] for k in w}, w), (key, r["source"])


class _G:
    """A GramResult's fields the noise table reads."""

    def __init__(self, gram: np.ndarray, finite: np.ndarray, tensor: str, head: int | None) -> None:
        self.gram, self.finite, self.from_sketch = gram, finite, False
        self.tensor, self.head = tensor, head


def _rows_before(g: _G, d: nz.Design) -> list[dict]:
    """noise_rows of one unit as it was (per source: block, noise_parts or mixture_parts, summarize)."""
    usable = g.finite & (d.n_samples > 0)
    out = []
    for s in [None, *range(len(d.sources))]:
        sel = usable if s is None else usable & (d.source_index == s)
        if s is not None and sel.sum() < 2:
            continue
        rows = np.flatnonzero(sel)
        k, b = g.gram[np.ix_(rows, rows)], d.n_samples[rows]
        p, how = _noise_parts_before(k, b), "pooled"
        if s is None and d.within:
            present = np.unique(d.source_index[rows])
            if present.size >= 2 and min(np.sum(d.source_index[rows] == x) for x in present) >= 2:
                remap = np.searchsorted(present, d.source_index[rows])
                p, how = ns.mixture_parts(k, b, remap, d.shares[present]), "within sources"
        bs = d.n_samples[sel]
        est = _summarize_before(p, float(bs.mean()) if bs.size else math.nan, int(bs.size), how)
        out.append({"source": "" if s is None else d.sources[s], **est})
    return out


def test_small_median_is_numpys() -> None:
    """The siblings' median (a few log levels, once per head) against ``np.median``: odd and even counts, ties,
    infinities, scales up to overflow, signed zeros (equal, not always of the same sign: the median is only
    compared with a threshold)."""
    rng = np.random.default_rng(5)
    for t in range(3000):
        n = int(rng.integers(2, 40))
        v = list(rng.standard_normal(n) * 10.0 ** rng.uniform(-300, 300))
        if t % 5 == 0:
            v = [float(x) for x in np.round(np.asarray(v) / max(abs(x) for x in v) * 3)]
        if t % 7 == 0:
            v[int(rng.integers(0, n))] = float(rng.choice([np.inf, -np.inf]))
        if t % 13 == 0:      # zeros of both signs: equal, the sign of a middle zero is the sort's (it is only compared)
            v = [0.0, -0.0] * (n // 2) + [-0.0] * (n % 2)
            assert nz.small_median(v) == float(np.median(v)) == 0.0
            continue
        got, want = nz.small_median(v), float(np.median(v))
        assert _same(got, want) or got == want == 0.0, (t, v)
