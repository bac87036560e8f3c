"""Seeded random projections ("sketches") of flattened gradients.

A sketch keeps ``k`` numbers per record (per head) instead of the whole tensor;
inner products and cosines between records are preserved in expectation, with
error of about ``sqrt((1 + cos^2) / k)`` (Johnson-Lindenstrauss).  The projection
is never stored: it is regenerated block by block from ``(seed, block)``.

``countsketch`` (default): each coordinate ``j`` goes to bucket ``h(j)`` with
sign ``s(j)``; ``y = S g`` is O(d), unbiased for inner products
(Charikar et al. 2002; Woodruff 2014).  ``gaussian``: ``y = P^T g / sqrt(k)``
with ``P_ij ~ N(0, 1)`` drawn from ``default_rng([seed, block])``; exact JL but
O(d k), for small tensors.

:class:`DeviceSketch` computes the same countsketch with torch on the tensor's
own device (CUDA where the model is, the CPU otherwise): the hash of each block
is the NumPy one, moved to the device once, so only the ``k`` floats of a sketch
cross to the host.  It matches :meth:`Sketcher.project` to float32 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from gradforensics.errors import SpecError

if TYPE_CHECKING:
    import torch

    from gradforensics.store.heads import HeadSpec

__all__ = ["BLOCK", "METHODS", "DeviceSketch", "Sketcher", "split_torch"]


BLOCK = 1 << 20
METHODS = ("countsketch", "gaussian")


@dataclass
class Sketcher:
    k: int
    seed: int = 0
    method: str = "countsketch"
    _cache: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = field(default_factory=dict, repr=False)
    cache_limit_bytes: int = 256 << 20
    _cached_bytes: int = 0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise SpecError(f"sketch method must be one of {METHODS}; got {self.method!r}.")
        if self.k < 1:
            raise SpecError(f"sketch k must be >= 1; got {self.k}.")

    def attrs(self) -> dict[str, Any]:
        return {"seed": self.seed, "k": self.k, "method": self.method, "block": BLOCK}

    def _hash(self, block: int, size: int) -> tuple[np.ndarray, np.ndarray]:
        key = (block, size)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        rng = np.random.default_rng([self.seed, block])
        idx = rng.integers(0, self.k, size=size, dtype=np.int64)
        sign = rng.integers(0, 2, size=size, dtype=np.int8) * 2 - 1
        out = (idx, sign.astype(np.float32))
        if self._cached_bytes + size * 12 <= self.cache_limit_bytes:
            self._cache[key] = out
            self._cached_bytes += size * 12
        return out

    def project(self, g: np.ndarray) -> np.ndarray:
        """Sketch of the flattened array *g*: float32 ``(k,)``."""
        flat = np.asarray(g, dtype=np.float32).reshape(-1)
        out = np.zeros(self.k, dtype=np.float64)
        for b, start in enumerate(range(0, flat.size, BLOCK)):
            part = flat[start:start + BLOCK]
            if self.method == "countsketch":
                idx, sign = self._hash(b, part.size)
                out += np.bincount(idx, weights=(part * sign).astype(np.float64), minlength=self.k)
            else:
                p = np.random.default_rng([self.seed, b]).standard_normal((part.size, self.k), dtype=np.float32)
                out += (part @ p).astype(np.float64) / np.sqrt(self.k)
        return out.astype(np.float32)

    def project_heads(self, blocks: np.ndarray) -> np.ndarray:
        """Sketch each head's block: ``(H, ...)`` -> ``(H, k)``."""
        return np.stack([self.project(b) for b in blocks])


class DeviceSketch:
    """Countsketches of torch tensors on their own device, equal to :class:`Sketcher`'s.

    Accumulates in float64 (as NumPy's ``bincount`` does); per head through
    :func:`split_torch`, the torch twin of :meth:`HeadSpec.split`.
    """

    def __init__(self, sketcher: Sketcher) -> None:
        if sketcher.method != "countsketch":
            raise SpecError("DeviceSketch: only the countsketch is computed on the device; the gaussian sketch "
                            "runs on the host.")
        self.sketcher = sketcher
        self._hashes: dict[tuple[str, int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def _hash(self, device: torch.device, block: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        key = (str(device), block, size)
        hit = self._hashes.get(key)
        if hit is None:
            idx, sign = self.sketcher._hash(block, size)
            hit = (torch.from_numpy(idx).to(device), torch.from_numpy(sign).to(device, torch.float64))
            if sum(i.numel() for i, _ in self._hashes.values()) * 16 < self.sketcher.cache_limit_bytes:
                self._hashes[key] = hit
        return hit

    def project(self, t: torch.Tensor) -> torch.Tensor:
        """Sketch of the flattened tensor *t*: float64 ``(k,)`` on *t*'s device."""
        import torch

        flat = t.detach().reshape(-1)
        out = torch.zeros(self.sketcher.k, dtype=torch.float64, device=t.device)
        for b, start in enumerate(range(0, flat.numel(), BLOCK)):
            part = flat[start:start + BLOCK]
            idx, sign = self._hash(t.device, b, part.numel())
            out.index_add_(0, idx, part.to(torch.float32).to(torch.float64) * sign)
        return out

    def project_heads(self, t: torch.Tensor, spec: HeadSpec | None) -> torch.Tensor:
        """``(k,)`` for an unsplit tensor, ``(H, k)`` per head; float64 on *t*'s device."""
        import torch

        if spec is None:
            return self.project(t)
        return torch.stack([self.project(b) for b in split_torch(spec, t)])

    def project_rows(self, t: torch.Tensor) -> torch.Tensor:
        """``(E, k)``: each block along axis 0 sketched on its own (the experts of a mixture-of-experts unit)."""
        import torch

        return torch.stack([self.project(b) for b in t])


def split_torch(spec: HeadSpec, x: torch.Tensor) -> torch.Tensor:
    """:meth:`HeadSpec.split` for a torch tensor: ``(H_total, ...)``, one block per head."""
    ax = spec.axis % x.ndim
    d = x.shape[ax] // spec.total
    if spec.interleaved:
        y = x.reshape((*x.shape[:ax], spec.heads, spec.fused, d, *x.shape[ax + 1:])).transpose(ax, ax + 1)
    else:
        y = x.reshape((*x.shape[:ax], spec.fused, spec.heads, d, *x.shape[ax + 1:]))
    y = y.reshape((*x.shape[:ax], spec.total, d, *x.shape[ax + 1:]))
    return y.movedim(ax, 0)
