"""The records map: classical MDS against exact oracles, planted conflict and oscillation
seen in the map, the map in report.html / report.md, and a one-line omission when no K is saved."""

from __future__ import annotations

import numpy as np
import pytest

import gradforensics as gf
from gradforensics.reporting import recordsmap, report
from gradforensics.reporting.recordsmap import classical_mds, cosine_map
from gradforensics.store.reader import Store
from gradforensics.testing.planted_directions import planted_conflict, planted_oscillation


# ---------------------------------------------------------------- oracles
def _pairwise(x: np.ndarray) -> np.ndarray:
    return np.sqrt(((x[:, None, :] - x[None, :, :]) ** 2).sum(-1))


def test_classical_mds_recovers_planted_2d_points_exactly() -> None:
    rng = np.random.default_rng(0)
    pts = rng.standard_normal((40, 2)) * [3.0, 1.0]
    d2 = _pairwise(pts) ** 2
    xy, w = classical_mds(d2, 2)
    np.testing.assert_allclose(_pairwise(xy), _pairwise(pts), atol=1e-9)        # every distance, up to a rigid motion
    assert w[2:].max() < 1e-8 * w[0]                                            # nothing beyond two dimensions
    # points in 5-D: the map is their first two principal components (SVD oracle)
    x = rng.standard_normal((30, 5)) * [5, 2, 0.5, 0.3, 0.1]
    xy, _ = classical_mds(_pairwise(x) ** 2, 2)
    xc = x - x.mean(0)
    u, s, _ = np.linalg.svd(xc, full_matrices=False)
    np.testing.assert_allclose(np.abs(xy), np.abs(u[:, :2] * s[:2]), atol=1e-9)


def test_cosine_map_is_pca_of_the_unit_gradients_and_skips_empty_records() -> None:
    from sklearn.decomposition import PCA

    rng = np.random.default_rng(1)
    g = rng.standard_normal((25, 300)) + 2.0 * rng.standard_normal(300)
    g[[3, 11]] = 0.0                                                           # no usable gradient: left out
    xy, keep, explained = cosine_map(g @ g.T)
    assert keep.tolist() == [i for i in range(25) if i not in (3, 11)]
    u = g[keep] / np.linalg.norm(g[keep], axis=1, keepdims=True)
    pca = PCA(2).fit(u)
    np.testing.assert_allclose(np.abs(xy), np.abs(pca.transform(u)), atol=1e-9)
    assert explained == pytest.approx(pca.explained_variance_ratio_.sum(), rel=1e-9)
    with np.errstate(all="ignore"):
        assert cosine_map(np.zeros((4, 4)))[1].size == 0                       # nothing to place, no error


# ---------------------------------------------------------------- planted
@pytest.fixture(scope="module")
def conflict_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("conflict")
    planted_conflict(0, n=48).write(d / "s.zarr")
    findings = gf.analyze(d / "s.zarr", progress=False, options={"engine": {"save_grams": "all"}})   # a healthy unit too
    return d, findings


@pytest.mark.slow
def test_planted_conflict_separates_the_two_sources(conflict_run) -> None:
    d, findings = conflict_run
    m, why = recordsmap.records_map(findings, Store(d / "s.zarr"))
    assert why is None and m is not None and m.kind == "conflict"
    assert (m.tensor, m.head) in {("model.layers.1.self_attn.q_proj.weight", 1),
                                  ("model.layers.1.self_attn.q_proj.weight", 2), ("model.layers.2.mlp.up_proj.weight", None)}
    src = np.array(m.source)
    assert sorted(set(src)) == ["code", "en", "zh"] and len(src) == 48
    c = {s: m.xy[src == s].mean(0) for s in ("zh", "en")}
    spread = max(np.sqrt(((m.xy[src == s] - c[s]) ** 2).sum(1).mean()) for s in c)
    assert np.linalg.norm(c["zh"] - c["en"]) > 4 * spread                       # two clouds, well apart
    # a healthy unit of the same store: the same sources do not separate
    k = recordsmap.unit_gram(Store(d / "s.zarr"), "model.layers.0.self_attn.q_proj.weight", 0)[0]
    xy, keep, _ = cosine_map(k)
    cz, ce = xy[src[keep] == "zh"].mean(0), xy[src[keep] == "en"].mean(0)
    within = np.sqrt(((xy - xy.mean(0)) ** 2).sum(1).mean())
    assert np.linalg.norm(cz - ce) < within


@pytest.mark.slow
def test_planted_oscillation_shows_two_poles_visited_in_turn(tmp_path) -> None:
    planted_oscillation(0, n=64, mode="training").write(tmp_path / "o.zarr")
    findings = gf.analyze(tmp_path / "o.zarr", progress=False, only=["oscillation"])
    m, why = recordsmap.records_map(findings, Store(tmp_path / "o.zarr"))
    assert why is None and m is not None and m.kind == "oscillation" and m.step_label == "optimizer step"
    pole = m.xy[:, 0] > 0
    assert 0.3 < pole.mean() < 0.7                                               # two poles, both visited
    gap = m.xy[pole, 0].min() - m.xy[~pole, 0].max()
    assert gap > 3 * max(m.xy[pole, 0].std(), m.xy[~pole, 0].std())              # far apart on axis 1
    order = np.argsort(m.step)
    assert np.mean(pole[order][1:] != pole[order][:-1]) > 0.9                    # period 2: every step flips


@pytest.mark.slow
def test_report_html_and_markdown_carry_the_map(conflict_run, tmp_path) -> None:
    d, findings = conflict_run
    paths = report(findings, tmp_path / "rep", store=str(d / "s.zarr"))
    html = paths["html"].read_text(encoding="utf-8")
    md = paths["markdown"].read_text(encoding="utf-8")
    assert 'id="records-map"' in html and 'id="fig-records-map-01-conflict"' in html
    assert html.index('id="records-map"') > html.index('id="finding-1"')        # in the conflict's section
    assert "figures/records-map-01-conflict.png" in md and paths["figures/records-map-01-conflict"].stat().st_size
    assert "No records map" not in html
    # without the store argument the report opens the findings' own store for its saved K
    again = report(findings, tmp_path / "rep2")
    assert 'id="records-map"' in again["html"].read_text(encoding="utf-8")


@pytest.mark.slow
def test_map_omitted_in_one_line_when_no_gram_is_saved(tmp_path, monkeypatch) -> None:
    planted_conflict(1, n=36).write(tmp_path / "s.zarr")
    findings = gf.analyze(tmp_path / "s.zarr", progress=False, only=["conflict"],
                          options={"engine": {"persist": False}})
    assert recordsmap.pick(findings) is not None
    paths = report(findings, tmp_path / "rep", store=str(tmp_path / "s.zarr"))
    html = paths["html"].read_text(encoding="utf-8")
    assert 'id="records-map-note"' in html and "No records map: the store holds no saved Gram matrices" in html
    assert 'id="records-map"' not in html
    assert "*No records map: the store holds no saved Gram matrices" in paths["markdown"].read_text(encoding="utf-8")
    # a long history whose pass saved an empty Gram index: the same, with its own reason
    monkeypatch.setattr("gradforensics.store.results.read_document", lambda store, key: [])
    monkeypatch.setattr("gradforensics.store.results.has_result", lambda store, key: True)
    m, why = recordsmap.records_map(findings, Store(tmp_path / "s.zarr"))
    assert m is None and "long history" in why


@pytest.mark.slow
def test_more_records_than_the_cap_are_subsampled(conflict_run, monkeypatch) -> None:
    d, findings = conflict_run
    monkeypatch.setattr(recordsmap, "MAX_POINTS", 20)
    m, _ = recordsmap.records_map(findings, Store(d / "s.zarr"))
    assert m is not None and len(m.records) == 20 and m.n_records == 48
    assert m.records[0] == 0 and m.records[-1] == 47
    fig = recordsmap.figure(m)
    assert "20 of 48 records" in fig.get_suptitle()


def test_no_direction_finding_no_map() -> None:
    from gradforensics.analysis.contract.model import Findings, Flag

    f = Flag(kind="noise", tensor="whole model", head=None, sources=(), severity=0.3, records=(0, 1), evidence={},
             summary="x")
    findings = Findings(store="nowhere", n_records=2, mode="replay", sources=("a",), header={}, results={}, flags=[f])
    assert recordsmap.pick(findings) is None and recordsmap.records_map(findings, None) == (None, None)
