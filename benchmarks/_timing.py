"""CPU clocks around functions, for the benchmarks that say where ``gf.analyze`` spends its time."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def cpu_timed(acc: dict[str, float], key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """*fn*, adding the process CPU seconds (every thread) of each call to ``acc[key]``."""
    def wrapped(*a: Any, **k: Any) -> Any:
        t = time.process_time()
        try:
            return fn(*a, **k)
        finally:
            acc[key] = acc.get(key, 0.0) + time.process_time() - t
    return wrapped
