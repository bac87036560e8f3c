"""How the report fills its overview, held against an oracle.

* the overview's matrix and the layer table -> each cell is the largest severity of the flags
  on it (0 where the analysis covered the unit without a flag), written out here flag by flag;
  exact, since a maximum of given values rounds nothing;
* ``report``'s garbage collection: fewer collections inside, garbage still collected,
  the collector's settings restored after.

(The series images, tables and flags the report reads back: ``tests/test_results_documents.py``.)
"""

from __future__ import annotations

import gc

import numpy as np
import pandas as pd
import pytest

from gradforensics.analysis.contract.model import AnalysisResult, Findings, Flag


# ------------------------------------------------------------------ overview and layer table
def _findings(rng: np.random.Generator, heads: bool) -> Findings:
    tensors = [f"model.layers.{i}.mlp.weight" for i in range(int(rng.integers(1, 12)))] + ["lm_head.weight"]
    def table(with_head: bool) -> pd.DataFrame:
        rows = [(t, float(h) if with_head else np.nan) for t in tensors for h in (range(3) if with_head else [0])]
        return pd.DataFrame(rows, columns=["tensor", "head"])
    results = {"conflict": AnalysisResult(table(heads), {}), "drift": AnalysisResult(table(False), {}),
               "noise": AnalysisResult(pd.DataFrame(), {})}
    flags = []
    for _ in range(int(rng.integers(0, 40))):
        kind = ["conflict", "drift", "noise", "oscillation"][rng.integers(4)]
        ev = {"analysis": "drift"} if rng.random() < 0.2 else {}
        head = int(rng.integers(0, 3)) if heads and rng.random() < 0.6 else None
        flags.append(Flag(kind, str(rng.choice(tensors)), head, (), float(rng.choice([0.0, 0.3, 0.5, 0.75, 1.0])),
                          (0, 3), ev, "s"))
    flags.sort(key=lambda f: -f.severity)
    return Findings("s", 4, "training", (), {}, results, flags)


def _overview_oracle(findings: Findings):
    """The matrix by its definition: per cell the largest severity of its flags, 0 where covered."""
    from gradforensics.reporting import figures, names
    from gradforensics.store.names import layer_of

    ov = figures.overview_data(findings)
    rows, h = ov.rows, ov.heads
    col = {lay: j for j, lay in enumerate(ov.layers)}
    m = np.full(ov.matrix.shape, np.nan)

    def cols(name: str, head: int | None) -> slice:
        lay = layer_of(name)
        j = col[figures.OTHER if lay is None else lay]
        if head is None or h == 1:
            return slice(j * h, (j + 1) * h)
        return slice(j * h + head, j * h + head + 1)

    for r, n in enumerate(rows):
        table = findings.table(n)
        if table is not None and not len(table):        # nothing to read: grey, not an all-clear (issue 45)
            continue
        entries = names.table_units(table)
        if not entries:
            m[r, :] = 0.0
        for t, _ in entries:
            m[r, cols(t, None)] = 0.0
    for f in findings.flags:
        r = rows.index(figures.analysis_name(f, findings))
        s = cols(f.tensor, f.head)
        cur = m[r, s]
        m[r, s] = np.where(np.isnan(cur), f.severity, np.maximum(np.nan_to_num(cur), f.severity))
    return ov, m


@pytest.mark.parametrize("seed", range(16))
def test_overview_matrix_and_layer_table_hold_each_cells_largest_severity(seed: int) -> None:
    from gradforensics.reporting import figures, tables

    findings = _findings(np.random.default_rng(seed), heads=seed % 2 == 0)
    ov, want = _overview_oracle(findings)
    np.testing.assert_array_equal(ov.matrix, want)
    assert figures.flag_analyses(findings) == [figures.analysis_name(f, findings) for f in findings.flags]
    cols, rows = tables.layer_table(findings)
    for f in findings.flags:                          # every flag's cell holds at least its severity
        a = figures.analysis_name(f, findings)
        row = next(r for r in rows if (r["tensor"], r["head"]) == (f.tensor, f.head))
        assert a in cols and row[a] >= f.severity and f.kind in row["flags"]


# ------------------------------------------------------------------ garbage collection
def test_few_collections_restores_the_collector_and_still_collects() -> None:
    import weakref

    from gradforensics.commands.report import COLLECT_EVERY, few_collections

    before, frozen = gc.get_threshold(), gc.get_freeze_count()
    assert frozen == 0
    with few_collections():
        assert gc.get_threshold()[0] == max(before[0], COLLECT_EVERY)
        assert gc.get_freeze_count() > 0

        class Node:
            pass

        a, b = Node(), Node()
        a.other, b.other = b, a                       # a cycle: only the collector frees it
        gone = weakref.ref(a)
        del a, b
        gc.collect()
        assert gone() is None
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0


def test_few_collections_leaves_what_was_frozen_before_frozen_and_collection_off_off() -> None:
    from gradforensics.commands.report import few_collections

    before = gc.get_threshold()
    gc.freeze()
    try:
        n = gc.get_freeze_count()
        with few_collections():
            pass
        assert gc.get_freeze_count() >= n
    finally:
        gc.unfreeze()
    gc.set_threshold(0)
    try:
        with few_collections():
            assert gc.get_threshold()[0] == 0
    finally:
        gc.set_threshold(*before)
