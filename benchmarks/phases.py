"""CPU seconds of the phases of one ``gf.analyze``: the pass, the series analyses, the save.

Analyses a copy of the store (``analyze`` writes its results into the store it reads)
with one worker thread and prints one JSON line: ``pass`` (``engine/run.py::_compute``:
planning and the dask compute), ``series:<name>`` (each loss-curve analysis), ``persist``
(saving the results), ``analyze`` and ``process`` (with the imports) and the peak RSS.
Run it with ``PYTHONPATH`` pointing at the code to measure, e.g. side by side::

    for code in $PWD /tmp/old; do PYTHONPATH=$code python benchmarks/phases.py STORE; done
"""

from __future__ import annotations

import dataclasses
import json
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from _timing import cpu_timed


def main(src: str) -> None:
    t_start = time.process_time()
    from gradforensics.analysis.contract import registry
    from gradforensics.analysis.engine import run

    acc: dict[str, float] = {}

    def timed(key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        return cpu_timed(acc, key, fn)

    run.run_pass = timed("pass", run.run_pass)               # type: ignore[method-assign]
    run._persist = timed("persist", run._persist)            # type: ignore[method-assign]
    for name in ("loss_spectrum", "fractal", "coherence"):
        if name in registry.REGISTRY:
            a = registry.REGISTRY[name]
            registry.REGISTRY[name] = dataclasses.replace(a, compute=timed("series:" + name, a.compute))
    tmp = tempfile.mkdtemp()
    try:
        dst = f"{tmp}/s.zarr"
        shutil.copytree(src, dst)
        t = time.process_time()
        run.analyze(dst, progress=False, options={"engine": {"num_workers": 1}})
        acc["analyze"] = time.process_time() - t
    finally:
        shutil.rmtree(tmp)
    acc["process"] = time.process_time() - t_start
    acc["rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({k: round(v, 2) for k, v in acc.items()}))


if __name__ == "__main__":
    main(sys.argv[1])
