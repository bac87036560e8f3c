"""Top Hessian eigenvalues at a checkpoint by Lanczos on Hessian-vector products.

The loss Hessian ``H`` is never formed: :class:`HessianOperator` applies it to a
vector by double backward (``d/dθ (∇L · v)``, Pearlmutter 1994), summed over the
replayed batches with their weights.  Restricted to one block ``b`` of parameters
(a tensor, or a layer's tensors) it applies the diagonal block ``H_bb``: the
gradient of ``∇_b L · v_b`` is taken with respect to the block only.

With an Adam-family state, the *preconditioned* sharpness is the top eigenvalue of
``P⁻¹H``, ``P = diag(√v̂ + ε)`` with ``v̂ = v / (1 - β₂ᵗ)`` (Cohen et al. 2022,
"Adaptive gradient methods at the edge of stability").  ``P⁻¹H`` is not symmetric
but is similar to ``P^{-1/2} H P^{-1/2}``, which is; Lanczos runs on that.

:func:`lanczos` is plain Lanczos with full reorthogonalisation (float64 on the
flattened vector).  A Ritz pair ``(θ, y)`` of the tridiagonal ``T_m`` has residual
``‖A x - θ x‖ = |β_m y_m|``; the top *k* are converged when every residual is at
most ``tol · max(|θ_1|, tiny)``.  The iteration stops there, at an invariant
subspace (``β ≈ 0``), or after ``max_iter`` products.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gradforensics.errors import SpecError

if TYPE_CHECKING:
    import torch

__all__ = ["BASIS_BYTES", "HessianOperator", "LanczosResult", "basis_budget", "blocks_of", "lanczos", "largest_k",
           "preconditioned", "top_eigenvalues"]

Vector = Any        # a flat float64 torch tensor

#: host bytes per parameter and Lanczos vector: the float64 basis and the stacked copy reorthogonalisation makes
BASIS_BYTES = 16


def basis_budget() -> int:
    """The host memory the Lanczos basis may take: half of what is available now (``MemAvailable``, else free pages)."""
    import os

    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024 // 2
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (OSError, ValueError, AttributeError):
        return 8 << 30


def largest_k(n: int, budget: int) -> int:
    """The most Lanczos vectors (eigenvalues, iterations) an operator on ``R^n`` can keep within *budget* bytes."""
    return max(0, min(n, budget // (BASIS_BYTES * max(n, 1))))


@dataclass(frozen=True)
class LanczosResult:
    """The top-*k* Ritz values (descending), their residuals, iterations run and whether they converged."""

    eigenvalues: tuple[float, ...]
    residuals: tuple[float, ...]
    iterations: int
    converged: bool
    vector: Any = field(default=None, repr=False, compare=False)    # top Ritz vector (flat float64), or None


def _ritz(alphas: list[float], betas: list[float], basis: list[Vector], k: int) -> tuple[Any, Any, Any]:
    """Ritz values (descending), residual bounds and the top Ritz vector of the tridiagonal so far."""
    import torch

    m = len(alphas)
    t = torch.diag(torch.tensor(alphas, dtype=torch.float64))
    if m > 1:
        off = torch.tensor(betas[: m - 1], dtype=torch.float64)
        t += torch.diag(off, 1) + torch.diag(off, -1)
    theta, y = torch.linalg.eigh(t)
    order = torch.argsort(theta, descending=True)[:k]
    last_beta = betas[m - 1] if len(betas) >= m else 0.0
    resid = (last_beta * y[m - 1, order]).abs()
    top = torch.stack(basis[:m], dim=1) @ y[:, order[0]]
    return theta[order], resid, top


def lanczos(apply: Callable[[Vector], Vector], n: int, *, k: int = 1, max_iter: int = 50, tol: float = 1e-6,
            seed: int = 0, dtype: Any = None) -> LanczosResult:
    """The *k* largest (algebraic) eigenvalues of the symmetric operator *apply* on ``R^n``.

    *apply* maps a flat float64 tensor of length *n* to one.  Full
    reorthogonalisation; the convergence test runs every iteration from ``k``
    on (``T_m``'s eigenproblem is ``m x m``, negligible beside a product).
    """
    import torch

    if n < 1 or k < 1 or max_iter < 1:
        raise SpecError(f"lanczos: n, k and max_iter must be >= 1; got {n}, {k}, {max_iter}.")
    k = min(k, n)
    max_iter = max(min(max_iter, n), k)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, generator=gen, dtype=torch.float64)
    q /= q.norm()
    basis: list[Vector] = [q]
    alphas: list[float] = []
    betas: list[float] = []
    theta = resid = top = None
    for it in range(1, max_iter + 1):
        w = apply(basis[-1]).to(torch.float64)
        alpha = float(w @ basis[-1])
        if not math.isfinite(alpha) or not bool(torch.isfinite(w).all()):
            nan = (float("nan"),) * k
            return LanczosResult(nan, nan, it, False, None)     # a non-finite loss or gradient: no spectrum
        alphas.append(alpha)
        stack = torch.stack(basis, dim=1)
        for _ in range(2):                              # twice is enough (Kahan-Parlett)
            w = w - stack @ (stack.T @ w)
        beta = float(w.norm())
        betas.append(beta)
        if it >= k:
            theta, resid, top = _ritz(alphas, betas, basis, k)
            scale = max(float(theta.abs().max()), 1e-30)
            if bool((resid <= tol * scale).all()) or beta <= 1e-12 * scale:
                return LanczosResult(tuple(map(float, theta)), tuple(map(float, resid)), it, True, top)
        if beta <= 1e-300 or it == max_iter:
            break
        basis.append(w / beta)
    if theta is None:
        theta, resid, top = _ritz(alphas, betas, basis, k)
    assert resid is not None
    scale = max(float(theta.abs().max()), 1e-30)
    ok = bool((resid <= tol * scale).all())
    return LanczosResult(tuple(map(float, theta)), tuple(map(float, resid)), len(alphas), ok, top)


class HessianOperator:
    """``v -> Σ_i w_i H_i v`` over the batches, on the parameters *params* (``{name: tensor}``).

    *losses* are callables returning each batch's scalar loss (a fresh forward
    each); *weights* default to equal weights summing to 1 (the mixture's mean
    loss).  The gradients with their graphs are kept (``cache=True``, one graph
    per batch in memory) or recomputed at every product (``cache=False``).
    """

    def __init__(self, losses: Sequence[Callable[[], Any]], params: Mapping[str, torch.Tensor], *,
                 weights: Sequence[float] | None = None, cache: bool = True) -> None:
        if not losses:
            raise SpecError("HessianOperator: no batch to take the Hessian of.")
        self.names = list(params)
        self.params = [params[n] for n in self.names]
        self.sizes = [p.numel() for p in self.params]
        self.n = sum(self.sizes)
        self.losses = list(losses)
        self.weights = list(weights) if weights is not None else [1.0 / len(losses)] * len(losses)
        self.cache = cache
        self._grads: list[tuple[Any, ...]] | None = None
        self.products = 0

    def _gradients(self, i: int) -> tuple[Any, ...]:
        import torch

        if self.cache and self._grads is not None:
            return self._grads[i]
        loss = self.losses[i]()
        grads = torch.autograd.grad(loss, self.params, create_graph=True, allow_unused=True)
        grads = tuple(torch.zeros_like(p) if g is None else g for g, p in zip(grads, self.params))
        return grads

    def _fill_cache(self) -> None:
        if self.cache and self._grads is None:
            self._grads = [self._gradients(i) for i in range(len(self.losses))]

    def __call__(self, v: Vector) -> Vector:
        import torch

        self._fill_cache()
        parts = [c.view_as(p).to(p.dtype) for c, p in zip(torch.split(v, self.sizes), self.params)]
        total = torch.zeros(self.n, dtype=torch.float64, device=v.device)
        for i, w in enumerate(self.weights):
            grads = self._gradients(i)
            live = [(g, p, c) for g, p, c in zip(grads, self.params, parts) if g.requires_grad]
            if not live:
                continue
            hv = torch.autograd.grad([g for g, _, _ in live], self.params, [c for _, _, c in live],
                                     retain_graph=self.cache, allow_unused=True)
            flat = torch.cat([(torch.zeros_like(p) if h is None else h).reshape(-1).to(torch.float64)
                              for h, p in zip(hv, self.params)])
            total += w * flat
        self.products += 1
        return total

    def release(self) -> None:
        """Drop the cached graphs."""
        self._grads = None


def preconditioned(apply: Callable[[Vector], Vector], diag: Vector) -> Callable[[Vector], Vector]:
    """``v -> D A D v`` with ``D = diag(diag)^{-1/2}``: symmetric, same spectrum as ``diag⁻¹ A``."""
    d = diag.to("cpu").double().rsqrt()

    def op(v: Vector) -> Vector:
        return d.to(v.device) * apply(d.to(v.device) * v)

    return op


def blocks_of(names: Sequence[str], by: str = "tensor") -> dict[str, list[str]]:
    """Blocks of parameter *names*: one per tensor, or (``by="layer"``) one per layer (the name less its leaf).

    ``model.layers.3.mlp.up_proj.weight`` is in layer ``model.layers.3.mlp.up_proj``
    under ``"layer"`` (the module that owns the tensor: its weight and bias together).
    """
    if by == "tensor":
        return {n: [n] for n in names}
    if by != "layer":
        raise SpecError(f"--curvature-blocks {by!r}: expected tensor or layer.")
    out: dict[str, list[str]] = {}
    for n in names:
        out.setdefault(n.rpartition(".")[0] or n, []).append(n)
    return out


def top_eigenvalues(losses: Sequence[Callable[[], Any]], params: Mapping[str, torch.Tensor], *, k: int = 1,
                    max_iter: int = 50, tol: float = 1e-6, seed: int = 0, weights: Sequence[float] | None = None,
                    precondition: Mapping[str, torch.Tensor] | None = None, cache: bool = True) -> LanczosResult:
    """Top-*k* eigenvalues of the loss Hessian on *params* (optionally of ``P⁻¹H``, *precondition* = P's diagonal)."""
    import torch

    op = HessianOperator(losses, params, weights=weights, cache=cache)
    apply: Callable[[Vector], Vector] = op
    if precondition is not None:
        missing = [n for n in op.names if n not in precondition]
        if missing:
            raise SpecError(f"preconditioner: no diagonal for {missing[0]}; it covers {len(precondition)} tensors.")
        parts = [precondition[n].detach().reshape(-1).double().cpu() for n in op.names]
        bad = [n for n, d in zip(op.names, parts, strict=True) if not bool(((d > 0) & torch.isfinite(d)).all())]
        if bad:
            more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
            raise SpecError(f"preconditioner: P = sqrt(v_hat) + eps is not finite and > 0 for {', '.join(bad[:3])}"
                            f"{more} (its optimizer state exp_avg_sq, or the replayed gradients, hold NaN or "
                            "infinite values); no preconditioned sharpness for them.")
        diag = torch.cat(parts)
        apply = preconditioned(op, diag)
    dev = op.params[0].device

    def on_device(v: Vector) -> Vector:
        return apply(v.to(dev)).cpu()

    try:
        return lanczos(on_device, op.n, k=k, max_iter=max_iter, tol=tol, seed=seed)
    finally:
        op.release()
