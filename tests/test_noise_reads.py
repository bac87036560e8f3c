"""Noise's flags from the feature counts its table carries: no Gram result read again, the same flags.

(Moved from ``tests/test_unit_overhead.py``; noise is the subject here.)
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
def test_noise_flags_read_no_gram_again_and_flag_the_same(mode: str, nonfinite: bool) -> None:
    """The feature counts the table's pass saw (``table.attrs``) against the Gram results read again (a table
    without them, or with unreadable ones, as one read back from a store): the same flags; with them no Gram
    result is read; the model's rows read each whole tensor once."""
    import dataclasses

    from gradforensics.analysis.contract.model import AnalysisResult
    from gradforensics.analysis.kinds import noise as nz
    from gradforensics.analysis.kinds.noise.findings import flags
    from gradforensics.analysis.kinds.noise.table import MODEL, N_FEATURES

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
    raw = np.frombuffer(bytes.fromhex(res.table.attrs[N_FEATURES]), dtype=np.float64)
    json.dumps(res.table.attrs)                          # a table written with its attrs still writes
    recs = res.table.to_dict("records")
    assert raw.size == len(recs)
    for r, v in zip(recs, raw, strict=True):
        if r["tensor"] == MODEL:
            assert np.isnan(v)
        else:
            key = (r["tensor"], un.head_of(r["head"]))
            assert v == float(base.grams[key].n_features) > 0
    _Counting.reads = 0
    got = flags(res, ctx)
    assert _Counting.reads == 0
    bare = AnalysisResult(table=res.table.copy())
    bare.table.attrs.clear()
    want = flags(bare, ctx)
    assert _Counting.reads > 0
    assert [repr(f) for f in got] == [repr(f) for f in want]
    odd = AnalysisResult(table=res.table.copy())
    odd.table.attrs[N_FEATURES] = "zz" * 8 * len(recs)         # not hex: ignored, the Gram results read instead
    assert [repr(f) for f in flags(odd, ctx)] == [repr(f) for f in want]


