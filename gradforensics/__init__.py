"""gradforensics: offline forensics of sick neural-network training runs.

``import gradforensics as gf`` is cheap: torch, dask and matplotlib load only
when the piece that needs them is used.
"""

from __future__ import annotations

from typing import Any

from gradforensics._version import __version__
from gradforensics.errors import GradforensicsError

__all__ = ["GradforensicsError", "Recorder", "__version__", "analyze", "capture", "compare", "open_store", "report",
           "whatif"]


def __getattr__(name: str) -> Any:
    if name == "Recorder":
        from gradforensics.capture import Recorder

        return Recorder
    if name == "open_store":
        from gradforensics.store.reader import open_store

        return open_store
    if name == "capture":     # the capture package, callable as gradforensics.replay.pipeline.capture
        import gradforensics.capture

        return gradforensics.capture
    if name == "analyze":
        from gradforensics.analysis.engine import analyze

        return analyze
    if name == "compare":
        from gradforensics.compare_runs import compare

        return compare
    if name == "report":
        from gradforensics.report import report

        return report
    if name == "whatif":
        from gradforensics.arms.run import whatif

        return whatif
    raise AttributeError(f"module 'gradforensics' has no attribute {name!r}")
