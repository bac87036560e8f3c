"""Analysis ``experts``: routing collapse, dead experts, a starved router, on stores recorded by the real capture.

Oracles: the planted truth (collapse onto expert 0 from record 16, the last expert given no token from
record 16, the router's gradient scaled by 1e-7) and the stored loads themselves (NumPy, exact); the
statistics' formulas against hand values.
"""

from __future__ import annotations

import numpy as np
import pytest

import gradforensics as gf
from gradforensics.analysis.kinds import experts as X
from gradforensics.store.reader import open_store

torch = pytest.importorskip("torch")

ONSET = 16


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _store(tmp_path_factory: pytest.TempPathFactory, name: str, **kw):
    from gradforensics.testing.planted_experts import planted_experts_store

    return planted_experts_store(tmp_path_factory.mktemp("experts") / f"{name}.zarr", onset=ONSET, **kw)


@pytest.fixture(scope="module")
def collapsing(tmp_path_factory):
    return _store(tmp_path_factory, "collapse", collapse=True)


def _experts_flags(findings) -> list:
    return [f for f in findings.flags if f.kind == "experts"]


def test_statistics_formulas() -> None:
    # concentration: 0 at the fair share 1/E, 1 at the top-k ceiling 1/k; NaN when k >= E
    np.testing.assert_allclose(X.concentration([1 / 8, 1 / 2, 0.3125], 8, 2), [0.0, 1.0, 0.5])
    assert X.concentration(0.85, 8, 1) == pytest.approx((0.85 - 0.125) / 0.875)
    assert np.isnan(X.concentration(0.5, 2, 2))
    assert X.collapse_severity(0.7, 1.0) == pytest.approx(0.5) and X.collapse_severity(0.2, 0.5) == pytest.approx(0.5)
    assert X.collapse_severity(0.3, 0.95) == 0.0 and X.collapse_severity(1.0, np.nan) == 1.0
    assert X.grad_severity(1e-4) == pytest.approx(0.5) and X.grad_severity(1e-2) == 0.0
    assert X.grad_severity(7e-10 / 1e-2) == 1.0 and X.grad_severity(0.0) == 1.0 and X.grad_severity(np.nan) == 0.0
    assert X.dead_severity(1, 8) == pytest.approx(0.625) and X.dead_severity(4, 8) == 1.0 and X.dead_severity(0, 8) == 0
    assert X.overload_level(8, 2) == pytest.approx(0.25) and X.overload_level(4, 2) == pytest.approx(0.375)
    load = np.full((12, 3), 1 / 3)
    load[4:, 2] = 0.0
    load[6, :] = np.nan                       # a record without tokens is skipped, not a break
    load[9:, 1] = 0.0
    assert X.dead_experts(load, 5) == {2: 4}
    assert X.dead_experts(load, 3) == {1: 9, 2: 4}


def test_collapsing_router_is_flagged_on_its_layer_since_the_onset(collapsing, tmp_path) -> None:
    s = open_store(collapsing)
    load = s.router("moe.gate", "load")
    assert s.router_modules == ["moe.gate"] and load.shape == (40, 8)
    np.testing.assert_allclose(load[ONSET:, 0], 0.5)          # planted: expert 0 in every token's top 2
    findings = gf.analyze(collapsing, progress=False, only=["experts"])
    (flag,) = _experts_flags(findings)
    assert (flag.tensor, flag.head) == ("moe.gate", None) and flag.severity == 1.0
    assert ONSET <= flag.evidence["since_record"] <= ONSET + 3 and flag.records == (flag.evidence["since_record"], 39)
    assert flag.evidence["concentration"] == pytest.approx(1.0) and flag.evidence["entropy_norm"] < 0.2
    assert flag.evidence["experts_named"] == [0] and flag.evidence["overloaded_experts"] == [0]
    assert "routing collapsed onto expert 0" in flag.summary
    # the layer's load-balancing loss: k = 2 while balanced, near E = 8 once collapsed (expert 0 in every
    # token's top 2 with probability ~1: 8 * (1 * ~1 + ...)); context in the evidence and the summary
    aux = s.router("moe.gate", "aux_loss")
    assert np.median(aux[:ONSET]) == pytest.approx(2.0, abs=0.3) and np.median(aux[ONSET:]) > 6.0
    assert flag.evidence["aux_loss_first"] == pytest.approx(float(np.median(aux[:5])))
    assert flag.evidence["aux_loss_last"] > 6.0 and np.isnan(flag.evidence["model_aux_loss_last"])
    assert "its load-balancing loss" in flag.summary
    row = findings.table("experts").iloc[0]
    assert row["max_share_last"] == pytest.approx(float(np.median(s.router("moe.gate", "max_share")[-5:])))
    gf.report(findings, tmp_path / "out")
    md = (tmp_path / "out" / "report.md").read_text()
    assert "Mixture-of-experts routing" in md and "z-loss" in md and "load-balancing" in md
    assert (tmp_path / "out" / "figures" / "finding-01-experts.png").is_file()


def test_dead_expert_is_named(tmp_path_factory) -> None:
    with pytest.warns(RuntimeWarning, match=r"moe.experts.7.weight has no .grad"):   # the capture says so too
        path = _store(tmp_path_factory, "dead", dead=True)
    assert (open_store(path).router("moe.gate", "load")[ONSET:, -1] == 0).all()
    findings = gf.analyze(path, progress=False, only=["experts"])
    (flag,) = _experts_flags(findings)
    assert flag.evidence["dead_experts"] == [7] and flag.evidence["n_dead"] == 1
    assert flag.severity == pytest.approx(0.625) and flag.records == (ONSET, 39)
    assert flag.evidence["collapse_severity"] < 0.1 and "dead expert(s) 7" in flag.summary


def test_starved_router_is_flagged(tmp_path_factory) -> None:
    path = _store(tmp_path_factory, "starve", starve=1e-7)
    findings = gf.analyze(path, progress=False, only=["experts"])
    (flag,) = _experts_flags(findings)
    s = open_store(path)
    g = s.read("grads/moe.gate.weight").astype(np.float64)
    u = s.read("grads/moe.experts.weight").astype(np.float64)
    oracle = np.median(np.sqrt((g ** 2).mean(axis=(1, 2))) / np.sqrt((u ** 2).mean(axis=(1, 2, 3))))
    assert flag.evidence["grad_ratio"] == pytest.approx(oracle, rel=1e-3) and oracle < 1e-6
    assert flag.severity == 1.0 and "starved router" in flag.summary


def test_healthy_balanced_router_has_no_flag_at_half(tmp_path_factory) -> None:
    path = _store(tmp_path_factory, "healthy", sources=2)
    findings = gf.analyze(path, progress=False, only=["experts"])
    assert all(f.severity < 0.5 for f in _experts_flags(findings))
    row = findings.table("experts").iloc[0]
    assert row["concentration"] < 0.4 and row["entropy_norm"] > 0.9 and row["n_dead"] == 0
    assert 1e-2 < row["grad_ratio"] < 1e2 and np.isfinite(row["source_spread"]) and not findings.not_judged


def test_too_few_records_is_not_judged_and_no_router_is_nothing_to_read(tmp_path_factory, tmp_path) -> None:
    path = _store(tmp_path_factory, "short", n_records=5, collapse=True)
    findings = gf.analyze(path, progress=False, only=["experts"])
    assert not _experts_flags(findings) and [n.kind for n in findings.not_judged] == ["experts"]
    assert "5 records" in findings.not_judged[0].reason
    plain = tmp_path / "plain.zarr"
    rng = np.random.default_rng(0)
    with gf.Recorder(plain, sources=["a"], background=False) as rec:
        for i in range(12):
            rec.record(step=i, loss=1.0, source="a", grads={"w": rng.standard_normal((4, 4)).astype(np.float32)})
    findings = gf.analyze(plain, progress=False, only=["experts"])
    assert not findings.flags and not findings.not_judged and len(findings.table("experts")) == 0



def test_tiny_mixtral_captured_and_judged_per_layer_without_a_flag_at_half(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MixtralConfig(vocab_size=40, hidden_size=16, intermediate_size=8, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    with gf.Recorder(tmp_path / "m.zarr", model=model, sources=["a", "b"], experts="auto") as rec:
        for i in range(12):
            ids = torch.randint(0, 40, (4, 16))
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            rec.record(step=i, loss=loss, source="ab"[i % 2])
            opt.step()
            opt.zero_grad()
    findings = gf.analyze(tmp_path / "m.zarr", progress=False, only=["experts"])
    table = findings.table("experts")
    assert list(table["tensor"]) == [f"model.layers.{i}.mlp.gate" for i in range(2)]
    assert (table["experts"] == 4).all() and (table["top_k"] == 2).all()
    assert np.isfinite(table["grad_ratio"]).all() and np.isfinite(table["source_spread"]).all()
    assert all(f.severity < 0.5 for f in _experts_flags(findings))
