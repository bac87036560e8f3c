"""Exploding gradients through time: the spectral norm of a recurrent weight jumping between snapshots.

A recurrent layer ``h_t = f(W_ih x_t + W_hh h_{t-1})`` back-propagates through the product of its
per-step Jacobians ``diag(f') W_hh``, so ``‖∂h_t / ∂h_k‖ ≤ (γ σ_1(W_hh))^{t-k}`` with ``γ`` a bound
on ``|f'|`` (Pascanu, Mikolov & Bengio 2013, eq. 7).  Where the gradient meets a cliff of the loss
surface it jumps by orders of magnitude, and an unclipped step of that size throws ``W_hh`` far
from where it was: its spectral norm, the factor that compounds at every time step, jumps by an
order of magnitude within one snapshot interval, and the loss climbs (their section 3).  A healthy
run moves a weight by a fraction of its norm per interval; from a small initialisation the first
interval of a clipped run at a large learning rate triples it at most (docs/spectral.md, family
``gru-lm``).

The statistic, per recurrent weight (PyTorch's ``weight_hh_l<k>`` of ``nn.RNN``, ``nn.GRU`` and
``nn.LSTM``, whose parameters carry that name whatever the model): the largest ratio
``σ_1(t_{i+1}) / σ_1(t_i)`` over consecutive weight snapshots, with its records.  Severity
:func:`jump_severity`: 0 up to no growth, 0.5 at ten-fold within one interval, 1 at a hundred-fold
(log scale).  Other weights are left to the other statistics: only ``W_hh`` compounds through time.

References
----------
Pascanu, R., Mikolov, T. & Bengio, Y. (2013). On the difficulty of training recurrent neural
    networks. ICML (eq. 7; section 3, gradient clipping).
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any

import numpy as np

from gradforensics.analysis.contract.model import Flag

if TYPE_CHECKING:
    from gradforensics.analysis.contract.model import AnalysisResult

__all__ = ["JUMP_HALF", "is_recurrent", "jump_severity", "largest_jump", "recurrent_flags"]

#: Growth of a recurrent weight's spectral norm within one snapshot interval that scores 0.5 (an order of
#: magnitude); its square scores 1.
JUMP_HALF = 10.0
_RECURRENT = re.compile(r"(^|\.)weight_hh_l\d+(_reverse)?$")


def is_recurrent(tensor: str) -> bool:
    """Whether *tensor* is the hidden-to-hidden weight of a PyTorch RNN / GRU / LSTM layer."""
    return bool(_RECURRENT.search(tensor))


def largest_jump(sigma: np.ndarray) -> tuple[float, int]:
    """The largest ratio of consecutive values of *sigma* (spectral norms by snapshot) and the index of the snapshot
    it ends at; ``(nan, -1)`` with fewer than two positive finite values."""
    s = np.asarray(sigma, dtype=np.float64)
    if s.size < 2:
        return math.nan, -1
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where((s[:-1] > 0) & np.isfinite(s[:-1]) & np.isfinite(s[1:]), s[1:] / s[:-1], np.nan)
    if not np.isfinite(r).any():
        return math.nan, -1
    i = int(np.nanargmax(r))
    return float(r[i]), i + 1


def jump_severity(jump: float, half: float = JUMP_HALF) -> float:
    """0 at no growth, 0.5 at *half*-fold within one interval, 1 at its square (log scale in between)."""
    if not np.isfinite(jump) or jump <= 1.0:
        return 0.0
    return float(min(1.0, 0.5 * math.log(jump) / math.log(half)))


def recurrent_flags(result: AnalysisResult, min_severity: float) -> list[Flag]:
    """One ``spectral`` flag per recurrent weight whose spectral norm jumped (module docstring)."""
    out = []
    for tensor in sorted({str(t) for t in result.table["tensor"]} if len(result.table) else ()):
        sv = result.series.get(f"sv/weight/{tensor}/all")
        rec = result.series.get(f"records/weight/{tensor}")
        if not is_recurrent(tensor) or sv is None or rec is None:
            continue
        sigma = np.asarray(sv, dtype=np.float64)[:, 0]
        jump, at = largest_jump(sigma)
        sev = jump_severity(jump)
        if sev < min_severity:
            continue
        records = np.asarray(rec)
        out.append(_flag(tensor, sev, jump, sigma, records, at))
    return out


def _flag(tensor: str, sev: float, jump: float, sigma: np.ndarray, records: np.ndarray, at: int) -> Flag:
    a, b = int(records[at - 1]), int(records[at])
    ev: dict[str, Any] = {"reason": "recurrent_jump", "matrix": "weight", "jump": jump, "sigma_before": sigma[at - 1],
                          "sigma_after": sigma[at], "sigma_max": float(np.nanmax(sigma)),
                          "norm_growth": float(sigma[-1] / sigma[0]) if sigma[0] > 0 else math.nan,
                          "role": "recurrent", "cause": "learning_rate"}
    summary = (f"{tensor}: the recurrent weight's spectral norm grew x{jump:.3g} ({sigma[at - 1]:.3g} -> "
               f"{sigma[at]:.3g}) between records {a} and {b}; it bounds how fast gradients grow at every step "
               "back through time, ")
    if sev >= 0.5:
        summary += ("so this is a step thrown by an exploding gradient (Pascanu et al. 2013): clip the gradient "
                    "norm (torch.nn.utils.clip_grad_norm_) or lower the learning rate.")
    else:
        summary += (f"and less than {JUMP_HALF:g}-fold in one interval is what a healthy run's early steps do: "
                    "context, not a problem of this run.")
    return Flag(kind="spectral", tensor=tensor, head=None, sources=(), severity=float(sev), records=(a, b),
                evidence=ev, summary=summary)
