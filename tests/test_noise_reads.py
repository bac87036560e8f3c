"""Noise's flags from the feature counts its table carries: no Gram result read again, the same flags.

(Moved unchanged from ``tests/test_unit_overhead.py``, whose other tests held oscillation's and drift's
stacked paths to their single calls; the subject here is noise's.)
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from gradforensics.analysis.toolkit import units as un
from gradforensics.testing import planted_directions as P


class _Counting(dict):
    """``ctx.grams`` that counts its reads (``[]`` and ``get``)."""

    reads = 0

    def __getitem__(self, key):  # type: ignore[no-untyped-def]
        type(self).reads += 1
        return super().__getitem__(key)

    def get(self, key, default=None):  # type: ignore[no-untyped-def]
        type(self).reads += 1
        return super().get(key, default)


@pytest.mark.parametrize("mode,nonfinite", [("training", False), ("replay", False), ("training", True),
                                             ("replay", True)])
def test_noise_flags_from_the_table_counts_read_no_gram(mode: str, nonfinite: bool) -> None:
    """The feature counts the table's pass saw (``table.attrs``) against the Gram results read again (a table
    without them, as one read back from a store): the same excess of every row, the same flags; with them no
    Gram result is read; the model's rows read each whole tensor once."""
    import dataclasses

    from gradforensics.analysis.kinds import noise as nz

    p = P.planted_conflict(seed=5, n=48, n_layers=3, where={P.q_name(1): (1, 2)}, mode=mode)
    if nonfinite:
        p = P.with_nonfinite(p, P.q_name(2), [4, 9])
    base = p.context()
    counting = _Counting(base.grams)
    ctx = dataclasses.replace(base, grams=counting)
    _Counting.reads = 0
    res = nz.compute(ctx)
    whole = [k for k in base.grams if k[1] is None]
    if nonfinite:       # the whole tensors with other usable records than the model's are estimated again
        assert len(base.grams) < _Counting.reads < len(base.grams) + len(whole)
    else:               # each unit once: the model's rows read nothing again (before: every whole tensor twice)
        assert _Counting.reads == len(base.grams)
    raw = np.frombuffer(bytes.fromhex(res.table.attrs[nz.N_FEATURES]), dtype=np.float64)
    json.dumps(res.table.attrs)                          # a table written with its attrs still writes
    recs = res.table.to_dict("records")
    assert raw.size == len(recs)
    for r, v in zip(recs, raw, strict=True):
        if r["tensor"] == nz.MODEL:
            assert np.isnan(v)
        else:
            key = (r["tensor"], un.head_of(r["head"]))
            assert v == float(base.grams[key].n_features) > 0
    _Counting.reads = 0
    got = nz.flags(res, ctx)
    assert _Counting.reads == 0
    bare = nz.AnalysisResult(table=res.table.copy())
    bare.table.attrs.clear()
    want = nz.flags(bare, ctx)
    assert _Counting.reads > 0
    assert [repr(f) for f in got] == [repr(f) for f in want]
    for r in recs:
        r["head"] = un.head_of(r["head"])
    rows = [r for r in recs if r["source"] == "" and r["tensor"] != nz.MODEL]
    for r in rows:
        r["trace_sigma"] = float(r["trace_sigma"]) * (30.0 if r["tensor"] == P.q_name(1) else 1.0)
    known = nz._known_features(res.table, recs)
    assert len(known) == len(recs)
    odd = res.table.copy()
    odd.attrs[nz.N_FEATURES] = "zz" * 8 * len(recs)          # not hex: ignored, the Gram results read instead
    assert nz._known_features(odd, recs) == {}
    assert nz._noise_excess(rows, ctx, known) == nz._noise_excess(rows, ctx)
    opts = nz.NoiseOptions(outlier_z=0.5, outlier_ratio=1.01)
    got_o = nz._outliers(rows, opts, ctx, known)
    assert got_o == nz._outliers(rows, opts, ctx)
    assert got_o or mode == "replay"            # training: some rows flagged, the rule ran
