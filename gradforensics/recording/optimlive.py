"""Optimizer state from the live loop: ``Recorder(optimizer=opt, optimizer_every=K)``.

Every ``K`` records (record 0 included) the recorder reads ``opt.state`` as it is at
``record()`` (after ``backward()``, before ``opt.step()``: the state the coming update
divides by) and summarises it with the one function that also serves ``capture
--curvature`` and ``import`` (:func:`gradforensics.replay.optimstate.optim_data`, its
g²/v̂ quantiles from the recorded batch's gradient through
:class:`~gradforensics.replay.optimstate.RatioHistogram`).  For every 2-D tensor
it adds, per row (:func:`row_ratios`), with ``v̂ = v/(1-β₂ᵗ)``:

* the quantiles q50, q90, q99 (linear interpolation) and the max over the row of
  ``g²/v̂`` (``g = 0`` counts 0; ``v̂ = 0 < g²`` counts +inf);
* stale rows: ``Σ_row g² > STALE · Σ_row v̂`` with :data:`STALE` = 1e3 - the second
  moment has not seen the gradient the row gets now (an embedding row first seen late:
  its ``v̂`` is ~0 or decayed, the update is ~``lr`` per element whatever ``g`` is).

The stale masks are cheap (two row sums per tensor) and are taken at **every** record once the
state has a step (attr ``every_record``): a row that arrives between two grid records is stale
only at the record of its first gradient, and a grid would miss it.

Stored, per record (NaN off the ``K`` grid; NaN / 0 before the first step):

==================================  ===================  ============================================
``optim_live/summary``              float64 ``(N, T, F)``  ``tensors``, ``fields`` (= ``optim/summary``'s),
                                                         ``hyper``, ``every``, ``stale_threshold``
``optim_live/<tensor>/row_ratio``   float32 ``(N, R, 4)``  q50, q90, q99, max of g²/v̂ per row
``optim_live/<tensor>/stale``       uint8 ``(N, R)``       1 on a stale row (every record; attrs
                                                         ``threshold``, ``every_record``)
==================================  ===================  ============================================
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from gradforensics.errors import SpecError

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["ROW_FIELDS", "STALE", "LiveOptim", "row_ratios", "stale_rows"]

#: A row is stale when its Σ g² exceeds this many times its Σ v̂.
STALE = 1e3
ROW_FIELDS = ("q50", "q90", "q99", "max")


def row_ratios(g: torch.Tensor, v_hat: torch.Tensor, stale: float = STALE) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of 2-D *g* and *v_hat* (on their device): ``(R, 4)`` q50/q90/q99/max of g²/v̂, and the stale mask.

    The ratios and their quantiles are float32 (one sort per row: half the time of float64),
    the row sums of the stale rule float64.
    """
    import torch

    g2 = g.detach().float().pow(2)
    v = v_hat.float()
    big = torch.finfo(torch.float32).max
    r = torch.where(g2 == 0, torch.zeros_like(g2), g2 / v).clamp(max=big)    # x/0 = inf -> the largest float
    q = torch.quantile(r, torch.tensor([0.5, 0.9, 0.99], dtype=r.dtype, device=r.device), dim=1).T
    out = torch.cat([q, r.max(dim=1).values[:, None]], dim=1)
    out = torch.where(out >= big, torch.full_like(out, math.inf), out)
    return out, stale_rows(g, v_hat, stale)


def stale_rows(g: torch.Tensor, v_hat: torch.Tensor, stale: float = STALE) -> torch.Tensor:
    """Per row of 2-D *g* and *v_hat*: ``Σ_row g² > stale · Σ_row v̂`` (and ``g ≠ 0``), from float64 row sums."""
    gs, vs = g.detach().double().pow(2).sum(dim=1), v_hat.double().sum(dim=1)
    return (gs > 0) & (gs > stale * vs)


class LiveOptim:
    """The optimizer's per-tensor and per-row summaries, taken at ``record()`` every ``every`` records."""

    def __init__(self, model: nn.Module, optimizer: Any, every: int) -> None:
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise SpecError(f"optimizer_every must be a positive int; got {every!r}.")
        groups = getattr(optimizer, "param_groups", None)
        if not isinstance(groups, list) or not hasattr(optimizer, "state"):
            raise SpecError(f"optimizer: a {type(optimizer).__name__} is not a torch.optim optimizer "
                            "(no param_groups / state).")
        if not all("betas" in g for g in groups):
            raise SpecError(f"optimizer: {type(optimizer).__name__} is not Adam-family (no betas in its param "
                            "groups); live summaries take Adam, AdamW and the like.")
        self.model, self.opt, self.every = model, optimizer, every
        by_id = {id(p): n for n, p in model.named_parameters()}
        self.params: dict[str, Any] = {}
        self.lrs: dict[str, int] = {}
        for gi, g in enumerate(groups):
            for p in g["params"]:
                if id(p) not in by_id:
                    raise SpecError("optimizer: it holds a parameter that is not the recorded model's; pass the "
                                    "optimizer of this model.")
                self.params[by_id[id(p)]] = p
                self.lrs[by_id[id(p)]] = gi
        self.names = list(self.params)
        from gradforensics.replay.optimstate import hyper_of

        self.hyper = hyper_of({"state": {}, "param_groups": [{k: v for k, v in g.items() if k != "params"}
                                                              for g in groups]}).as_dict()

    def take(self, n_record: int) -> dict[str, tuple[np.ndarray, dict[str, Any]]]:
        """This record's rows ``{path: (array, attrs)}`` (NaN / 0 when it is off the grid or before the first step)."""
        from gradforensics.replay.optimstate import FIELDS, OptimState, RatioHistogram, hyper_of, optim_data

        summary = np.full((len(self.names), len(FIELDS)), np.nan)
        per_row = {n: (np.full((p.shape[0], 4), np.nan, dtype=np.float32), np.zeros(p.shape[0], dtype=np.uint8))
                   for n, p in self.params.items() if p.ndim == 2}
        attrs: dict[str, Any] = {"tensors": self.names, "fields": list(FIELDS), "every": self.every,
                                 "stale_threshold": STALE, "hyper": self.hyper}
        entries = {n: self.opt.state.get(p) for n, p in self.params.items()}
        stepped = all(isinstance(e, Mapping) and "exp_avg_sq" in e and float(e.get("step", 0)) >= 1
                      for e in entries.values())
        live = stepped and n_record % self.every == 0
        if stepped and not live:        # off the grid: the stale masks only (two row sums per tensor)
            for n in per_row:
                p, e = self.params[n], entries[n]
                b2 = float(self.opt.param_groups[self.lrs[n]]["betas"][1])
                if p.grad is not None:
                    st = stale_rows(p.grad, e["exp_avg_sq"] / (1.0 - b2 ** float(e["step"])))
                    per_row[n] = (per_row[n][0], st.to(dtype=_uint8()).cpu().numpy())
        if live:
            groups = self.opt.param_groups
            light = {"state": dict(enumerate(entries.values())),
                     "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in groups]}
            state = OptimState({n: dict(e) for n, e in entries.items()}, hyper_of(light), "live optimizer",
                               f"{type(self.opt).__name__} at record {n_record}",
                               {n: float(groups[gi]["lr"]) for n, gi in self.lrs.items()})
            ratios = RatioHistogram(state)
            ratios.add(self.model)
            data = optim_data(state, self.params, ratios)
            summary = data.summary
            b2 = state.hyper.beta2
            for n in per_row:
                p, e = self.params[n], entries[n]
                if p.grad is None:
                    continue
                t = float(e["step"])
                qt, st = row_ratios(p.grad, e["exp_avg_sq"] / (1.0 - b2 ** t))
                per_row[n] = (qt.float().cpu().numpy(), st.to(dtype=_uint8()).cpu().numpy())
        out: dict[str, tuple[np.ndarray, dict[str, Any]]] = {"optim_live/summary": (summary, attrs)}
        for n, (q, s) in per_row.items():
            out[f"optim_live/{n}/row_ratio"] = (q, {"fields": list(ROW_FIELDS)})
            out[f"optim_live/{n}/stale"] = (s, {"threshold": STALE, "every_record": True})
        return out


def _uint8() -> torch.dtype:
    import torch

    return torch.uint8
