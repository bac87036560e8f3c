"""gradforensics: offline forensics of sick neural-network training runs.

``import gradforensics as gf`` is cheap: torch, dask and matplotlib load only
when the piece that needs them is used.  Every public name below is loaded on
first use from the module that defines it (:data:`_PUBLIC`); no subpackage is
named like one of these functions, so importing a subpackage never rebinds one.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from gradforensics._version import __version__
from gradforensics.errors import GradforensicsError

if TYPE_CHECKING:
    from gradforensics.analysis.contract.model import Findings, Flag
    from gradforensics.analysis.engine.run import analyze
    from gradforensics.importing import import_run
    from gradforensics.recording import Recorder
    from gradforensics.replay.pipeline import capture
    from gradforensics.replay.plan import BatchSpec, ModelSpec, RecordSpec
    from gradforensics.reporting import report
    from gradforensics.reporting.comparison import Comparison
    from gradforensics.runs.compare import compare
    from gradforensics.runs.result import WhatIf
    from gradforensics.runs.whatif import whatif
    from gradforensics.store.location import Location
    from gradforensics.store.reader import Store, open_store

#: public name -> the module that defines it
_PUBLIC: dict[str, str] = {
    "Recorder": "gradforensics.recording",
    "capture": "gradforensics.replay.pipeline",
    "import_run": "gradforensics.importing",
    "BatchSpec": "gradforensics.replay.plan",
    "RecordSpec": "gradforensics.replay.plan",
    "ModelSpec": "gradforensics.replay.plan",
    "open_store": "gradforensics.store.reader",
    "Store": "gradforensics.store.reader",
    "Location": "gradforensics.store.location",
    "analyze": "gradforensics.analysis.engine.run",
    "Findings": "gradforensics.analysis.contract.model",
    "Flag": "gradforensics.analysis.contract.model",
    "report": "gradforensics.reporting",
    "compare": "gradforensics.runs.compare",
    "Comparison": "gradforensics.reporting.comparison",
    "whatif": "gradforensics.runs.whatif",
    "WhatIf": "gradforensics.runs.result",
}

__all__ = ["BatchSpec", "Comparison", "Findings", "Flag", "GradforensicsError", "Location", "ModelSpec", "RecordSpec",
           "Recorder", "Store", "WhatIf", "__version__", "analyze", "capture", "compare", "import_run", "open_store",
           "report", "whatif"]


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'gradforensics' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
