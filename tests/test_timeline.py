"""The timeline: the departure test and the spike rule against direct oracles, a planted order of events end
to end (flags.json, its schema, the report), and the false-alarm rate on pure noise.

Oracles: a per-series, per-record loop written here from the definitions (median / MAD of the last ``w``
finite values with ``np.median``, the CUSUM recursion, the Shewhart limit; mean + kσ with ``np.mean`` /
``np.std``), exact to float64 round-off; the gradient norm against ``np.linalg.norm`` of the recorded
gradients (1e-6 relative); the planted store's events (:mod:`gradforensics.testing.planted_timeline`)
found at their records exactly.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

import gradforensics as gf
from gradforensics.analysis.contract.timeline import timeline_document
from gradforensics.analysis.engine.results import read_findings
from gradforensics.analysis.kinds.timeline import grad_norms
from gradforensics.analysis.toolkit.departure import (
    MAD_SCALE,
    DepartureTest,
    SpikeTest,
    departures,
    robust_z,
    spikes,
    transform,
)
from gradforensics.reporting import flagsjson
from gradforensics.store.reader import open_store
from gradforensics.testing.planted_timeline import PLANTED, planted_timeline_store


# ------------------------------------------------------------------ oracles
def _oracle(x: np.ndarray, d: int, t: DepartureTest, floor: float) -> tuple[int, int, list[float]]:
    """(alarm, onset, z) of one series by the definition, one record at a time."""
    w = t.window_for(x.size)
    c, start, z_out = 0.0, 0, []
    alarm = onset = -1
    for i in range(x.size):
        prev = [v for v in x[:i] if np.isfinite(v)][-w:]
        if len(prev) < t.burn_in or not np.isfinite(x[i]):
            z_out.append(np.nan)
            continue
        m = float(np.median(prev))
        s = max(MAD_SCALE * float(np.median(np.abs(np.array(prev) - m))), floor)
        z = d * (x[i] - m) / s
        z_out.append(z)
        nxt = max(0.0, c + min(max(z, -t.z_clip), t.z_clip) - t.allowance)
        if c <= 0 < nxt:
            start = i
        c = nxt
        if alarm < 0 and (c > t.threshold or z > t.limit):
            alarm, onset = i, (start if c > 0 else i)
    return alarm, onset, z_out


def test_departures_match_the_definition_record_by_record() -> None:
    rng = np.random.default_rng(4)
    t = DepartureTest(window=20, burn_in=6)
    rows, dirs, floors = [], [], []
    for k in range(12):
        x = rng.standard_normal(90) * 0.3
        x[rng.random(90) < 0.1] = np.nan                     # gaps: skipped, not filled
        if k % 3 == 0:
            x[40 + k:] += 2.0 + 0.3 * k                       # a step up
        if k % 3 == 1:
            x[50:] -= 3.0                                     # a step down (trouble only for d = -1)
        rows.append(x)
        dirs.append(-1 if k % 2 else 1)
        floors.append(0.05 * (1 + k % 4))
    x = np.stack(rows)
    got = departures(x, np.array(dirs), t, np.array(floors), shewhart=True)
    for i in range(len(rows)):
        alarm, onset, z = _oracle(x[i], dirs[i], t, floors[i])
        assert (got.alarm[i], got.onset[i]) == (alarm, onset), i
        np.testing.assert_allclose(got.z[i], z, rtol=1e-12, atol=1e-12, equal_nan=True)
    assert (got.alarm >= 0).any() and (got.alarm < 0).any()


def test_a_step_is_found_at_its_record_and_a_single_jump_by_the_shewhart_limit() -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 120)) * 0.1
    x[0, 70:] += 1.0                                          # 10 sigma, sustained
    x[1, 80] += 5.0                                           # one record
    got = departures(x, 1, DepartureTest(), shewhart=np.array([False, True]))
    # the CUSUM adds at most z_clip - allowance = 6 a record: sure at the 4th record above 20
    assert got.onset.tolist() == [70, 80] and got.alarm.tolist() == [73, 80]
    assert departures(x[1:], 1, DepartureTest(), shewhart=False).alarm.tolist() == [-1]


def test_false_alarm_rate_on_noise() -> None:
    """The documented rates (docs/timeline.md): 1000 iid series of 150 records, the default test, no floor:
    the CUSUM raises none on Gaussian or Student-t (3 dof) noise; the Shewhart limit (shares only) fires on
    a fifth of the heavy-tailed series, which is why it is kept to shares."""
    rng = np.random.default_rng(0)
    for x in (rng.standard_normal((1000, 150)), rng.standard_t(3, (1000, 150))):
        assert not (departures(x, 1, DepartureTest(), floor=1e-9, shewhart=False).alarm >= 0).any()
    t3 = departures(rng.standard_t(3, (1000, 150)), 1, DepartureTest(), floor=1e-9, shewhart=True)
    assert 0.1 < (t3.alarm >= 0).mean() < 0.3


def _opening_oracle(x: np.ndarray, d: int, t: DepartureTest, floor: float) -> tuple[int, int]:
    """(alarm, onset) of the opening test by the definition: the first ``burn_in`` finite values frozen, the
    ``window`` finite values after them scored, the CUSUM, the onset after the last z within the allowance."""
    idx = [i for i in range(x.size) if np.isfinite(x[i])]
    ref = x[idx[:t.burn_in]]
    m = float(np.median(ref))
    s = max(MAD_SCALE * float(np.median(np.abs(ref - m))), floor * t.opening_floor)
    c, zs = 0.0, {}
    for i in idx[t.burn_in:t.burn_in + t.window_for(x.size)]:
        zs[i] = d * (x[i] - m) / s
        c = max(0.0, c + min(max(zs[i], -t.z_clip), t.z_clip) - t.allowance)
        if c > t.threshold:
            inside = [j for j in zs if zs[j] <= t.allowance]
            return i, (inside[-1] + 1 if inside else idx[t.burn_in])
    return -1, -1


def test_the_opening_test_matches_its_definition_and_the_earlier_alarm_wins() -> None:
    rng = np.random.default_rng(5)
    t = DepartureTest(window=30)
    rows, dirs, floors = [], [], []
    for k in range(16):
        x = 2.0 + 0.5 * rng.standard_normal(120)
        x[rng.random(120) < 0.1] = np.nan
        start = 2 + 2 * k                                  # a ramp starting inside the burn-in, or after it
        x += np.clip((0.5 + 0.2 * k) * (np.arange(120) - start), 0, 60) * (1 if k % 4 else -1)
        rows.append(x)
        dirs.append(1 if k % 4 else -1)
        floors.append(0.5 + 0.25 * (k % 3))
    x = np.stack(rows)
    both = departures(x, np.array(dirs), t, np.array(floors), shewhart=False, opening=True)
    alone = departures(x, np.array(dirs), t, np.array(floors), shewhart=False)
    used = 0
    for i in range(len(rows)):
        a0, o0 = _opening_oracle(x[i], dirs[i], t, floors[i])
        a1, o1 = int(alone.alarm[i]), int(alone.onset[i])
        if a0 >= 0 and (a1 < 0 or a0 < a1 or (a0 == a1 and o0 < o1)):
            want, used = (a0, o0), used + 1
        else:
            want = (a1, o1)
        assert (both.alarm[i], both.onset[i]) == want, (i, (a0, o0), (a1, o1))
    assert 3 <= used < (both.alarm >= 0).sum()             # each test decided some rows


def test_compounding_growth_from_the_burn_in_is_dated_by_the_opening_level_and_a_drift_is_not() -> None:
    """nanogpt's heads (docs/timeline.md): logits rising 3 units a record from record 4, inside the 8-value
    burn-in, drag the trailing median along (a ramp's z against its own trailing window stays near 1.35, under
    the allowance of 2): the trailing test never departs; against the frozen opening level the ramp departs at
    the first scored record.  A healthy head's drift (1 -> 4.6 over 40 records, nanogpt low-lr) does not."""
    rng = np.random.default_rng(3)
    r = np.arange(120)
    ramp = 1.5 + 0.3 * rng.standard_normal(120) + np.clip(3.0 * (r - 4), 0, 80)
    drift = 1.0 + 3.6 * (1 - np.exp(-r / 15)) + 0.1 * rng.standard_normal(120)
    x = np.stack([ramp, drift])
    alone = departures(x, 1, DepartureTest(), floor=1.0, shewhart=False)
    assert alone.alarm.tolist() == [-1, -1]
    both = departures(x, 1, DepartureTest(), floor=1.0, shewhart=False, opening=True)
    assert both.onset.tolist() == [8, -1] and both.alarm.tolist() == [11, -1]


def test_the_opening_test_false_alarm_rate_on_noise() -> None:
    """docs/timeline.md: on 1000 iid series of 150 records with no floor, the opening test (a level frozen
    from 8 values) alarms on about 0.5 % of Gaussian and of Student-t (3 dof) series; the attention series
    it runs on have a floor of 2 logit units (0.1 of entropy) against it."""
    rng = np.random.default_rng(0)
    for x in (rng.standard_normal((1000, 150)), rng.standard_t(3, (1000, 150))):
        rate = (departures(x, 1, DepartureTest(), floor=1e-9, shewhart=False, opening=True).alarm >= 0).mean()
        assert rate < 0.01, rate


def test_spikes_match_mean_plus_k_sigma_of_the_trailing_window() -> None:
    rng = np.random.default_rng(2)
    y = 2.0 + 0.05 * rng.standard_normal(100)
    y[[30, 31, 64]] = [5.0, 5.5, 9.0]
    y[10] = np.nan
    y[80] = np.inf
    test = SpikeTest(k=6.0, window=20, burn_in=8)
    want = []
    for i in range(100):
        prev = y[max(0, i - 20):i]
        prev = prev[np.isfinite(prev)]
        up = len(prev) >= 8 and (y[i] == np.inf or (np.isfinite(y[i]) and y[i] > prev.mean() + 6 * prev.std()))
        want.append(up)
    want_first = [i for i in range(100) if want[i] and not (i and want[i - 1])]
    assert spikes(y, test).tolist() == want_first == [30, 64, 80]


def test_transform_scales() -> None:
    np.testing.assert_allclose(transform(np.array([1.0, np.e, 0.0, -1.0]), "log"), [0.0, 1.0, np.nan, np.nan])
    np.testing.assert_allclose(transform(np.array([-2.0, 0.0]), "log3"), [0.0, np.log(3.0)])
    with pytest.raises(ValueError, match="transform must be one of"):
        transform(np.zeros(2), "sqrt")


# ------------------------------------------------------------------ planted, end to end
@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory):
    path = planted_timeline_store(tmp_path_factory.mktemp("tl") / "planted.zarr")
    findings = gf.analyze(path, progress=False)
    return path, findings


def test_planted_order_and_leads(planted) -> None:
    _, findings = planted
    doc = findings.flags_json()
    flagsjson.validate(doc)
    t = doc["timeline"]
    assert [s["record"] for s in t["spikes"]] == [PLANTED["spike"]]
    got = [(e["signal"], e["tensor"], e["record"], e["lead_steps"]) for e in t["spikes"][0]["signals"]]
    assert got == [("kurtosis", "mlp.act", PLANTED["kurt_onset"], PLANTED["spike"] - PLANTED["kurt_onset"]),
                   ("grad_norm", "layer.1.weight", PLANTED["grad_onset"], PLANTED["spike"] - PLANTED["grad_onset"])]
    # the one-record loss spike is the spike (the spike rule), not a departure of the loss's level
    assert [e["record"] for e in t["departures"]] == [PLANTED["kurt_onset"], PLANTED["grad_onset"]]
    assert t["test"]["window"] == 24 and t["test"]["spike_k"] == 6.0


def test_gradient_norms_are_the_gram_diagonal(planted) -> None:
    """The pass's Gram diagonal, square-rooted, is each record's gradient norm (numpy on the stored gradient)."""
    path, findings = planted
    table = findings.table("timeline")
    row = table[table["signal"] == "grad_norm"].iloc[0]
    g = open_store(path).read("grads/layer.1.weight").astype(np.float64)[int(row["alarm_record"])]
    assert row["value"] == pytest.approx(np.linalg.norm(g), rel=1e-6)

    class Gram:
        def __init__(self, x: np.ndarray, bad: np.ndarray) -> None:
            self.gram, self.nonfinite = x @ x.T, bad

    x = np.random.default_rng(0).standard_normal((5, 7))

    class Ctx:
        def __init__(self) -> None:
            self.grams = {("w", None): Gram(x, np.array([0, 0, 3, 0, 0]))}

    want = np.linalg.norm(x, axis=1)
    want[2] = np.nan                                      # a record with a non-finite gradient has no norm
    np.testing.assert_allclose(grad_norms(Ctx())[("w", None)], want, rtol=1e-12)  # type: ignore[arg-type]


def test_timeline_is_read_back_from_the_store_unchanged(planted) -> None:
    path, findings = planted
    again = read_findings(open_store(path))
    assert again.flags_json()["timeline"] == json.loads(json.dumps(findings.flags_json()["timeline"]))


def test_a_finding_on_the_same_tensor_is_linked() -> None:
    import pandas as pd

    from gradforensics.analysis.contract.model import AnalysisResult, Flag

    table = pd.DataFrame([{"tensor": "w", "head": 2, "signal": "grad_norm", "label": "gradient norm of w head 2",
                           "source": None, "record": 5, "step": 50, "alarm_record": 7, "spike_record": None}])
    flags = [Flag("drift", "v", None, (), 0.9, (0, 9), {}, "."), Flag("drift", "w", 3, (), 0.8, (0, 9), {}, "."),
             Flag("drift", "w", None, (), 0.7, (0, 9), {}, ".")]
    doc = timeline_document(AnalysisResult(table), flags)
    assert doc["departures"][0]["finding"] == 2          # head 3's flag is another head; the whole tensor's covers it
    assert doc["spikes"] == []


def test_flags_json_timeline_mutations_are_refused(planted) -> None:
    _, findings = planted
    doc = json.loads(json.dumps(findings.flags_json()))
    flagsjson.validate(doc)
    cases = {
        "unexpected key": lambda d: d["timeline"].update(extra=1),
        "missing required key 'departures'": lambda d: d["timeline"].pop("departures"),
        "not ordered by onset": lambda d: d["timeline"]["departures"].reverse(),
        "is not a flag index": lambda d: d["timeline"]["departures"][0].update(finding=10 ** 6),
        "not inside the 96 records": lambda d: d["timeline"]["spikes"][0].update(record=96),
        "expected integer": lambda d: d["timeline"]["spikes"][0]["signals"][0].update(record="40"),
    }
    for what, mutate in cases.items():
        bad = copy.deepcopy(doc)
        mutate(bad)
        errs = flagsjson.errors(bad)
        assert any(what in e for e in errs), (what, errs)
    jsonschema = pytest.importorskip("jsonschema")
    v = jsonschema.Draft202012Validator(flagsjson.flags_schema())
    assert not list(v.iter_errors(doc))


def test_report_opens_with_what_moved_first(planted, tmp_path) -> None:
    path, _ = planted
    from gradforensics import cli

    assert cli.main(["report", str(path), "--out", str(tmp_path / "r")]) == 0
    html = (tmp_path / "r" / "report.html").read_text()
    md = (tmp_path / "r" / "report.md").read_text()
    assert html.index('id="what-moved-first"') < html.index('id="at-a-glance"') < html.index('id="summary"')
    assert 'id="fig-timeline-01"' in html
    assert "Loss spike at record 60 (step 60)" in html
    assert "excess kurtosis of the activations of mlp.act: from record 40 (step 40), 20 step(s) before" in html
    assert md.index("## What moved first") < md.index("## Findings")
    assert (tmp_path / "r" / "figures" / "timeline-01.png").stat().st_size > 1000
    doc = json.loads((tmp_path / "r" / "flags.json").read_text())
    assert doc["timeline"]["spikes"][0]["record"] == 60


def test_a_timeline_table_from_someone_elses_store_never_makes_an_invalid_flags_json(planted) -> None:
    """Saved results are data: rows without a usable record, or outside the store, are left out."""
    import pandas as pd

    from gradforensics.analysis.contract.model import AnalysisResult, Findings

    _, findings = planted
    good = findings.results["timeline"].table.iloc[0].to_dict()
    foreign = pd.DataFrame([{"tensor": "w", "head": None, "norm": 1.0},                  # another table entirely
                            {**good, "record": 10 ** 6}, {**good, "record": None}, {**good, "head": -3}, good])
    bad = Findings(findings.store, findings.n_records, findings.mode, findings.sources, findings.header,
                   {**findings.results, "timeline": AnalysisResult(foreign)}, findings.flags)
    doc = json.loads(json.dumps(bad.flags_json()))
    flagsjson.validate(doc)
    assert len(doc["timeline"]["spikes"]) + len(doc["timeline"]["departures"]) == 1


def test_robust_z_is_the_median_and_mad_of_each_trailing_window() -> None:
    """robust_z against a per-record NumPy oracle (np.median / MAD of the last `window` finite values before
    each record), on series with NaN gaps, short histories and ties (even and odd counts)."""
    rng = np.random.default_rng(2)
    x = np.round(rng.standard_normal((7, 90)), 1)               # rounded: ties
    x[rng.random(x.shape) < 0.2] = np.nan
    x[3, :40] = np.nan
    window, burn_in, floor = 16, 5, 0.05
    z, med, scale = robust_z(x, window, burn_in, floor)
    for i in range(x.shape[0]):
        for t in range(x.shape[1]):
            prev = x[i, :t][np.isfinite(x[i, :t])][-window:]
            if prev.size < burn_in:
                assert np.isnan(med[i, t]) and np.isnan(z[i, t])
                continue
            m = np.median(prev)
            sd = max(MAD_SCALE * np.median(np.abs(prev - m)), floor)
            assert med[i, t] == m and scale[i, t] == pytest.approx(sd, rel=1e-12)
            if np.isfinite(x[i, t]):
                assert z[i, t] == pytest.approx((x[i, t] - m) / sd, rel=1e-12)
