"""The run's own logs joined to imported records (``import --logs DIR``).

For each imported record, :class:`LogJoin` takes what the run logged at its iteration
(:class:`~gradforensics.runlog.RunLog`): the loss and learning rate where the dump has
none, the loss scale and the gradient norm the run computed.  For a gradient dump of a
run that logged a loss scale (fp16), the dumped gradients still carry that scale: they
are divided by the scale their backward pass used (``RunLog.scale_used``: the scale
logged at the iteration before; in float32), so the store holds the gradients the
optimizer unscaled (before any clipping: the dump is taken before the optimizer step).
An iteration the scaler skipped (the log says so, or its unscaled gradient holds inf/NaN)
is marked ``batches/skipped`` - context for the analyses, never a finding.

**The gradient-norm check.**  Where the run logged a gradient norm, the root of the sum of
squares of every gradient in the dump (every tensor of the dump, not only the imported ones)
is compared with it, per record; the ratios are summarised in the store's import metadata
(``extra["import"]["grad_norm_check"]``) and printed by ``inspect``.  A ratio of 1 (within
:data:`AGREE`) says the dump holds the whole, correctly joined, correctly unscaled gradient;
a ratio far from 1 says a shard, a stage or a scale is missing or doubled.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from gradforensics.errors import LogReadError
from gradforensics.importing.records import Interval

if TYPE_CHECKING:
    import torch

    from gradforensics.runlog import RunLog

__all__ = ["AGREE", "LogJoin"]


#: a dump agrees with the logged gradient norm when |sqrt(sum g^2) / logged - 1| is at most this
#: (the run sums in fp32 across ranks in another order; 1e-3 is far below a missing shard's effect)
AGREE = 1e-3


class LogJoin:
    """Joins a :class:`RunLog` (or nothing) to the records of one import.

    Parameters
    ----------
    log
        The run's logs, or None (records get the dump's own metadata only).
    gradients
        The records hold gradients (a Megatron ``wgrads``/``dgrads`` dump): unscale them and check their norm.
    """

    def __init__(self, log: RunLog | None, *, gradients: bool) -> None:
        self.log = log
        self.gradients = gradients
        self.ratios: list[float] = []
        self.skipped: list[int] = []

    @property
    def logged(self) -> bool:
        """Whether records carry the log's fields (``batches/skipped`` ...)."""
        return self.log is not None

    def record(self, step: int, time: float, grads: Mapping[str, torch.Tensor],
               whole: Mapping[str, torch.Tensor] | None = None) -> tuple[Interval, dict[str, torch.Tensor]]:
        """The record's metadata and its gradients (unscaled where the run logged a loss scale).

        *whole* is every tensor of the dump at this iteration (for the norm check; default *grads*).
        """
        import torch

        if self.log is None:
            return Interval(step=step, time=time), dict(grads)
        vals, skipped = self.log.at(step)
        scale = self.log.scale_used(step)
        out = dict(grads)
        factor = 1.0
        if self.gradients and self.log.has_loss_scale:
            if not (math.isfinite(scale) and scale > 0):
                raise LogReadError(f"--logs: no loss scale logged at iteration {step}, so its fp16 gradients cannot "
                                   "be unscaled; log every iteration (Megatron-LM: --tensorboard-log-interval 1 "
                                   "--log-loss-scale-to-tensorboard).")
            factor = 1.0 / scale
            out = {n: g.to(torch.float32) * factor for n, g in grads.items()}
            skipped = skipped or any(not bool(torch.isfinite(g).all()) for g in out.values())
        logged_norm = vals.get("grad_norm", math.nan)
        if self.gradients and not skipped and math.isfinite(logged_norm) and logged_norm > 0:
            sq = sum(float(torch.sum(g.to(torch.float64) ** 2)) for g in (whole or grads).values()
                     if g.is_floating_point())
            if math.isfinite(sq):
                self.ratios.append(math.sqrt(sq) * factor / logged_norm)
        if skipped:
            self.skipped.append(step)
        iv = Interval(step=step, loss=vals.get("loss", math.nan), lr=vals.get("lr", math.nan), time=time,
                      loss_scale=scale, logged_grad_norm=logged_norm, skipped=skipped)
        return iv, out

    def summary(self) -> dict[str, Any]:
        """What the import metadata records of the join (empty without logs)."""
        if self.log is None:
            return {}
        out: dict[str, Any] = {"logs": dict(self.log.origin), "skipped_steps": self.skipped[:1000],
                               "n_skipped": len(self.skipped)}
        if self.ratios:
            r = np.asarray(self.ratios)
            out["grad_norm_check"] = {"records": int(r.size), "median_ratio": float(np.median(r)),
                                      "worst_ratio": float(r[np.argmax(np.abs(r - 1))]),
                                      "agree": bool(np.all(np.abs(r - 1) <= AGREE)), "tolerance": AGREE}
        return out
