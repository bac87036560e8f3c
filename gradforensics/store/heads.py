"""The head layout of a head-split array: how a tensor is cut into heads, and its attributes.

A :class:`HeadSpec` says how a tensor's head axis is laid out; ``split`` turns
the tensor into ``(H_total, ...)`` blocks, one per head, so the store holds
``(N, H_total, ...)``.  Layouts:

* plain: ``heads`` heads along ``axis`` (PyTorch Linear ``(out, in)``: axis 0);
* fused q|k|v blocks (GPT-2 ``c_attn``, Conv1D ``(in, 3*out)``: axis 1,
  ``fused=3``): heads ordered q0..q{H-1}, k0.., v0..;
* fused, interleaved per head (GPT-NeoX ``query_key_value`` ``(3*out, in)``,
  rows ordered head-major ``[h][q|k|v][d]``): ``interleaved=True``; the result
  is reordered to the same q.., k.., v.. order.

The writer stores :meth:`HeadSpec.attrs` on the array (``heads``, ``split_axis``,
``role``, ``head_labels``, and for fused tensors ``fused``, ``interleaved``,
``heads_per_part``); a reader gets the spec back with :meth:`HeadSpec.from_attrs`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from gradforensics.errors import SpecError

__all__ = ["ROLES", "HeadSpec", "parse_parts"]


ROLES = ("q", "k", "v", "o", "qkv", "kv")


def parse_parts(text: str, heads: int | None = None) -> tuple[tuple[str, int], ...]:
    """``"q8k2v2"`` -> ``(("q", 8), ("k", 2), ("v", 2))``; a role without a count has *heads* heads (``"qkv"``)."""
    parts = re.findall(r"([qkv])(\d*)", text)
    if not parts or "".join(r + c for r, c in parts) != text or len({r for r, _ in parts}) != len(parts):
        raise SpecError(f"fused {text!r}: expected roles q, k, v in order, each once, with or without a head "
                        "count (qkv, kv, q8k2v2).")
    if any(not c for _, c in parts) and heads is None:
        raise SpecError(f"fused {text!r}: a role without a head count needs the head count H.")
    out = tuple((r, int(c) if c else int(heads)) for r, c in parts)  # type: ignore[arg-type]
    if any(n < 1 for _, n in out):
        raise SpecError(f"fused {text!r}: head counts must be >= 1.")
    return out


@dataclass(frozen=True)
class HeadSpec:
    """``heads`` heads per part along ``axis``; ``fused`` parts (q|k|v), maybe ``interleaved`` per head.

    ``parts`` (e.g. ``(("q", 8), ("k", 2), ("v", 2))``: a grouped-query fused q|k|v)
    names consecutive runs of heads of the same size with their own counts; then
    ``heads`` is their sum and ``fused`` is 1 (the split is a plain one).
    """

    heads: int
    axis: int = 0
    role: str | None = None
    fused: int = 1
    interleaved: bool = False
    parts: tuple[tuple[str, int], ...] = ()

    @classmethod
    def of_parts(cls, parts: tuple[tuple[str, int], ...], axis: int = 0, role: str | None = None) -> HeadSpec:
        """Fused roles with their own head counts; equal q|k|v counts become the plain ``fused=3`` layout."""
        roles = "".join(r for r, _ in parts)
        if roles == "qkv" and len({n for _, n in parts}) == 1:
            return cls(parts[0][1], axis, role or "qkv", fused=3)
        return cls(sum(n for _, n in parts), axis, role or (roles if roles in ROLES else "qkv"), parts=parts)

    @property
    def total(self) -> int:
        return self.heads * self.fused

    def labels(self) -> list[str]:
        if self.parts:
            return [f"{r}{h}" for r, n in self.parts for h in range(n)]
        if self.fused == 1:
            return [str(h) for h in range(self.heads)]
        parts = "qkv"[: self.fused] if self.fused <= 3 else [str(i) for i in range(self.fused)]
        return [f"{p}{h}" for p in parts for h in range(self.heads)]

    def attrs(self) -> dict[str, Any]:
        """The array attributes that describe this layout (inverse of :meth:`from_attrs`)."""
        out: dict[str, Any] = {"heads": self.total, "split_axis": self.axis, "role": self.role or "",
                               "head_labels": self.labels()}
        if self.fused > 1:
            out.update(fused=self.fused, interleaved=self.interleaved, heads_per_part=self.heads)
        if self.parts:
            out["parts"] = "".join(f"{r}{n}" for r, n in self.parts)
        return out

    @classmethod
    def from_attrs(cls, attrs: Mapping[str, Any]) -> HeadSpec | None:
        """The spec a head-split array was stored with; ``None`` for an array that is not head-split.

        *attrs* are the array's attributes as :meth:`attrs` wrote them (the store
        checks their types and ranges at open); ``role`` ``""`` reads as ``None``.
        """
        if not attrs.get("heads"):
            return None
        if attrs.get("parts"):
            return cls(int(attrs["heads"]), int(attrs.get("split_axis", 0)), attrs.get("role") or None,
                       parts=parse_parts(str(attrs["parts"])))
        return cls(int(attrs.get("heads_per_part", attrs["heads"])), int(attrs.get("split_axis", 0)),
                   attrs.get("role") or None, int(attrs.get("fused", 1)), bool(attrs.get("interleaved", False)))

    def validate(self, name: str, shape: tuple[int, ...]) -> None:
        if self.axis >= len(shape) or self.axis < -len(shape):
            raise SpecError(f"heads for {name}: axis {self.axis} is out of range for shape {shape}.")
        n = shape[self.axis]
        if n % self.total:
            what = (f"heads for {name}: axis {self.axis} has {n} entries, not divisible by "
                    f"{self.total} heads{f' ({self.fused} fused parts x {self.heads})' if self.fused > 1 else ''}")
            raise SpecError(f"{what}; pass heads={{'{name}': {{'heads': H, 'axis': A}}}} with the right layout.",
                            cli=f"{what}; pass --heads {name}=H:axis=A with the right layout.")

    def split(self, x: np.ndarray) -> np.ndarray:
        """``x`` -> ``(H_total, ...)``: one block per head, the head axis first."""
        ax = self.axis % x.ndim
        n = x.shape[ax]
        d = n // self.total
        if self.interleaved:
            # [h][part][d] along ax -> [part][h][d]
            y = x.reshape((*x.shape[:ax], self.heads, self.fused, d, *x.shape[ax + 1:]))
            y = np.swapaxes(y, ax, ax + 1)
        else:
            y = x.reshape((*x.shape[:ax], self.fused, self.heads, d, *x.shape[ax + 1:]))
        y = y.reshape((*x.shape[:ax], self.total, d, *x.shape[ax + 1:]))
        return np.ascontiguousarray(np.moveaxis(y, ax, 0))

    def merge(self, blocks: np.ndarray) -> np.ndarray:
        """Inverse of :meth:`split` (for tests and for rebuilding a tensor)."""
        a = self.axis % (blocks.ndim - 1)
        y = np.moveaxis(blocks, 0, a)
        shp = y.shape
        d = shp[a + 1]
        if self.interleaved:
            y = y.reshape((*shp[:a], self.fused, self.heads, d, *shp[a + 2:]))
            y = np.swapaxes(y, a, a + 1)
        return y.reshape((*shp[:a], self.total * d, *shp[a + 2:]))
