"""spectral: a recurrent weight's spectral norm jumping between snapshots (exploding gradients through time)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from gradforensics.analysis.contract.model import AnalysisResult
from gradforensics.analysis.kinds.spectral import recurrent as rc


def test_recurrent_weights_are_pytorchs_hidden_to_hidden_matrices() -> None:
    assert rc.is_recurrent("rnn.weight_hh_l0") and rc.is_recurrent("enc.lstm.weight_hh_l2_reverse")
    assert not rc.is_recurrent("rnn.weight_ih_l0") and not rc.is_recurrent("head.weight")
    assert not rc.is_recurrent("rnn.weight_hh_l0.bias")


def test_largest_jump_is_the_largest_consecutive_ratio() -> None:
    rng = np.random.default_rng(0)
    s = np.exp(rng.standard_normal(12))
    jump, at = rc.largest_jump(s)
    ratios = s[1:] / s[:-1]
    assert jump == pytest.approx(ratios.max(), rel=1e-12) and at == int(np.argmax(ratios)) + 1
    assert math.isnan(rc.largest_jump(np.array([1.0]))[0])


def test_jump_severity_is_half_at_ten_fold_and_one_at_a_hundred() -> None:
    assert rc.jump_severity(1.0) == 0.0 and rc.jump_severity(0.5) == 0.0 and rc.jump_severity(math.nan) == 0.0
    assert rc.jump_severity(10.0) == pytest.approx(0.5) and rc.jump_severity(100.0) == pytest.approx(1.0)
    assert rc.jump_severity(3.0) < 0.25 < rc.jump_severity(4.0) < 0.5


def _result(sigmas: dict[str, list[float]]) -> AnalysisResult:
    table = pd.DataFrame({"tensor": list(sigmas), "matrix": "weight"})
    series: dict[str, np.ndarray] = {}
    for t, s in sigmas.items():
        series[f"sv/weight/{t}/all"] = np.c_[np.asarray(s), np.asarray(s) / 2]
        series[f"records/weight/{t}"] = np.arange(len(s)) * 10
    return AnalysisResult(table=table, series=series)


def test_flags_name_the_recurrent_weight_that_jumped_and_say_context_below_half() -> None:
    res = _result({"rnn.weight_hh_l0": [1.5, 30.0, 31.0], "rnn.weight_ih_l0": [1.0, 80.0, 80.0],
                   "rnn.weight_hh_l1": [1.5, 4.5, 5.0]})
    flags = {f.tensor: f for f in rc.recurrent_flags(res, 0.1)}
    assert set(flags) == {"rnn.weight_hh_l0", "rnn.weight_hh_l1"}      # only W_hh compounds through time
    big, small = flags["rnn.weight_hh_l0"], flags["rnn.weight_hh_l1"]
    assert big.kind == "spectral" and big.records == (0, 10) and big.severity == pytest.approx(0.5 * math.log(20) / math.log(10))
    assert big.evidence["jump"] == pytest.approx(20.0) and "clip the gradient norm" in big.summary
    assert small.severity < 0.5 and "context, not a problem" in small.summary
