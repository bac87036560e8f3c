"""Small formatting helpers shared by the CLI, capture and the report."""

from __future__ import annotations

__all__ = ["fmt_bytes"]



def fmt_bytes(n: float) -> str:
    """``1536 -> '1.5 KiB'``: binary units, one decimal (whole bytes below 1 KiB)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
