"""The stale-row rule of the optimizer analysis (issue 40): loss-spike z and the stand-out record, against oracles."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gradforensics.analysis.kinds.optimizer.rows import (
    EXCESS,
    HISTORY,
    WINDOW,
    Z_SPIKE,
    StaleEvent,
    loss_spike_z,
    severity,
    stale_event,
)


def _oracle_z(y: np.ndarray, j: int) -> float:
    prev = y[max(0, j - HISTORY):j]
    d = np.diff(prev)
    mad = np.median(np.abs(d - np.median(d)))
    return float((y[j] - np.median(prev[-WINDOW:])) / (1.4826 * mad / math.sqrt(2)))


def test_spike_z_equals_the_oracle_and_finds_a_planted_spike() -> None:
    rng = np.random.default_rng(0)
    y = 3.0 - 0.01 * np.arange(120) + 0.1 * rng.standard_normal(120)
    y[90] += 2.0                                            # a 2-nat spike, 20 noise sd
    z = loss_spike_z(y)
    assert np.isnan(z[:WINDOW]).all() and np.isfinite(z[WINDOW:]).all()
    for j in (WINDOW, 45, 90, 119):
        assert z[j] == pytest.approx(_oracle_z(y, j), rel=1e-12)
    assert int(np.nanargmax(z)) == 90 and z[90] > 10
    assert np.nanmax(np.delete(z, 90)) < Z_SPIKE             # Gaussian noise: nothing else reaches the threshold


def test_spike_z_per_source_compares_a_record_with_its_own_source() -> None:
    rng = np.random.default_rng(1)
    a = 2.0 + 0.05 * rng.standard_normal(60)
    b = 5.0 + 0.05 * rng.standard_normal(60)              # another source, another level: no spike when interleaved
    y = np.empty(120)
    y[0::2], y[1::2] = a, b
    groups = [np.arange(0, 120, 2), np.arange(1, 120, 2)]
    assert np.nanmax(loss_spike_z(y, groups)) < Z_SPIKE
    assert np.nanmax(loss_spike_z(y)) > Z_SPIKE            # one series: the level flips every record


def _masks(n: int, rows: int, base_rows: int, at: int, burst: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    m = np.zeros((n, rows), dtype=np.uint8)
    for r in range(n):
        m[r, rng.choice(rows, size=rng.integers(0, base_rows + 1), replace=False)] = 1
    m[at] = 0
    m[at, :burst] = 1
    return m


def test_stale_event_names_the_burst_that_coincides_with_a_spike() -> None:
    n = 80
    m = _masks(n, 100, 2, at=60, burst=30)
    z = np.zeros(n)
    z[:WINDOW] = np.nan
    z[60] = 8.0
    ev = stale_event(m, np.ones(n, bool), z)
    assert ev is not None and ev.record == 60 and ev.rows.tolist() == list(range(30)) and ev.spike
    others = m.sum(1)[np.arange(n) != 60]
    assert ev.base == max(1.0, float(np.quantile(others, 0.9)))
    assert ev.excess == pytest.approx(30 / ev.base)
    # severity: 0.5 at the thresholds, +0.1 per doubling of either
    assert severity(ev) == pytest.approx(min(0.95, 0.5 + 0.1 * math.log2(8 / Z_SPIKE) + 0.1 * math.log2(ev.excess / EXCESS)))
    at = StaleEvent(record=0, rows=np.arange(3), n_rows=10, base=1.0, excess=EXCESS, loss_z=Z_SPIKE, live_records=5)
    assert severity(at) == pytest.approx(0.5)


def test_base_rate_rows_and_rows_at_the_start_are_not_findings() -> None:
    n = 80
    m = _masks(n, 100, 3, at=5, burst=40)              # a burst at record 5: before WINDOW records of loss
    z = np.zeros(n)
    z[:WINDOW] = np.nan
    z[40] = 9.0                                          # a spike where only base-rate rows are stale
    ev = stale_event(m, np.ones(n, bool), z)
    assert ev is None or (not ev.spike and severity(ev) < 0.5)
    # off the live grid, a mask is not read
    live = np.ones(n, bool)
    m2 = _masks(n, 100, 1, at=50, burst=30)
    live[50] = False
    z[50] = 9.0
    ev2 = stale_event(m2, live, z)
    assert ev2 is None or ev2.record != 50


def test_a_burst_without_a_spike_is_context() -> None:
    n = 60
    m = _masks(n, 50, 1, at=30, burst=20)
    z = np.zeros(n)
    ev = stale_event(m, np.ones(n, bool), z)
    assert ev is not None and ev.record == 30 and not ev.spike and severity(ev) == 0.3


def test_recorder_takes_stale_masks_off_the_grid(tmp_path) -> None:
    """Rows first seen at a record off the ``optimizer_every`` grid are stale there (oracle: opt.state, float64)."""
    torch = pytest.importorskip("torch")
    import gradforensics as gf
    from gradforensics.store.reader import open_store

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Embedding(20, 6), torch.nn.Flatten(), torch.nn.Linear(18, 20))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    want = []
    with gf.Recorder(tmp_path / "r.zarr", model=model, sources=["a"], optimizer=opt, optimizer_every=3,
                     heads=None) as rec:
        for i in range(8):
            x = torch.randint(0, 10 if i < 5 else 20, (16, 3), generator=g)     # rows 10..19 from record 5 on
            loss = torch.nn.functional.cross_entropy(model(x), torch.randint(0, 20, (16,), generator=g))
            loss.backward()
            w = model[0].weight
            st = opt.state.get(w)
            if st:
                v = st["exp_avg_sq"].double() / (1 - 0.999 ** float(st["step"]))
                gs = w.grad.double().pow(2).sum(1)
                want.append(((gs > 0) & (gs > 1e3 * v.sum(1))).numpy())
            else:
                want.append(np.zeros(20, dtype=bool))
            rec.record(step=i, loss=loss, source="a")
            opt.step()
            opt.zero_grad()
    s = open_store(tmp_path / "r.zarr")
    stale = s.read("optim_live/0.weight/stale")
    assert s.arrays["optim_live/0.weight/stale"].attrs["every_record"] is True
    np.testing.assert_array_equal(stale.astype(bool), np.stack(want))
    assert stale[5, 10:].sum() >= 5 and not stale[5, :10].any()        # the arrival, off the grid (5 % 3 != 0)
    assert np.isnan(s.read("optim_live/0.weight/row_ratio")[5]).all()  # the quantiles stay on the grid


def test_the_report_tries_the_remedy_of_the_problem_first() -> None:
    from gradforensics.analysis.contract.model import Flag
    from gradforensics.analysis.kinds.optimizer import ADVICE

    def flag(problem: str) -> Flag:
        return Flag(kind="optimizer", tensor="w", head=None, sources=(), severity=0.7, records=(0, 0),
                    evidence={"problem": problem}, summary="")

    assert ADVICE.remedies_for([flag("stale rows")])[0].startswith("Stale rows")
    assert ADVICE.remedies_for([flag("stale preconditioner")]) == list(ADVICE.remedies)
    assert sorted(ADVICE.remedies_for([flag("eps-dominated")])) == sorted(ADVICE.remedies)


def test_the_runs_base_rate_sets_the_bar_for_a_quiet_tensor_and_the_spike_may_lag() -> None:
    from gradforensics.analysis.kinds.optimizer.rows import LAG, base_rate

    n = 60
    busy = _masks(n, 200, 6, at=40, burst=60, seed=3)       # an embedding: a few first-seen rows every record
    quiet = np.zeros((n, 32), dtype=np.uint8)
    quiet[40, :5] = 1                                       # five waking units, where the spike is
    on = np.ones(n, bool)
    floor = base_rate([busy, quiet], [on, on])
    assert floor == max(1.0, float(np.quantile(busy.sum(1), 0.9)))
    z = np.zeros(n)
    z[:WINDOW] = np.nan
    z[40 + LAG] = 10.0                                      # the loss jumps LAG records after the arrival
    ev = stale_event(busy, on, z, floor)
    assert ev is not None and ev.record == 40 and ev.spike and ev.loss_z == 10.0
    assert stale_event(quiet, on, z, floor) is None         # 5 rows < EXCESS x the run's base rate
    assert stale_event(quiet, on, z) is not None            # against its own base of zero it would stand out
    z2 = np.zeros(n)
    z2[:WINDOW] = np.nan
    z2[40 + LAG + 1] = 10.0                                 # too late: context
    ev2 = stale_event(busy, on, z2, floor)
    assert ev2 is not None and not ev2.spike


def test_a_live_store_is_judged_on_the_median_of_its_last_records(tmp_path) -> None:
    """One heavy batch at the end (gradients x30) is not a stale preconditioner; the table holds the median."""
    torch = pytest.importorskip("torch")
    import gradforensics as gf
    from gradforensics.analysis.kinds.optimizer import LAST
    from gradforensics.store.reader import open_store

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    n = 30
    with gf.Recorder(tmp_path / "r.zarr", model=model, sources=["a"], optimizer=opt, heads=None) as rec:
        for i in range(n):
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            if i == n - 1:
                for p in model.parameters():
                    p.grad.mul_(30.0)
            rec.record(step=i, loss=loss, source="a")
            opt.step()
            opt.zero_grad()
    s = open_store(tmp_path / "r.zarr")
    summ = s.read("optim_live/summary")
    a = s.arrays["optim_live/summary"].attrs
    q50 = summ[:, :, a["fields"].index("ratio_q50")]
    assert (q50[-1] >= 100).all()                                  # the last batch alone reads stale
    found = gf.analyze(tmp_path / "r.zarr", only=["optimizer"], progress=False)
    t = found.table("optimizer").set_index("tensor")
    np.testing.assert_allclose(t.loc[a["tensors"], "ratio_q50"].to_numpy(dtype=float),
                               np.median(q50[-LAST:], axis=0), rtol=1e-12)
    assert set(t["origin"]) == {"live"}
    assert not [f for f in found.flags if f.severity >= 0.5], [f.summary for f in found.flags]
