"""Series from logs and stores: repairs (missing, duplicate, non-finite steps),
ranks, time axes, gradient norms from Gram matrices, one-line errors, and the
``gradforensics loss`` command end to end."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from gradforensics import logs
from gradforensics.analysis.contract.grams import GramResult
from gradforensics.analysis.toolkit import series as se
from gradforensics.cli import main
from gradforensics.errors import GradforensicsError, LogReadError


def periodic_loss(n: int, seed: int = 0, period: float = 25.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(n)
    return 2 + 3 * (1 + t / 100) ** -0.7 + 0.03 * rng.standard_normal(n) + 0.04 * np.sin(2 * np.pi * t / period)


# ------------------------------------------------------------------ regularize
def test_regularize_repairs_and_counts() -> None:
    x = np.array([0, 10, 20, 20, 30, 60, 70, np.nan, 80], dtype=float)
    y = np.array([1.0, 2.0, 3.0, 5.0, np.inf, 7.0, np.nan, 9.0, 8.0])
    s = se.regularize(x, y, name="loss")
    q = s.quality
    assert (q.n_rows, q.n_bad_axis, q.n_nonfinite, q.n_duplicates) == (9, 1, 2, 1)
    np.testing.assert_array_equal(s.x, np.arange(0, 90, 10))
    # spacing 10 (the most common); step 20 averaged to 4; 30, 40, 50 and 70 interpolated
    np.testing.assert_allclose(s.y, np.interp(s.x, [0, 10, 20, 60, 80], [1, 2, 4, 7, 8]))
    assert q.n_filled == 4 and q.longest_gap == 40 and q.spacing == 10
    assert s.records == (0, 8)
    notes = "; ".join(q.notes())
    assert "1 rows without a usable step" in notes and "2 NaN/Inf" in notes and "1 duplicate" in notes
    assert "4 missing samples interpolated" in notes


def test_regularize_all_nan_and_absurd_steps_never_crash() -> None:
    empty = se.regularize([1, 2, 3], [np.nan] * 3, name="x")
    assert empty.n == 0 and empty.quality.n_nonfinite == 3
    s = se.regularize([0, 1, 2, 3, 1e12], [1.0, 2, 3, 4, 5], name="x")
    assert s.n <= se.MAX_GRID_FACTOR * 5


def test_group_by_rank_and_combined_mean() -> None:
    t = np.arange(100)
    x = np.concatenate([t, t])
    y = np.concatenate([np.ones(100), 3 * np.ones(100)])
    g = se.group(x, y, name="loss", ranks=np.repeat([1, 0], 100))
    assert [r.rank for r in g.ranks] == ["0", "1"]
    np.testing.assert_allclose(g.combined.y, 2.0)
    assert g.combined.quality.n_duplicates == 0          # cross-rank rows are not duplicates


# ----------------------------------------------------------------------- logs
def test_csv_log_with_missing_duplicate_and_nan_rows(tmp_path) -> None:
    n = 800
    df = pd.DataFrame({"step": np.arange(n) * 5, "train/loss": periodic_loss(n), "lr": 1e-3,
                       "val/loss": np.where(np.arange(n) % 10 == 0, 1.0, np.nan)})
    df = pd.concat([df.drop(index=range(100, 130)), df.iloc[[200, 201]]])       # a gap and duplicates
    df.loc[df.index[5], "train/loss"] = np.nan
    p = tmp_path / "log.csv"
    df.to_csv(p, index=False)
    groups = logs.read_logs([p])
    assert [g.name for g in groups] == ["train/loss", "val/loss"]       # lr is metadata
    s = groups[0].combined
    assert s.dt == 5 and s.x[0] == 0 and s.x[-1] == 5 * (n - 1)
    assert s.quality.n_duplicates == 2 and s.quality.n_nonfinite == 1 and s.quality.n_filled == 31
    assert groups[1].combined.dt == 50                                    # logged every 10 steps


def test_jsonl_log_with_rank_and_time_columns(tmp_path) -> None:
    n = 400
    lines = []
    for r in range(2):
        y = periodic_loss(n, seed=r)
        for i in range(n):
            rec = {"iteration": i, "rank": r, "wall": 100.0 + 0.5 * i, "loss": float(y[i])}
            if i == 7:
                rec.pop("loss")                              # a line without the value
            lines.append(json.dumps(rec))
    p = tmp_path / "log.jsonl"
    p.write_text("\n".join(lines) + "\n")
    g = logs.read_logs([p], logs.LogSpec(time_col="wall", rank_col="rank"))[0]
    assert g.name == "loss" and [r.rank for r in g.ranks] == ["0", "1"]
    assert g.combined.unit == "s" and g.combined.dt == 0.5 and g.combined.steps_per_unit == pytest.approx(2.0)
    assert g.ranks[0].quality.n_nonfinite == 1


def test_json_array_export_and_interleaved_ranks_on_a_time_axis(tmp_path) -> None:
    """A ``.json`` array of records; four ranks log each step at the same moments:
    10 steps per second is still 10 steps per second."""
    recs = [{"step": i, "time": i / 10, "rank": r, "loss": float(v)}
            for i, v in enumerate(periodic_loss(300)) for r in range(4)]
    p = tmp_path / "export.json"
    p.write_text(json.dumps(recs))
    g = logs.read_logs([p], logs.LogSpec(time_col="time", rank_col="rank"))[0]
    assert g.combined.unit == "s" and g.combined.steps_per_unit == pytest.approx(10.0)
    assert len(g.ranks) == 4 and g.combined.n == 300


def test_several_files_are_ranks(tmp_path) -> None:
    paths = []
    for r in range(3):
        p = tmp_path / f"rank{r}.csv"
        pd.DataFrame({"step": np.arange(300), "loss": periodic_loss(300, seed=r)}).to_csv(p, index=False)
        paths.append(p)
    g = logs.read_logs(paths)[0]
    assert [r.rank for r in g.ranks] == ["rank0.csv", "rank1.csv", "rank2.csv"]


@pytest.mark.parametrize(("content", "name", "match"), [
    (None, "missing.csv", "no such file"),
    ("", "empty.csv", "cannot read as CSV"),
    ('{"step": 1, "loss": 2}\n{"step": 2, "loss"\n', "bad.jsonl", "cannot read as JSONL"),
    (b"\xff\xfe\x00garbage\x00\xff", "bin.csv", "cannot read as CSV"),
    ("step,name\n1,a\n2,b\n", "text.csv", "no numeric value column"),
])
def test_unreadable_logs_give_one_line_errors(tmp_path, content, name, match) -> None:
    p = tmp_path / name
    if isinstance(content, bytes):
        p.write_bytes(content)
    elif content is not None:
        p.write_text(content)
    with pytest.raises(LogReadError, match=match) as info:
        logs.read_logs([p])
    assert str(p) in str(info.value) and "\n" not in str(info.value)
    assert isinstance(info.value, GradforensicsError)


def test_named_columns_must_exist(tmp_path) -> None:
    p = tmp_path / "log.csv"
    pd.DataFrame({"step": [1, 2], "loss": [1.0, 2.0]}).to_csv(p, index=False)
    with pytest.raises(LogReadError, match="no step column 'it'"):
        logs.read_logs([p], logs.LogSpec(step_col="it"))
    with pytest.raises(LogReadError, match=r"no column\(s\) \['acc'\]"):
        logs.read_logs([p], logs.LogSpec(columns=("acc",)))
    with pytest.raises(LogReadError, match="no rank column"):
        logs.read_logs([p], logs.LogSpec(rank_col="r"))


# --------------------------------------------------------------------- stores
def test_gradient_norms_from_gram_diagonal() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((50, 30))
    heads = rng.standard_normal((2, 50, 10))
    nonfinite = np.zeros(50, int)
    nonfinite[7] = 3
    grams = {("a", None): GramResult("a", None, x @ x.T, nonfinite, 30),
             ("h", 0): GramResult("h", 0, heads[0] @ heads[0].T, np.zeros(50, int), 10),
             ("h", 1): GramResult("h", 1, heads[1] @ heads[1].T, np.zeros(50, int), 10)}
    batches = {"loss": np.ones(50, np.float32), "step": np.arange(50)}
    groups = {g.name: g.combined for g in se.from_batches(batches, grams)}
    a = groups["grad_norm/a"]
    want = np.linalg.norm(x, axis=1)
    assert a.tensor == "a" and a.quality.n_nonfinite == 1
    np.testing.assert_allclose(np.delete(a.y, 7), np.delete(want, 7))
    np.testing.assert_allclose(groups["grad_norm/h"].y, np.sqrt((heads ** 2).sum(axis=(0, 2))))


def test_replay_store_uses_record_order() -> None:
    batches = {"loss": np.arange(6.0), "step": np.zeros(6, int), "rank": np.array([0, 1, 0, 1, 0, 1])}
    g = se.from_batches(batches, mode="replay")[0]
    assert g.combined.unit == "record" and [r.n for r in g.ranks] == [3, 3]
    np.testing.assert_allclose(g.ranks[1].y, [1, 3, 5])


# ------------------------------------------------------------------------ CLI
def test_loss_command_on_a_csv_log(tmp_path, capsys) -> None:
    n = 2000
    df = pd.DataFrame({"step": np.arange(n), "loss": periodic_loss(n)})
    df.loc[50:52, "loss"] = np.nan
    log = tmp_path / "run.csv"
    df.to_csv(log, index=False)
    out = tmp_path / "report"
    assert main(["loss", str(log), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "loss: 3 NaN/Inf/empty values dropped" in err
    flags = json.loads((out / "flags.json").read_text())
    assert flags["schema"] == 1 and flags["flags"][0]["kind"] == "loss_spectrum"
    assert flags["flags"][0]["evidence"]["period_steps"] == pytest.approx(25, rel=0.02)
    spec = pd.read_csv(out / "tables" / "loss_spectrum.csv")
    assert {"series", "period_steps", "power", "p_value"} <= set(spec.columns)
    frac = pd.read_csv(out / "tables" / "fractal.csv")
    assert {"series", "box_counting", "higuchi"} <= set(frac.columns)
    assert main(["loss", str(log), "--out", str(out), "--fail-on", "0.5", "--quiet"]) == 1


def test_loss_command_errors_are_one_line(tmp_path, capsys) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("")
    assert main(["loss", str(bad), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(bad) in err and "Traceback" not in err
    assert main(["loss", str(bad), "--out", str(tmp_path / "o"), "--alpha", "3"]) == 2
    assert "alpha must be in" in capsys.readouterr().err


@pytest.mark.slow
def test_loss_command_on_a_store_and_ranks_in_a_log(tmp_path) -> None:
    from gradforensics.testing.planted import write_store

    n = 400
    y = periodic_loss(n, period=10)
    write_store(tmp_path / "s.zarr", lambda i, s, r: {"w": r.standard_normal((2, 2)).astype(np.float32)}, n,
                loss_fn=lambda i, s, r: float(y[i]))
    assert main(["loss", str(tmp_path / "s.zarr"), "--out", str(tmp_path / "r1"), "--quiet"]) == 0
    f = json.loads((tmp_path / "r1" / "flags.json").read_text())
    assert f["mode"] == "training" and f["n_records"] == n
    assert f["flags"][0]["tensor"] == "batches/loss"
    rows = [{"step": i, "rank": r, "loss": v} for r in range(2) for i, v in enumerate(periodic_loss(600, r))]
    log = tmp_path / "ranks.csv"
    pd.DataFrame(rows).to_csv(log, index=False)
    assert main(["loss", str(log), "--rank-col", "rank", "--out", str(tmp_path / "r2"), "--quiet"]) == 0
    coh = pd.read_csv(tmp_path / "r2" / "tables" / "coherence.csv")
    assert len(coh) >= 1 and coh["period_steps"].between(24.5, 25.5).any() and coh["significant"].any()


def test_loss_command_runs_every_registered_series_analysis(tmp_path) -> None:
    """``loss`` goes through the registry: an analysis registered here with a ``series``
    hook runs with its own options, and its flags reach flags.json and the report."""
    from gradforensics.analysis import registered
    from gradforensics.analysis.contract.advice import Advice
    from gradforensics.analysis.contract.model import Analysis, AnalysisResult, Flag
    from gradforensics.analysis.contract.options import NoOptions

    seen = {}

    def span(groups, opt):
        seen["options"] = opt
        rows = [{"tensor": g.combined.tensor, "head": None, "series": g.name, "span": float(np.ptp(g.combined.y))}
                for g in groups]
        return AnalysisResult(pd.DataFrame(rows, columns=["tensor", "head", "series", "span"]))

    def flags(result, ctx):
        seen["ctx"] = ctx
        return [Flag(kind="toy_span", tensor=r.tensor, head=None, sources=(), severity=0.9, records=(0, 0),
                     evidence={"span": r.span}, summary=f"{r.series} spans {r.span:.3g}.")
                for r in result.table.itertuples(index=False)]

    toy = Analysis(name="toy_span", needs=(), compute=lambda ctx: span(se.from_context(ctx), NoOptions()),
                   flags=flags, plot=lambda result, flag, ax: ax.plot([0, 1]), series=span,
                   kinds={"toy_span": Advice(title="Toy span", phrase="the series spans a range")})
    log = tmp_path / "run.csv"
    pd.DataFrame({"step": np.arange(500), "loss": periodic_loss(500)}).to_csv(log, index=False)
    with registered(toy):
        assert main(["loss", str(log), "--out", str(tmp_path / "r"), "--alpha", "0.02", "--quiet"]) == 0
    assert seen["options"] == NoOptions() and seen["ctx"].store is None and seen["ctx"].meta.mode == "training"
    assert seen["ctx"].options["loss_spectrum"].alpha == 0.02          # each analysis's own options, parsed
    kinds = {f["kind"] for f in json.loads((tmp_path / "r" / "flags.json").read_text())["flags"]}
    assert kinds == {"toy_span", "loss_spectrum"}
    assert pd.read_csv(tmp_path / "r" / "tables" / "toy_span.csv")["series"].tolist() == ["loss"]
    assert "Toy span" in (tmp_path / "r" / "report.md").read_text()


def test_loss_command_on_a_replay_store_flags_no_period(tmp_path) -> None:
    """As in ``analyze``: a replay store's record order is the capture schedule, not time."""
    from gradforensics.testing.planted import write_store

    n = 400
    y = periodic_loss(n, period=10)
    write_store(tmp_path / "s.zarr", lambda i, s, r: {"w": r.standard_normal((2, 2)).astype(np.float32)}, n,
                loss_fn=lambda i, s, r: float(y[i]), mode="replay")
    assert main(["loss", str(tmp_path / "s.zarr"), "--out", str(tmp_path / "r"), "--quiet"]) == 0
    assert json.loads((tmp_path / "r" / "flags.json").read_text())["flags"] == []
    spec = pd.read_csv(tmp_path / "r" / "tables" / "loss_spectrum.csv")
    assert (spec["significant"] & spec["period_steps"].between(9.8, 10.2)).any()
