"""Planning the pass over a 7B-shaped sketch store: how many tasks, how many seconds (no data read).

Issue 28's target: planning a store shaped like a 7B LLaMA (32 layers x 7 weight matrices =
224 tensors, q/k/v/o in 32 heads, sketches of dimension k = 1024, 100,000 records) takes
<= 60 s and <= 200,000 tasks.

The store is built without its bytes: two real records are written through
:class:`~gradforensics.store.writer.StoreWriter` (so every array has the attributes and
chunks the recorder gives it), then every per-record array is grown to ``--records``
rows in the metadata only (unwritten chunks read as zeros), the ``batches/`` arrays are
written in full and the records committed.  The benchmark then runs
:func:`gradforensics.analyze` with the engine's executor replaced by a counter: the graphs
are built exactly as in a real pass (regime, slabs, reductions, lazy analyses) and
counted, and nothing is computed.

    python benchmarks/plan7b.py                         # the 7B shape, 100,000 records
    python benchmarks/plan7b.py --records 10000 --layers 8
    python benchmarks/plan7b.py --records 4000 --n0 4000           # the exact regime at 4,000 records
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import numpy as np  # noqa: E402  (after the BLAS thread limits)

SOURCES = ("zh", "en", "code")
PROJ = {"q": 1, "k": 1, "v": 1, "o": 1, "gate": 2, "up": 2, "down": 2}    # rows per d (gate/up/down: 2.7d ~ 2d)


class Planned(Exception):
    """Raised by the counting executor instead of computing: carries the planned collections."""

    def __init__(self, collections: list[Any]) -> None:
        super().__init__("planned")
        self.collections = collections


def build(path: Path, layers: int, heads: int, k: int, records: int) -> None:
    """A sketch-only training store of *layers* LLaMA blocks, *records* records, with no gradient bytes."""
    from gradforensics.store.heads import HeadSpec
    from gradforensics.store.schema import batch_path, new_meta, sketch_path
    from gradforensics.store.writer import Row, StoreWriter

    meta = new_meta(list(SOURCES), "training", model={"class": "LlamaForCausalLM (shape only)"})
    writer = StoreWriter(path, meta, expected_records=records)
    rng = np.random.default_rng(0)
    for i in range(2):
        rows: dict[str, Row] = {}
        for L in range(layers):
            for p, mult in PROJ.items():
                name = f"model.layers.{L}.{'self_attn' if p in 'qkvo' else 'mlp'}.{p}_proj.weight"
                shape = (4096 * mult, 4096) if p != "down" else (4096, 4096 * 2)
                attrs: dict[str, Any] = {"source_dtype": "bfloat16", "shape": list(shape), "seed": 0, "k": k,
                                         "method": "countsketch", "block": 1 << 20, "encoding": "float32"}
                if p in "qkvo":
                    spec = HeadSpec(heads, axis=1 if p == "o" else 0, role=p)
                    attrs.update(spec.attrs())
                    data = rng.standard_normal((heads, k), dtype=np.float32)
                else:
                    data = rng.standard_normal(k, dtype=np.float32)
                rows[sketch_path(name)] = Row(data, attrs, head_split=p in "qkvo")
        mix = np.zeros(len(SOURCES), np.float32)
        mix[i % len(SOURCES)] = 1
        for field, value in (("step", i), ("loss", 2.0), ("mixture", mix), ("n_samples", 1024), ("rank", 0),
                             ("lr", 3e-4), ("time", float(i))):
            rows[batch_path(field)] = Row(np.asarray(value, dtype=_dtype(field)))
        writer.append(rows)
    writer.flush()
    backend = writer._backend
    for name in list(writer._layout):
        backend.truncate(name, records)                          # metadata only: no chunk is written
    steps = np.arange(records, dtype=np.int64)
    mixture = np.zeros((records, len(SOURCES)), np.float32)
    mixture[steps, steps % len(SOURCES)] = 1
    for field, value in (("step", steps), ("loss", np.full(records, 2.0, np.float32)), ("mixture", mixture),
                         ("n_samples", np.full(records, 1024, np.int32)), ("rank", np.zeros(records, np.int32)),
                         ("lr", np.full(records, 3e-4, np.float32)), ("time", steps.astype(np.float64))):
        backend.write_rows(batch_path(field), 0, value)
    writer._n = records
    writer._commit()
    writer._closed = True
    backend.close()
    writer._lock.release()


def _dtype(field: str) -> Any:
    from gradforensics.store.schema import BATCH_FIELDS

    return BATCH_FIELDS[field]


def plan(path: Path, n0: int | None = None) -> tuple[int, float, dict[str, Any]]:
    """(tasks, seconds, what was planned) of ``gf.analyze`` on *path* (engine option ``long_history=n0``),
    nothing computed."""
    import gradforensics as gf
    from gradforensics.analysis.engine import plan as engine_plan
    from gradforensics.analysis.engine import run as engine_run
    from gradforensics.analysis.engine.options import EngineOptions
    from gradforensics.store.reader import Store

    def count(collections: list[Any], *_args: Any, **_kwargs: Any) -> list[Any]:
        raise Planned(collections)

    real = engine_run.compute_collections
    engine_run.compute_collections = count                                     # the executor, replaced by the counter
    t0 = time.perf_counter()
    try:
        # the chunks were never written: open without checking them (as ``report`` does)
        gf.analyze(Store(path, check_chunks=False), progress=False,
                   options={"engine": {"persist": False, "long_history": n0}})
    except Planned as done:
        seconds = time.perf_counter() - t0
        keys: set[Any] = set()
        for c in done.collections:
            keys.update(c.__dask_graph__().keys())
        store = Store(path, check_chunks=False)
        units = engine_plan.n_units(store)
        # N0 counts the largest tensor's units (whole + heads); a package before that counted them all
        at_once = engine_plan.units_at_once(store)
        engine = EngineOptions(long_history=n0)
        name = "long-history" if engine.long_regime(store.n_records, at_once) else "exact"
        regime = f"{name} (N0 {engine.n0(at_once):,} at {at_once:,} units at once, {units:,} in all)"
        return len(keys), seconds, {"records": store.n_records, "tensors": len(store.tensors), "regime": regime}
    finally:
        engine_run.compute_collections = real
    raise RuntimeError("analyze finished without planning a pass")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--n0", type=int, default=None,
                    help="engine option long_history (N0); at least --records plans the exact regime")
    ap.add_argument("--dir", type=Path, default=None, help="where to build the store (default: a temporary one)")
    args = ap.parse_args(argv)
    where = args.dir or Path(tempfile.mkdtemp(prefix="gf-plan7b-"))
    where.mkdir(parents=True, exist_ok=True)
    path = where / f"plan-{args.layers}x{args.heads}-k{args.k}-n{args.records}.zarr"
    t0 = time.perf_counter()
    if not path.exists():
        build(path, args.layers, args.heads, args.k, args.records)
    built = time.perf_counter() - t0
    tasks, seconds, info = plan(path, args.n0)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{info['tensors']} tensors, {args.heads} heads, k={args.k}, {info['records']:,} records "
          f"(store built in {built:.1f} s), {info['regime']}: planned {tasks:,} tasks in {seconds:.1f} s, peak RSS {rss:.0f} MB "
          f"(target: <= 200,000 tasks, <= 60 s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
