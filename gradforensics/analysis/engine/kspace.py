"""K-space algebra: direction statistics of per-record gradients through their Gram matrix.

Every vector the direction analyses need lies in the span of the records
``g_1 .. g_N`` (rows of ``X``), so it is ``v = Xᵀa`` for a *coefficient vector*
``a`` of length N, and every inner product is a quadratic form in the Gram
matrix ``K = X Xᵀ``::

    <Xᵀa, Xᵀb> = aᵀ K b

A window mean is ``a = 1_W / |W|``; the least-squares per-source mean gradients
of mixed batches are the rows of ``C = (AᵀA)⁻¹Aᵀ`` (``A`` = ``batches/mixture``,
N×S), so ``M Mᵀ = C K Cᵀ``; the principal directions of the records are the
eigenvectors of the centred ``H K H`` (``H = I - 11ᵀ/N``; Schölkopf et al. 1998,
kernel PCA with a linear kernel), whose scores are ``u_k √λ_k``.  Nothing here
reads a gradient: the analyses get ``K`` once from the engine's Gram pass.

This module also holds what the three direction analyses (drift, oscillation,
conflict) share: the unit list (one per tensor and head, non-finite records
excluded, records in time order), the significance-to-severity map and the
head/whole-tensor flag de-duplication.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, cast

import numpy as np

from gradforensics.analysis.engine.model import parse_options as base_parse_options
from gradforensics.errors import SpecError

if TYPE_CHECKING:
    from gradforensics.analysis.engine.model import Context, Flag

T = TypeVar("T")

#: Flags below this severity are not emitted (the table still has the row).
REPORT_FLOOR = 0.25

_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+)(?:\.|$)")


# --------------------------------------------------------------------- units
@dataclass(frozen=True)
class Unit:
    """One tensor (or one head of it), ready for K-space statistics.

    ``gram`` is K restricted to the usable (finite) records, rows in time order
    (by ``batches/step``, ties by record index); ``records`` are the store
    indices of those rows.  ``n_heads`` is set on the whole-tensor unit of a
    head-split tensor.
    """

    tensor: str
    head: int | None
    gram: np.ndarray
    records: np.ndarray
    n_excluded: int
    from_sketch: bool = False
    n_heads: int | None = None

    @property
    def n(self) -> int:
        return int(self.records.size)

    @property
    def layer(self) -> int | None:
        return layer_of(self.tensor)

    def where(self) -> str:
        """``tensor`` or ``tensor head h`` for sentences."""
        return self.tensor if self.head is None else f"{self.tensor} head {self.head}"


def time_order(batches: Mapping[str, np.ndarray], n: int) -> np.ndarray:
    """Record indices sorted by optimizer step (stable: ties keep record order)."""
    step = batches.get("step")
    if step is None or len(step) != n:
        return np.arange(n)
    return np.argsort(np.asarray(step), kind="stable")


def units(ctx: Context) -> list[Unit]:
    """Every (tensor, head) of ``ctx.grams`` as a :class:`Unit`, sorted.

    A head-split tensor whose whole-tensor Gram matrix the engine did not
    provide gets one as the sum of its heads' (``K = Σ_h K_h``, exact: the
    heads partition the features).
    """
    grams = dict(ctx.grams)
    by_tensor: dict[str, list[int]] = {}
    for tensor, head in grams:
        if head is not None:
            by_tensor.setdefault(tensor, []).append(int(head))
    n = ctx.n_records
    order = time_order(ctx.batches, n)
    out: list[Unit] = []
    for tensor in sorted({t for t, _ in grams}):
        heads = sorted(by_tensor.get(tensor, []))
        whole = grams.get((tensor, None))
        for head in [None, *heads]:
            g = whole if head is None else grams[(tensor, head)]
            if g is None:
                g = _sum_heads([grams[(tensor, h)] for h in heads])
            out.append(_unit(tensor, head, g, order, len(heads) if head is None and heads else None))
    return out


def _sum_heads(parts: list[Any]) -> Any:
    first = parts[0]
    gram = np.sum([np.asarray(p.gram, dtype=np.float64) for p in parts], axis=0)
    nonfinite = np.sum([np.asarray(p.nonfinite) for p in parts], axis=0)
    return dataclasses.replace(first, head=None, gram=gram, nonfinite=nonfinite,
                               n_features=sum(int(p.n_features) for p in parts))


def _unit(tensor: str, head: int | None, g: Any, order: np.ndarray, n_heads: int | None) -> Unit:
    finite = np.asarray(g.nonfinite) == 0
    K = np.asarray(g.gram, dtype=np.float64)
    keep = order[finite[order] & np.isfinite(np.diag(K))[order]]
    return Unit(tensor=tensor, head=head, gram=K[np.ix_(keep, keep)], records=keep.astype(np.int64),
                n_excluded=int(order.size - keep.size), from_sketch=bool(getattr(g, "from_sketch", False)),
                n_heads=n_heads)


def layer_of(name: str) -> int | None:
    """Layer index parsed from a parameter name (``model.layers.5.mlp...`` -> 5)."""
    m = _LAYER_RE.search(name)
    return int(m.group(1)) if m else None


# ------------------------------------------------------------- inner products
def inner(K: np.ndarray, A: np.ndarray, B: np.ndarray | None = None) -> np.ndarray:
    """Inner products ``<Xᵀa_i, Xᵀb_j> = A K Bᵀ`` of coefficient rows ``A`` (p×N), ``B`` (q×N)."""
    A = np.atleast_2d(A)
    B = A if B is None else np.atleast_2d(B)
    return A @ K @ B.T


def cosines(K: np.ndarray, A: np.ndarray, B: np.ndarray | None = None) -> np.ndarray:
    """Cosine matrix between the vectors ``Xᵀa_i`` and ``Xᵀb_j`` (NaN where a norm is 0)."""
    A = np.atleast_2d(A)
    B = A if B is None else np.atleast_2d(B)
    num = inner(K, A, B)
    na = np.sqrt(np.maximum(np.einsum("ij,jk,ik->i", A, K, A), 0.0))
    nb = na if B is A else np.sqrt(np.maximum(np.einsum("ij,jk,ik->i", B, K, B), 0.0))
    return safe_div(num, np.outer(na, nb))


def record_cosines(K: np.ndarray, a: np.ndarray) -> np.ndarray:
    """Cosine of each record ``g_i`` with the vector ``Xᵀa``."""
    num = K @ a
    den = np.sqrt(np.maximum(np.diag(K), 0.0) * max(float(a @ K @ a), 0.0))
    return safe_div(num, den)


def consecutive_cosines(K: np.ndarray) -> np.ndarray:
    """``cos(g_i, g_{i+1})`` for consecutive rows of K (length N-1)."""
    d = np.sqrt(np.maximum(np.diag(K), 0.0))
    return safe_div(np.diag(K, 1), d[:-1] * d[1:])


def safe_div(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    num = np.asarray(num, dtype=np.float64)
    den = np.broadcast_to(np.asarray(den, dtype=np.float64), num.shape)
    out = np.full(num.shape, np.nan)
    ok = den > 1e-300
    out[ok] = num[ok] / den[ok]
    return np.clip(out, -1.0, 1.0)


# ------------------------------------------------------------------- windows
def window_size(n: int, requested: int | None = None) -> int:
    """Records per window: *requested*, or ``max(4, ceil(n / 16))``."""
    return int(requested) if requested else max(4, math.ceil(n / 16))


def window_coefficients(n: int, size: int) -> np.ndarray:
    """Coefficient rows (W×n) of the means of consecutive windows of *size* rows.

    A last window shorter than half a window is merged into the one before.
    """
    starts = list(range(0, n, size))
    if len(starts) > 1 and n - starts[-1] < size / 2:
        starts.pop()
    bounds = [*starts, n]
    W = np.zeros((len(starts), n))
    for w in range(len(starts)):
        W[w, bounds[w]:bounds[w + 1]] = 1.0 / (bounds[w + 1] - bounds[w])
    return W


def mean_coefficients(n: int, rows: np.ndarray) -> np.ndarray:
    """Coefficient vector of the mean of the given rows."""
    a = np.zeros(n)
    rows = np.asarray(rows)
    if rows.size:
        a[rows] = 1.0 / rows.size
    return a


def u_statistic_norm2(K: np.ndarray, rows: np.ndarray) -> float:
    """Unbiased ``|E g|²`` from independent records: ``Σ_{i≠j} K_ij / (n(n-1))``.

    Equals ``|mean|² - tr(Σ̂)/n`` with the unbiased sample covariance, i.e. the
    squared norm of the window mean with the noise floor removed (Hoeffding 1948).
    """
    rows = np.asarray(rows)
    n = rows.size
    if n < 2:
        return math.nan
    sub = K[np.ix_(rows, rows)]
    return float((sub.sum() - np.trace(sub)) / (n * (n - 1)))


def debiased_cosine(K: np.ndarray, rows_a: np.ndarray, rows_b: np.ndarray) -> float:
    """Cosine between the *population* means of two disjoint record sets.

    ``mean_{i∈a, j∈b} K_ij / sqrt(U_a U_b)`` with U-statistic norms: free of the
    attenuation noise puts on the cosine of sample means (the disattenuated
    correlation of Spearman 1904).  NaN where either U is not positive.
    """
    ua, ub = u_statistic_norm2(K, rows_a), u_statistic_norm2(K, rows_b)
    if not (ua > 0 and ub > 0):
        return math.nan
    cross = float(K[np.ix_(rows_a, rows_b)].mean())
    return float(np.clip(cross / math.sqrt(ua * ub), -1.0, 1.0))


# ------------------------------------------------------- sources (mixtures)
@dataclass(frozen=True)
class SourceFit:
    """Least-squares per-source mean gradients, as coefficients over the records.

    ``M = C X`` with ``C = (AᵀA)⁺Aᵀ`` solves ``min_M |X - A M|²`` (``A``: mixture
    rows of the unit's records; a one-hot row for a pure batch, for which the
    row of ``C`` is just ``1_s / n_s``).  ``index`` are the store's source
    indices of the rows of ``C`` (sources absent from these records are dropped).
    """

    A: np.ndarray         # N×S' mixture of the kept sources
    C: np.ndarray         # S'×N
    index: np.ndarray     # S' source indices into ctx.sources
    weight: np.ndarray    # S' total share of each kept source (effective records)
    rank_ok: bool

    @property
    def hat(self) -> np.ndarray:
        return self.A @ self.C


def fit_sources(mixture: np.ndarray) -> SourceFit:
    """Least-squares coefficients of the per-source means for these mixture rows."""
    A = np.asarray(mixture, dtype=np.float64)
    if A.ndim != 2:
        raise SpecError(f"batches/mixture must be (N, S); got shape {A.shape}.")
    present = np.flatnonzero(A.sum(axis=0) > 0)
    A = A[:, present]
    G = A.T @ A
    rank_ok = bool(present.size and np.linalg.matrix_rank(G) == present.size)
    C = np.linalg.pinv(G) @ A.T
    return SourceFit(A=A, C=C, index=present, weight=A.sum(axis=0), rank_ok=rank_ok)


def residual_gram(K: np.ndarray, fit: SourceFit) -> np.ndarray:
    """Gram matrix of the records with their source means removed: ``E K E``, ``E = I - A C``.

    Costs O(N² S) (never forms E K E by N×N products).
    """
    A, C = fit.A, fit.C
    CK = C @ K
    G = CK @ C.T
    ACK = A @ CK
    return K - ACK - ACK.T + A @ G @ A.T


def noise_energy(K: np.ndarray, fit: SourceFit) -> np.ndarray:
    """Per-record noise energy ``|g_i - (A M)_i|² / (1 - h_ii)`` (HC2; MacKinnon & White 1985).

    Unbiased for ``tr Σ_i`` under homoscedastic noise; used to remove the noise
    floor from ``C K Cᵀ``.
    """
    A, C = fit.A, fit.C
    CK = C @ K
    G = CK @ C.T
    resid = np.diag(K) - 2.0 * np.einsum("is,si->i", A, CK) + np.einsum("is,st,it->i", A, G, A)
    h = np.einsum("is,si->i", A, C)
    return np.where(h < 1.0 - 1e-9, resid / np.maximum(1.0 - h, 1e-9), np.nan)


def source_gram(K: np.ndarray, fit: SourceFit, debias: bool = False) -> np.ndarray:
    """``M Mᵀ = C K Cᵀ`` (S'×S'); with *debias*, minus the noise floor ``C diag(r) Cᵀ``."""
    G = fit.C @ K @ fit.C.T
    if debias:
        r = noise_energy(K, fit)
        r = np.where(np.isfinite(r), r, 0.0)
        G = G - (fit.C * r) @ fit.C.T
    return G


def gram_to_cos(G: np.ndarray) -> np.ndarray:
    d = np.sqrt(np.where(np.diag(G) > 0, np.diag(G), np.nan))
    with np.errstate(invalid="ignore"):
        return np.clip(G / np.outer(d, d), -1.0, 1.0)


# ----------------------------------------------------------------- PCA via K
def centred(K: np.ndarray) -> np.ndarray:
    """``H K H`` with ``H = I - 11ᵀ/N``: the Gram matrix of the centred records."""
    r = K.mean(axis=0)
    return K - r[None, :] - r[:, None] + K.mean()


def top_components(Kc: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-*k* eigenpairs of a (centred) Gram matrix, largest first.

    Returns ``(lam, U)``; the scores of the records on component j are
    ``U[:, j] * sqrt(lam[j])`` (kernel PCA, linear kernel).  Dense ``eigh`` up to
    ``LANCZOS_MIN`` records, Lanczos (``eigsh``, seeded start vector) above.
    """
    n = Kc.shape[0]
    k = max(1, min(k, n))
    S = (Kc + Kc.T) / 2.0
    if n >= LANCZOS_MIN and k < n // 4:
        from scipy.sparse.linalg import eigsh

        v0 = np.random.default_rng(0).standard_normal(n)
        lam, U = eigsh(S, k=k, which="LA", v0=v0, tol=1e-8)
        order = np.argsort(lam)
        lam, U = lam[order], U[:, order]
    else:
        from scipy.linalg import eigh

        lam, U = eigh(S, subset_by_index=(n - k, n - 1))
    lam, U = lam[::-1], U[:, ::-1]
    # deterministic sign: the largest-magnitude entry positive
    s = np.sign(U[np.argmax(np.abs(U), axis=0), np.arange(U.shape[1])])
    return np.maximum(lam, 0.0), U * np.where(s == 0, 1.0, s)


LANCZOS_MIN = 768


# ------------------------------------------------------------------ severity
def significance(p: float, n_tests: int) -> float:
    """Significance part of a severity, in [0, 1], Bonferroni-adjusted over the store.

    ``p_adj = min(1, p · n_tests)``; 0 at ``p_adj ≥ 0.01``, 0.5 at ``1e-3``, 1 at
    ``≤ 1e-4`` (linear in ``-log10 p_adj``).  Since a severity is this times an
    effect score ≤ 1, a severity above 0.5 needs ``p_adj < 1e-3``: on a healthy
    store the chance of any such flag from one analysis is below 0.1 %.
    """
    if not np.isfinite(p):
        return 0.0
    padj = min(1.0, max(float(p), 1e-300) * max(int(n_tests), 1))
    return float(np.clip((-math.log10(padj) - 2.0) / 2.0, 0.0, 1.0))


def ramp(x: float, full: float) -> float:
    """``clip(x / full, 0, 1)``; NaN -> 0."""
    return 0.0 if not np.isfinite(x) else float(np.clip(x / full, 0.0, 1.0))


def fmt_p(p: float, floor: float | None = None) -> str:
    """``p < 0.001`` / ``p = 0.012`` for summaries."""
    if not np.isfinite(p):
        return "p n/a"
    if floor is not None and p <= floor * (1 + 1e-9):
        return f"p < {floor * 1.0001:.2g}" if floor >= 1e-3 else f"p < {floor:.1e}"
    return f"p = {p:.2g}" if p >= 1e-3 else f"p = {p:.1e}"


class SeriesPack:
    """Per-unit series of one kind packed into one array, so a store with thousands of
    heads gets a handful of arrays, not thousands.

    ``add(tensor, head, arr)`` per unit; ``to_series(what)`` returns
    ``{what: (U, *max_shape) float64, NaN-padded, what + "_units": JSON of [[tensor, head], ...]}``;
    :func:`unit_series` reads one unit back.
    """

    def __init__(self) -> None:
        self.units: list[list[Any]] = []
        self.arrays: list[np.ndarray] = []

    def add(self, tensor: str, head: int | None, arr: np.ndarray) -> None:
        self.units.append([tensor, None if head is None else int(head)])
        self.arrays.append(np.asarray(arr, dtype=np.float64))

    def to_series(self, what: str) -> dict[str, np.ndarray]:
        if not self.arrays:
            return {}
        ndim = max(a.ndim for a in self.arrays)
        arrs = [a.reshape(a.shape + (1,) * (ndim - a.ndim)) for a in self.arrays]
        shape = tuple(max(a.shape[d] for a in arrs) for d in range(ndim))
        out = np.full((len(arrs), *shape), np.nan)
        for i, a in enumerate(arrs):
            dims: tuple[int, ...] = tuple(a.shape)
            idx: tuple[Any, ...] = (i, *map(slice, dims))
            out[idx] = a
        return {what: out, f"{what}_units": encode_json(self.units)}


def unit_series(series: Mapping[str, np.ndarray], what: str, tensor: str, head: int | None) -> np.ndarray | None:
    """The series *what* of one unit from a :class:`SeriesPack` (None if absent)."""
    arr, raw = series.get(what), series.get(f"{what}_units")
    if arr is None or raw is None:
        return None
    for i, (t, h) in enumerate(decode_json(raw)):
        if t == tensor and h == (None if head is None else int(head)):
            return np.asarray(arr)[i]
    return None


def encode_json(obj: Any) -> np.ndarray:
    """A JSON-able object as a uint8 array, so it travels with the numeric series."""
    import json

    return np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8).copy()


def decode_json(raw: np.ndarray) -> Any:
    import json

    return json.loads(np.asarray(raw, dtype=np.uint8).tobytes().decode())


def encode_names(names: Iterable[str]) -> np.ndarray:
    """Source names as a uint8 array (JSON)."""
    return encode_json(list(names))


def decode_names(raw: np.ndarray | None, n: int) -> list[str]:
    """Inverse of :func:`encode_names`; ``["0", "1", ...]`` when absent or of the wrong length."""
    if raw is not None:
        names = decode_json(raw)
        if len(names) == n:
            return [str(x) for x in names]
    return [str(i) for i in range(n)]


# ---------------------------------------------------------------- options
def parse_options(cls: type[T], raw: Any, name: str) -> T:
    """Build the options dataclass *cls* of analysis *name* (see :func:`base.parse_options`)."""
    return cast(T, base_parse_options(cls, raw, name))


def check_int(name: str, key: str, value: Any, lo: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo:
        raise SpecError(f"The '{key}' option of {name} must be an int >= {lo}; got {value!r}.")


# --------------------------------------------------------------- flag dedupe
def head_of(value: Any) -> int | None:
    """A table's ``head`` cell as ``int`` or ``None`` (pandas may hold NaN or a float)."""
    import pandas as pd

    if value is None or bool(pd.isna(value)):
        return None
    return int(value)


def heads_per_tensor(table: Any) -> dict[str, int]:
    """Number of distinct heads of each head-split tensor in an analysis table."""
    seen: dict[str, set[int]] = {}
    for tensor, head in zip(table["tensor"], table["head"]):
        h = head_of(head)
        if h is not None:
            seen.setdefault(tensor, set()).add(h)
    return {t: len(h) for t, h in seen.items()}


InvolvedHeads = Mapping[tuple[str, tuple[str, ...]], set[int]]


def involved_heads(table: Any, involved: Iterable[bool],
                   by_sources: bool = False) -> dict[tuple[str, tuple[str, ...]], set[int]]:
    """``{(tensor, sources): heads}`` of the head rows of *table* where *involved* is true.

    *involved* (one bool per row) says the head shows the trouble at least
    nominally (an effect in the flagged direction and a raw p-value below 0.05).
    """
    out: dict[tuple[str, tuple[str, ...]], set[int]] = {}
    cols = ("source_a", "source_b") if by_sources else ()
    for (_, r), ok in zip(table.iterrows(), involved):
        h = head_of(r["head"])
        if h is not None and ok:
            key = (r["tensor"], tuple(sorted(str(r[c]) for c in cols)))
            out.setdefault(key, set()).add(h)
    return out


def dedupe_heads(flags: Iterable[Flag], n_heads: Mapping[str, int], involved: InvolvedHeads | None = None,
                 by_sources: bool = True) -> list[Flag]:
    """One story per tensor: head flags *or* the whole-tensor flag, not both.

    For each tensor (and source set, with *by_sources*) of a head-split tensor
    whose whole tensor is flagged: if every head shows the trouble (flagged, or
    *involved* at least nominally), it is tensor-wide and only the whole-tensor
    flag is kept; otherwise the flagged heads localise it and the whole-tensor
    flag, which only dilutes them, is dropped (its severity is quoted in the
    heads' summaries).
    """
    import dataclasses as dc

    groups: dict[tuple[str, tuple[str, ...]], list[Flag]] = {}
    for f in flags:
        groups.setdefault((f.tensor, tuple(sorted(f.sources)) if by_sources else ()), []).append(f)
    out: list[Flag] = []
    for key, fs in groups.items():
        tensor = key[0]
        heads = [f for f in fs if f.head is not None]
        whole = [f for f in fs if f.head is None]
        if not heads or not whole or tensor not in n_heads:
            out.extend(fs)
            continue
        shown = {int(f.head) for f in heads if f.head is not None} | set((involved or {}).get(key, set()))
        if len(shown) >= n_heads[tensor]:
            out.extend(whole)
        else:
            note = f" (whole tensor: severity {whole[0].severity:.2f}, diluted by its other heads)"
            out.extend(dc.replace(f, summary=f.summary.rstrip(".") + note + ".") for f in heads)
    return out
