"""Megatron-LM gradient dumps (placeholder while being written)."""

from __future__ import annotations

__all__: list[str] = []
