"""``capture --curvature``: curvature and optimizer state at the checkpoint, next to the replayed records.

A :class:`CheckpointProbe` rides along :func:`gradforensics.replay.replay`:
``observe`` after each batch's backward keeps the first ``spec.batches`` batches
of every source and adds the batch's ``g²/v̂`` to the histograms; ``finish``,
after the records are committed, runs Lanczos (:mod:`gradforensics.replay.curvature`)
for the whole model and each block, per source and for the mixture (equal weight
per kept batch), on ``H`` and, with an Adam-family state, on ``P⁻¹H`` (attention
through SDPA's math kernel, which has a double backward); then it
summarises the optimizer state (:mod:`gradforensics.replay.optimstate`) and writes
both groups (:mod:`gradforensics.store.probes`).
"""

from __future__ import annotations

import fnmatch
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from gradforensics._compat import attn_implementation
from gradforensics.errors import CheckpointError, SpecError
from gradforensics.recording.attention import IMPLEMENTATION
from gradforensics.replay.curvature import BASIS_BYTES, basis_budget, blocks_of, largest_k, top_eigenvalues
from gradforensics.replay.optimstate import (
    Hyper,
    OptimState,
    RatioHistogram,
    hyper_of,
    map_state,
    optim_data,
    preconditioner,
    read_optimizer_state,
)

if TYPE_CHECKING:
    from torch import nn

    from gradforensics.store.probes import CurvatureData, OptimData

__all__ = ["MAX_K", "WHOLE_MODEL", "CheckpointProbe", "CurvatureSpec"]

#: The block name of the whole model's rows.
WHOLE_MODEL = "model"
#: The most top eigenvalues ``--curvature-k`` asks for (memory and the parameter count may allow fewer).
MAX_K = 1000


@dataclass(frozen=True)
class CurvatureSpec:
    """What ``--curvature`` computes: blocks (``tensor`` / ``layer``), top-*k*, Lanczos budget, batches per source.

    *tensors*: globs of the parameters that get blocks of their own (default: every
    trainable one); the whole-model rows always take every trainable parameter.
    *optimizer*, *lr*, *momentum*, *beta1*, *beta2*, *eps* override (or, for a
    checkpoint without optimizer state, give) the hyper-parameters.
    """

    blocks: str = "tensor"
    tensors: tuple[str, ...] | None = None
    k: int = 3
    max_iter: int = 40
    tol: float = 1e-3
    batches: int = 2
    optimizer: str | None = None
    lr: float | None = None
    momentum: float | None = None
    beta1: float | None = None
    beta2: float | None = None
    eps: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.tensors, str):
            object.__setattr__(self, "tensors", (self.tensors,))
        elif self.tensors is not None:
            object.__setattr__(self, "tensors", tuple(str(t) for t in self.tensors))
        if self.blocks not in ("tensor", "layer"):
            raise SpecError(f"--curvature-blocks {self.blocks!r}: expected tensor or layer.")
        for name in ("k", "max_iter", "batches"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SpecError(f"curvature {name} must be an integer >= 1; got {v!r}.")
        if not 0 < self.tol < 1:
            raise SpecError(f"curvature tol must be in (0, 1); got {self.tol!r}.")

    def overrides(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("optimizer", "lr", "momentum", "beta1", "beta2", "eps")}

    def check_size(self, n_params: int, budget: int | None = None) -> None:
        """Refuse ``k`` (or ``max_iter``) beyond what Lanczos on *n_params* parameters can hold, in one line.

        The whole-model operator keeps ``min(max(k, max_iter), n)`` float64 vectors of length
        ``n`` (and a stacked copy): at most ``n`` of them, and at most what fits in *budget*
        bytes (default :func:`~gradforensics.replay.curvature.basis_budget`, half the available
        memory); ``k`` is also at most :data:`MAX_K` (each eigenvalue costs Hessian-vector products).
        """
        budget = basis_budget() if budget is None else budget
        fits = largest_k(n_params, budget)
        for flag, v, held, top in (("--curvature-k", self.k, self.k, min(fits, MAX_K)),
                                   ("--curvature-iters", self.max_iter, min(self.max_iter, n_params), fits)):
            if held <= top:
                continue
            if top == MAX_K < fits:
                why = ("Lanczos is for the top of the spectrum: every eigenvalue asked for is at least one more "
                       "Hessian-vector product over the kept batches, for the model and each block")
            elif top == n_params:
                why = f"the model has {n_params:,} trainable parameters"
            else:
                need = BASIS_BYTES * min(v, n_params) * n_params
                why = (f"Lanczos on the model's {n_params:,} parameters would keep {need / 2**30:,.1f} GiB of vectors; "
                       f"{budget / 2**30:,.1f} GiB may be used (half the available memory)")
            raise SpecError(f"{flag} {v}: at most {top} here ({why}).")


class CheckpointProbe:
    """Curvature and optimizer-state measurements of one replay (see the module doc)."""

    def __init__(self, spec: CurvatureSpec, hyper: Hyper, state: OptimState | None = None) -> None:
        self.spec, self.hyper, self.state = spec, hyper, state
        self.kept: dict[str, list[Any]] = {}
        self.ratios = RatioHistogram(state) if state is not None and preconditioner(state) is not None else None

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike[str], model: nn.Module, spec: CurvatureSpec) -> CheckpointProbe:
        """The probe of the checkpoint at *path*: its optimizer state if it has one (mapped to *model*).

        Raises
        ------
        CheckpointError
            A weight of *model* is NaN or infinite (named, before any batch): its Hessian has no eigenvalues.
        """
        check_finite_weights(model)
        spec.check_size(sum(p.numel() for p in model.parameters() if p.requires_grad))
        found = read_optimizer_state(path)
        if found is None:
            probe = cls(spec, hyper_of(None, spec.overrides()))
        else:
            state = map_state(found[0], model, found[1], spec.overrides())
            probe = cls(spec, state.hyper, state)
        probe.warn_no_verdict()
        return probe

    def warn_no_verdict(self) -> None:
        """Say, before the Hessian's cost is paid, when it can give no stability verdict (Adam without v̂)."""
        import warnings

        from gradforensics.errors import CaptureWarning
        from gradforensics.store.probes import NO_STABILITY_VERDICT, no_stability_verdict

        if no_stability_verdict(self.hyper.optimizer, ["hessian"] if self.ratios is None else ["preconditioned"]):
            warnings.warn(f"--curvature under adam: {NO_STABILITY_VERDICT} (exp_avg_sq, saved beside the "
                          "checkpoint as optimizer.pt); the curvature analysis cannot flag this capture.",
                          CaptureWarning, stacklevel=3)

    def observe(self, model: nn.Module, source: str, batch: Any) -> None:
        """After a batch's backward: keep it for the Hessian (the first *batches*), add its g²/v̂."""
        kept = self.kept.setdefault(source, [])
        if len(kept) < self.spec.batches:
            kept.append(batch)
        if self.ratios is not None:
            self.ratios.add(model)

    # ---------------------------------------------------------------- after the records
    def finish(self, model: nn.Module, loss_fn: Callable[[nn.Module, Any], Any], where: Any) -> None:
        """Compute and write ``curvature/`` and ``optim/`` into the store at *where*."""
        from torch.nn.attention import SDPBackend, sdpa_kernel

        from gradforensics.store.probes import write_probes

        model.zero_grad(set_to_none=True)
        attn = attn_implementation(getattr(model, "config", None))
        switch = attn not in (None, "eager", "sdpa", IMPLEMENTATION)   # flash-attention & co. have no double backward
        if switch:
            model.set_attn_implementation("eager")     # type: ignore[operator]
        try:
            with sdpa_kernel([SDPBackend.MATH]):       # fused SDPA kernels have none either; math has
                curvature = self.curvature(model, loss_fn)
        finally:
            if switch:
                model.set_attn_implementation(attn)    # type: ignore[operator]
        write_probes(where, curvature, self.optim(model))

    def curvature(self, model: nn.Module, loss_fn: Callable[[nn.Module, Any], Any]) -> CurvatureData:
        from gradforensics.store.probes import CurvatureData

        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.spec.check_size(sum(p.numel() for p in params.values()))
        chosen = [n for n in params if self.spec.tensors is None
                  or any(fnmatch.fnmatchcase(n, g) for g in self.spec.tensors)]
        if not chosen:
            raise SpecError(f"--curvature-tensors {' '.join(self.spec.tensors or ())}: matches no trainable "
                            f"parameter (e.g. {', '.join(list(params)[:3])}).")
        blocks = {WHOLE_MODEL: list(params), **blocks_of(chosen, self.spec.blocks)}
        pre = None
        if self.state is not None and self.ratios is not None:
            pre = preconditioner(self.state, self.ratios.mean_g2())       # the next step's, with E[g²]
        mixture = [b for kept in self.kept.values() for b in kept]
        groups = {**({s: b for s, b in self.kept.items()} if len(self.kept) > 1 else {}), "": mixture}
        rows, out = [], []
        for source, batches in groups.items():
            losses = [lambda b=b: loss_fn(model, b) for b in batches]
            for block, names in blocks.items():
                for operator in ("hessian", "preconditioned"):
                    if operator == "preconditioned" and (pre is None or any(n not in pre for n in names)):
                        continue
                    t0 = time.perf_counter()
                    res = top_eigenvalues(losses, {n: params[n] for n in names}, k=self.spec.k,
                                          max_iter=self.spec.max_iter, tol=self.spec.tol,
                                          precondition=pre if operator == "preconditioned" else None)
                    row = {"block": block, "tensors": names, "source": source, "operator": operator,
                           "seconds": time.perf_counter() - t0, "batches": len(batches)}
                    if block == WHOLE_MODEL and res.vector is not None:
                        row["mass"] = _mass(res.vector, [params[n].numel() for n in names], names, blocks)
                    rows.append(row)
                    out.append(res)
        k = max(len(r.eigenvalues) for r in out)

        def pad(x: tuple[float, ...]) -> list[float]:
            return [*x, *([float("nan")] * (k - len(x)))]

        return CurvatureData(rows, np.array([pad(r.eigenvalues) for r in out]),
                             np.array([pad(r.residuals) for r in out]),
                             np.array([r.iterations for r in out], dtype=np.int64),
                             np.array([r.converged for r in out], dtype=np.uint8),
                             {"hyper": self.hyper.as_dict(), "blocks": self.spec.blocks, "k": self.spec.k,
                              "max_iter": self.spec.max_iter, "tol": self.spec.tol,
                              "lrs": _lrs(None if self.spec.lr is not None else self.state,
                                          self.hyper, blocks)})

    def optim(self, model: nn.Module) -> OptimData | None:
        if self.state is None:
            return None
        return optim_data(self.state, model, self.ratios)


def check_finite_weights(model: nn.Module) -> None:
    """Refuse, naming the tensors, a model whose trainable weights hold NaN or infinite values.

    Such a loss has no Hessian spectrum, and the preconditioner built from its gradients is not
    finite either: said here, before any batch, rather than as a preconditioner failure after them.
    """
    import torch

    bad = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        w = p.detach()
        n_nan, n_inf = int(torch.isnan(w).sum()), int(torch.isinf(w).sum())
        if n_nan or n_inf:
            what = " and ".join(f"{n} {k}" for n, k in ((n_nan, "NaN"), (n_inf, "infinite")) if n)
            bad.append(f"{name} ({what} of {w.numel()})")
    if not bad:
        return
    more = f" and {len(bad) - 3} more tensors" if len(bad) > 3 else ""
    what = (f"the checkpoint's weights are not finite: {', '.join(bad[:3])}{more}; a loss with non-finite weights "
            "has no Hessian eigenvalues")
    raise CheckpointError(f"curvature=: {what}. Capture without curvature= to record its gradients.",
                          cli=f"--curvature: {what}. Capture without --curvature to record its gradients.")


def _lrs(state: OptimState | None, hyper: Hyper, blocks: Mapping[str, list[str]]) -> dict[str, float]:
    """Each block's learning rate: its param group's (the largest over its tensors), else the hyper's."""
    if state is None or not state.lrs:
        return {b: hyper.lr for b in blocks}
    return {b: max(state.lrs.get(n, hyper.lr) for n in names) for b, names in blocks.items()}


def _mass(vector: Any, sizes: list[int], names: list[str], blocks: Mapping[str, list[str]]) -> dict[str, float]:
    """The share of the top eigenvector's squared norm in each block (blocks other than the whole model)."""
    import torch

    per = dict(zip(names, (float(c.pow(2).sum()) for c in torch.split(vector, sizes))))
    total = sum(per.values()) or 1.0
    return {b: sum(per.get(n, 0.0) for n in ns) / total for b, ns in blocks.items() if b != WHOLE_MODEL}
