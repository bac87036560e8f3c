"""SVD spectra of weight snapshots and window-mean gradients, whole tensors and per head.

For every 2-D matrix ``W`` (a weight snapshot, the mean gradient of a window of
records, or one head's block of either) with singular values ``σ_1 ≥ σ_2 ≥ …``:

* stable rank ``‖W‖_F² / ‖W‖_2² = Σσ_i² / σ_1²`` (Rudelson & Vershynin 2007);
* effective rank ``exp(H(p))``, ``p_i = σ_i / Σσ_j`` (Roy & Vetterli 2007, eq. 1);
* top-k share ``Σ_{i≤k} σ_i² / Σσ_i²``;
* spectral-norm growth ``σ_1(last) / σ_1(first)`` across snapshots; in query/key
  projections it is the attention-logit-growth symptom (logits scale with
  ``‖W_q‖ ‖W_k‖``; Dehghani et al. 2023, Wortsman et al. 2023);
* ``alpha``, the power-law exponent of the empirical spectral density of ``WᵀW``
  (eigenvalues ``λ_i = σ_i²``), fitted as WeightWatcher does (Martin & Mahoney
  2021): eigenvalues above 1e-5 are sorted, and for every candidate ``xmin`` the
  continuous maximum-likelihood exponent ``α̂ = 1 + n / Σ ln(λ_i / xmin)``
  (Clauset, Shalizi & Newman 2009, eq. 3.1) and the Kolmogorov–Smirnov distance
  between the tail and the fitted law are computed; the ``xmin`` with the smallest
  distance wins (their §3.3).  Well-trained layers sit in roughly ``2 ≤ α ≤ 6``;
  ``α < 2`` is a very heavy tail (over-fit, ill-conditioned), ``α > 6`` a
  random-like, under-trained layer.

Flags: fast spectral-norm growth in q/k projections, collapse of the stable rank of
window-mean gradients over the run (training mode), alpha outside ``[2, 6]``.

The spectra themselves (singular values, ranks, the power-law fit) are
:mod:`~gradforensics.analysis.kinds.spectral.spectra`; the reads of the pass (weight
snapshots, window-mean gradients, q/k logit scales) :mod:`~gradforensics.analysis.kinds.spectral.reads`;
the flags :mod:`~gradforensics.analysis.kinds.spectral.findings`.

Exact versus approximate: a matrix whose smaller side is at most
:data:`EXACT_MAX_DIM` (4096) gets all its singular values (eigenvalues of its smaller
Gram side, LAPACK, float64;
:func:`~gradforensics.analysis.kinds.spectral.spectra.singular_values`), except the window-mean gradients
before the last window, which need only ``σ_1`` and ``‖W‖_F²`` and get ``σ_1`` by
Lanczos (saved series: ``sv/...`` rows hold ``σ_1`` alone there, ``fro2/...`` every
window's ``‖W‖_F²``); a larger one gets a randomized SVD of its top :data:`RANDOMIZED_K` singular values
(Halko, Martinsson & Tropp 2011, via ``sklearn.utils.extmath.randomized_svd``).
There ``‖W‖_F`` is still exact (sum of squares), so the stable rank is exact up to
the error of ``σ_1``; the effective rank and alpha use the top-k values only, and
the table's ``exact`` column says so.

References
----------
Martin, C. H. & Mahoney, M. W. (2021). Implicit self-regularization in deep neural
    networks. JMLR 22(165); Martin, Peng & Mahoney (2021), Nat. Commun. 12, 4122.
Clauset, A., Shalizi, C. R. & Newman, M. E. J. (2009). Power-law distributions in
    empirical data. SIAM Review 51, 661–703.
Roy, O. & Vetterli, M. (2007). The effective rank. EUSIPCO.
Rudelson, M. & Vershynin, R. (2007). Sampling from large matrices. J. ACM 54(4).
Dehghani, M. et al. (2023). Scaling vision transformers to 22 billion parameters. ICML.
Wortsman, M. et al. (2023). Small-scale proxies for large-scale transformer training
    instabilities. arXiv:2309.14322.
Halko, N., Martinsson, P.-G. & Tropp, J. A. (2011). SIAM Review 53, 217–288.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from gradforensics.analysis.contract.advice import Advice, Finding
from gradforensics.analysis.contract.model import Analysis, AnalysisResult, Flag, Need
from gradforensics.analysis.kinds.spectral.findings import NAME, SpectralOptions, flags
from gradforensics.analysis.kinds.spectral.reads import lazy, partner_of, role_of, slab_reductions
from gradforensics.analysis.kinds.spectral.spectra import (
    EVALS_THRESH,
    Spectrum,
    effective_rank,
    powerlaw_fit,
    stable_ranks,
    top_share,
)
from gradforensics.analysis.toolkit.stats import rank_trends
from gradforensics.analysis.toolkit.units import head_of

if TYPE_CHECKING:
    from collections.abc import Sequence

    from matplotlib.axes import Axes

    from gradforensics.analysis.contract.model import Context

__all__ = ["ADVICE", "ANALYSIS", "COLUMNS", "SpectralAdvice", "compute", "logit_columns", "matrix_row", "plot"]


def matrix_row(tensor: str, head: int | None, matrix: str, spectra: list[Spectrum], records: np.ndarray,
               role: str, top_k: int, trend: tuple[float, float] | None = None) -> dict[str, Any]:
    """One table row: the last point's spectrum, growth and stable rank against the first (*trend*: the stable
    ranks' :func:`~gradforensics.analysis.toolkit.stats.rank_trends`, when the caller has it)."""
    first, last = spectra[0], spectra[-1]
    rel = EVALS_THRESH if matrix == "weight" else EVALS_THRESH * (last.sv[0] ** 2 if last.sv.size else 1.0)
    fit = powerlaw_fit(last.sv ** 2, rel)
    srs = stable_ranks(spectra)
    rho, p = rank_trends([srs], min_n=3)[0] if trend is None else trend
    half = srs[: max(1, srs.size // 2)]
    ref = float(np.median(half))
    steady = srs.size >= 4 and bool(np.all(srs[-2:] < np.min(half)))
    return {
        "tensor": tensor, "head": head, "matrix": matrix, "role": role, "exact": bool(last.exact),
        "n_points": len(spectra), "record_first": int(records[0]), "record_last": int(records[-1]),
        "sigma_max": float(last.sv[0]) if last.sv.size else np.nan,
        "sigma_max_first": float(first.sv[0]) if first.sv.size else np.nan,
        "norm_growth": float(last.sv[0] / first.sv[0]) if first.sv.size and first.sv[0] > 0 else np.nan,
        "stable_rank": float(srs[-1]), "stable_rank_first": float(srs[0]),
        "stable_rank_trend": rho, "stable_rank_trend_p": p,
        "stable_rank_drop": ref / float(srs[-1]) if steady and srs[-1] > 0 else 1.0,
        "effective_rank": effective_rank(last.sv), "top_share": top_share(last, top_k),
        "alpha": fit.alpha, "alpha_xmin": fit.xmin, "alpha_ks": fit.ks, "alpha_n_tail": fit.n_tail,
    }



COLUMNS = ["tensor", "head", "matrix", "role", "exact", "n_points", "record_first", "record_last", "sigma_max",
           "sigma_max_first", "norm_growth", "stable_rank", "stable_rank_first", "stable_rank_trend",
           "stable_rank_trend_p", "stable_rank_drop", "effective_rank", "top_share", "alpha", "alpha_xmin", "alpha_ks", "alpha_n_tail"]


def compute(ctx: Context) -> AnalysisResult:
    import pandas as pd

    opt = ctx.options_for(NAME, SpectralOptions)
    lz = ctx.computed.get(NAME, {})
    todo: list[tuple[str, int | None, str, list[Spectrum], np.ndarray, str, int]] = []
    series: dict[str, np.ndarray] = {}
    for key in sorted(k for k in lz if "_records|" not in k and not k.startswith("qk_logit|")):
        matrix, tensor = key.split("|", 1)
        points: list[dict[int | None, Spectrum]] = lz[key]
        if not points:
            continue
        records = np.asarray(lz[f"{matrix}_records|{tensor}"])
        grads = ctx.require_store().grads
        attrs = grads[tensor].attrs if tensor in grads else {}
        labels = attrs.get("head_labels") or []
        series[f"records/{matrix}/{tensor}"] = records
        for head in points[0]:
            spectra = [pt[head] for pt in points]
            label = labels[head] if head is not None and head < len(labels) else None
            todo.append((tensor, head, matrix, spectra, records,
                         role_of(tensor, str(attrs.get("role", "")), label), opt.top_k))
            tag = "all" if head is None else head
            series[f"sv/{matrix}/{tensor}/{tag}"] = _stack([s.sv for s in spectra])
            series[f"fro2/{matrix}/{tensor}/{tag}"] = np.array([s.fro2 for s in spectra], dtype=np.float64)
    # the stable-rank trends of every row in one stacked pass
    trends = rank_trends([stable_ranks(args[3]) for args in todo], min_n=3)
    rows = [matrix_row(t, h, m, sp, rec, role, k, trend=tr) for (t, h, m, sp, rec, role, k), tr in zip(todo, trends, strict=True)]
    table = pd.DataFrame(rows, columns=COLUMNS)
    logit_columns(table, {k.split("|", 1)[1]: lz[k] for k in lz if k.startswith("qk_logit|")}, series)
    return AnalysisResult(table=table, series=series)


def logit_columns(table: Any, scales: dict[str, list[np.ndarray]], series: dict[str, np.ndarray]) -> None:
    """``logit_scale`` (last snapshot), ``logit_scale_first`` and ``logit_scale_mid`` of the q rows (whole
    tensor: the largest head's); ``qk_pair``: the row's q/k pair has logit scales (k rows too)."""
    for c in ("logit_scale", "logit_scale_first", "logit_scale_mid"):
        table[c] = np.nan
    table["qk_pair"] = False
    for tensor, pts in scales.items():
        arr = np.asarray(pts, dtype=np.float64)
        if arr.ndim != 2 or not arr.size:
            continue
        series[f"logit_scale/{tensor}"] = arr
        pair = {tensor, partner_of(tensor) or tensor}
        table.loc[table["tensor"].isin(pair) & (table["matrix"] == "weight"), "qk_pair"] = True
        for i in table.index[(table["tensor"] == tensor) & (table["matrix"] == "weight")]:
            h = head_of(table.at[i, "head"])
            if h is not None and h >= arr.shape[1]:
                continue
            vals = arr.max(axis=1) if h is None else arr[:, h]
            table.loc[i, ["logit_scale", "logit_scale_first", "logit_scale_mid"]] = (
                vals[-1], vals[0], vals[len(vals) // 2])


def _stack(svs: list[np.ndarray]) -> np.ndarray:
    r = max(s.size for s in svs)
    out = np.full((len(svs), r), np.nan, dtype=np.float32)
    for i, s in enumerate(svs):
        out[i, : s.size] = s
    return out


# --------------------------------------------------------------------------- plot
def plot(result: AnalysisResult, flag: Flag, ax: Axes) -> None:
    """Spectral-norm history (growth), stable rank per window (collapse) or the ESD with its fit (alpha)."""
    reason = flag.evidence.get("reason")
    head = "all" if flag.head is None else flag.head
    matrix = flag.evidence.get("matrix", "weight")
    sv = np.asarray(result.series[f"sv/{matrix}/{flag.tensor}/{head}"], dtype=float)
    rec = np.asarray(result.series[f"records/{matrix}/{flag.tensor}"])
    if reason == "norm_growth":
        ax.plot(rec, sv[:, 0], "o-", label=flag.tensor)
        partner = flag.evidence.get("partner")
        key = f"sv/weight/{partner}/all"
        if partner and key in result.series:
            ax.plot(np.asarray(result.series[f"records/weight/{partner}"]),
                    np.asarray(result.series[key], dtype=float)[:, 0], "s--", label=str(partner))
        ax.set_yscale("log")
        ax.set(xlabel="record", ylabel="spectral norm σ_max",
               title=f"{flag.tensor}: spectral norm grows x{flag.evidence['norm_growth']:.2f} (attention-logit growth)")
        ax.legend(fontsize=7)
    elif reason == "rank_collapse":
        fro2 = result.series.get(f"fro2/{matrix}/{flag.tensor}/{head}")
        # fro2 saved: the rows of sv hold sigma_1 alone for all windows but the last (older stores: every value)
        sr = (np.asarray(fro2, dtype=float) if fro2 is not None else np.nansum(sv ** 2, axis=1)) / sv[:, 0] ** 2
        ax.plot(rec, sr, "o-")
        ax.set(xlabel="record (end of window)", ylabel="stable rank of window-mean gradient",
               title=f"{flag.tensor}: gradient stable rank falls to {sr[-1]:.1f}: updates collapse to few directions")
    else:
        ev = sv[-1][np.isfinite(sv[-1])] ** 2
        ev = ev[ev > EVALS_THRESH]
        bins = np.logspace(np.log10(ev.min()), np.log10(ev.max()), 40)
        h, e = np.histogram(ev, bins=bins, density=True)
        ax.loglog(np.sqrt(e[:-1] * e[1:]), np.where(h > 0, h, np.nan), "o", ms=3, label="ESD of WᵀW")
        fit = powerlaw_fit(ev)
        if np.isfinite(fit.alpha):
            x = np.logspace(np.log10(fit.xmin), np.log10(ev.max()), 20)
            share = fit.n_tail / ev.size
            ax.loglog(x, share * (fit.alpha - 1) / fit.xmin * (x / fit.xmin) ** -fit.alpha, "r-",
                      label=f"power law, alpha={fit.alpha:.2f}")
            ax.axvline(fit.xmin, color="0.5", ls=":", label="xmin")
        ax.set(xlabel="eigenvalue λ = σ²", ylabel="density",
               title=f"{flag.tensor}: ESD tail slope alpha={flag.evidence['alpha']:.2f} (healthy 2-6)")
        ax.legend(fontsize=7)
    ax.title.set_fontsize(9)


@dataclass(frozen=True)
class SpectralAdvice(Advice):
    """Spectral remedies: QK-norm first only for a finding on query/key projections."""

    def remedies_for(self, flags: Sequence[Finding]) -> list[str]:
        items = list(self.remedies)
        if flags and not any(_on_query_or_key(f) for f in flags):
            items = items[1:] + items[:1]           # QK-norm is not the first thing to try on an MLP
        return items


def _on_query_or_key(flag: Finding) -> bool:
    """Whether *flag* is on a query or key projection (its evidence's role, else its module name)."""
    parts = flag.tensor.split(".")
    if len(parts) > 1 and parts[-1] in ("weight", "bias"):
        parts = parts[:-1]
    return flag.evidence.get("role") in ("q", "k") or parts[-1] in ("q_proj", "k_proj", "query", "key", "wq", "wk")


#: What a ``spectral`` flag means and what to try next (the report's advice).
#:
#: References
#: ----------
#: .. [Dehghani2023] M. Dehghani et al., "Scaling Vision Transformers to 22 Billion Parameters", ICML 2023
#:    (QK-norm).
#: .. [Wortsman2023] M. Wortsman et al., "Small-scale proxies for large-scale Transformer training
#:    instabilities", 2023.
#: .. [Chowdhery2022] A. Chowdhery et al., "PaLM: Scaling Language Modeling with Pathways", 2022 (z-loss).
#: .. [Martin2021] C. H. Martin and M. W. Mahoney, "Implicit Self-Regularization in Deep Neural Networks",
#:    JMLR 2021.
ADVICE = SpectralAdvice(
    title="Spectral growth / rank collapse",
    phrase="the spectrum concentrates in a few directions",
    evidence_keys={"norm_growth": "spectral-norm growth", "stable_rank": "stable rank", "alpha": "α",
                   "stable_rank_first": "opening stable rank", "sigma_max": "σ_max"},
    remedies=(
        "For attention q/k weights: normalise queries and keys (QK-norm) or add the auxiliary z-loss; "
        "growing q/k spectra precede attention-logit blow-up.",
        "Otherwise: more weight decay on the named tensors, a lower peak LR, or a smaller LR for them.",
        "A heavy-tailed ESD (alpha < 2) is over-fit/over-trained; alpha > 6 is under-trained (WeightWatcher)."),
    references=("Dehghani et al. 2023, Scaling Vision Transformers to 22B Parameters (QK-norm)",
                "Wortsman et al. 2023, Small-scale proxies for large-scale Transformer training instabilities",
                "Chowdhery et al. 2022, PaLM (z-loss)",
                "Martin & Mahoney 2021, Implicit Self-Regularization in Deep Neural Networks"),
)

ANALYSIS = Analysis(name=NAME, needs=(Need.GRADS, Need.WEIGHTS), compute=compute, flags=flags, plot=plot,
                    kinds={"spectral": ADVICE}, options=SpectralOptions, lazy=lazy, long_history=True,
                    slab_reductions=slab_reductions)
