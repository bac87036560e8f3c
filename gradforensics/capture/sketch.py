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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gradforensics.errors import SpecError

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
