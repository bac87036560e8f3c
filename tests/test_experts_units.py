"""Per-expert units in the direction analyses: drift and conflict judge each expert of an experts unit
(``grads/<unit>`` ``(N, E, ...)``, attribute ``experts``) as they judge each head, and name it "expert j".

Oracle: the planted truth (:func:`~gradforensics.testing.planted_experts.planted_expert_units_store`):
one expert's direction turns (drift) or is pulled opposite ways by the two sources (conflict); every
other expert is unchanged and alike for both sources.
"""

from __future__ import annotations

import json

import numpy as np

import gradforensics as gf
from gradforensics.testing.planted_experts import planted_expert_units_store

J = 2


def _check(findings, kind: str) -> None:
    flags = [f for f in findings.flags if f.kind == kind and f.tensor == "moe.w"]
    assert [f.head for f in flags] == [J]               # the planted expert alone, not the whole unit
    (flag,) = flags
    assert flag.severity >= 0.5 and flag.evidence["expert"] == J
    assert flag.summary.startswith(f"moe.w expert {J}:") and "head" not in flag.summary
    t = findings.table(kind)
    per = t[(t["tensor"] == "moe.w") & t["head"].notna()]
    assert sorted(per["head"].astype(int)) == [0, 1, 2, 3]            # one row per expert
    quiet = per[per["head"] != J]["severity"].to_numpy()
    assert np.all(quiet < 0.1), quiet                                  # its neighbours are quiet


def test_drift_names_the_expert_that_turned(tmp_path) -> None:
    p = planted_expert_units_store(tmp_path / "d.zarr", "drift", expert=J)
    findings = gf.analyze(p, progress=False, only=["drift"])
    _check(findings, "drift")
    row = findings.table("drift").set_index(["tensor", "head"]).loc[("moe.w", J)]
    assert row["cos_early"] > 0.9 and row["cos_late"] < 0.1          # planted: a turn by 90 degrees
    assert 15 <= findings.flags[0].records[0] <= 25                   # onset at record 20, over ten records
    gf.report(findings, tmp_path / "out")
    out = json.loads((tmp_path / "out" / "flags.json").read_text())["flags"]
    assert [(f["tensor"], f["head"], f["evidence"]["expert"]) for f in out if f["kind"] == "drift"] == [("moe.w", J, J)]
    md = (tmp_path / "out" / "report.md").read_text()
    assert f"moe.w expert {J}" in md and f"moe.w, expert {J}" in md and "head 2" not in md   # headline, verdict too


def test_conflict_names_the_expert_the_sources_fight_over(tmp_path) -> None:
    p = planted_expert_units_store(tmp_path / "c.zarr", "conflict", expert=J)
    findings = gf.analyze(p, progress=False, only=["conflict"])
    _check(findings, "conflict")
    t = findings.table("conflict").set_index(["tensor", "head"])
    assert t.loc[("moe.w", J), "cosine"] < -0.9                       # planted: exactly opposite, plus noise
    assert all(t.loc[("moe.w", e), "cosine"] > 0.9 for e in (0, 1, 3))     # the others: one direction for both
    assert "in this tensor experts 2" in findings.flags[0].summary


def test_a_store_without_experts_still_says_head(tmp_path) -> None:
    from gradforensics.analysis.toolkit.units import where

    assert where("q", 3) == "q head 3" and where("q", 3, experts=True) == "q expert 3" and where("q", None) == "q"


def test_every_kind_names_experts_not_heads(tmp_path) -> None:
    """All analyses on a store with an experts unit: any flag on one of its experts says "expert j"
    (drift, conflict, noise, oscillation), none says "head"."""
    p = planted_expert_units_store(tmp_path / "c.zarr", "conflict", expert=J)
    findings = gf.analyze(p, progress=False)
    on_experts = [f for f in findings.flags if f.tensor == "moe.w" and f.head is not None]
    assert on_experts, [(f.kind, f.tensor, f.head) for f in findings.flags]
    for f in on_experts:
        assert f.evidence["expert"] == f.head and f"expert {f.head}" in f.summary and " head " not in f.summary, f


def test_long_history_regime_judges_each_expert_too(tmp_path) -> None:
    """Above N₀ (forced: ``long_history=0``) the window and per-source aggregates are per expert as well."""
    for kind in ("drift", "conflict"):
        p = planted_expert_units_store(tmp_path / f"{kind}.zarr", kind, expert=J)
        findings = gf.analyze(p, progress=False, only=[kind], options={"engine": {"long_history": 0}})
        assert findings.header["regime"]["name"] == "long-history"
        _check(findings, kind)


def test_every_report_output_says_expert(tmp_path, capsys) -> None:
    """report.md / report.html (overview caption, flags table, layer table, analysis tables), flags.json, compare
    and inspect: a unit of experts reads "expert j", never "head j" or "heads 0-3"."""
    import re

    from gradforensics.cli import main

    before = planted_expert_units_store(tmp_path / "b.zarr", "drift", expert=J, onset=10_000)   # no turn
    after = planted_expert_units_store(tmp_path / "a.zarr", "drift", expert=J)
    gf.report(gf.analyze(after, progress=False), tmp_path / "out")
    md = (tmp_path / "out" / "report.md").read_text()
    html = (tmp_path / "out" / "report.html").read_text()
    for text in (md, html):
        assert "each block split into experts 0–3" in text and "heads 0–3" not in text      # the overview caption
        assert not re.search(r"head \d", text)
    assert f"| `moe.w` | expert {J} | 1.00 |" in md                                # the finding's flags table
    assert [ln.split("|")[3].strip() for ln in md.splitlines() if ln.startswith("|  | `moe.w` |")] == \
        ["", *(f"expert {e}" for e in range(4))]                              # the layer table: whole unit, experts
    assert f'<td class="num" data-v="{J}">expert {J}</td>' in html                  # sorted by its index
    assert html.count(f">expert {J}</td>") >= 3                                    # flags, layer and analysis tables
    out = json.loads((tmp_path / "out" / "flags.json").read_text())["flags"]
    assert all(f"expert {f['head']}" in f["summary"] for f in out if f["head"] is not None)
    assert main(["compare", str(before), str(after), "--out", str(tmp_path / "cmp")]) == 0
    said = capsys.readouterr().out
    assert f"moe.w expert {J}" in said and "head" not in said
    cmp_md = (tmp_path / "cmp" / "report.md").read_text()
    assert f"on `moe.w expert {J}`" in cmp_md and f"| expert {J} |" in cmp_md and not re.search(r"head \d", cmp_md)
    assert main(["inspect", str(after)]) == 0
    assert re.search(r"moe\.w +\(48, 4, 8, 6\) float32 experts=4 ", capsys.readouterr().out)


def test_spectral_judges_each_expert_as_a_matrix(tmp_path) -> None:
    """Planted: from record 20 expert 2's gradient is one rank-1 direction; the other experts keep full rank.
    Before, an experts unit (N, E, a, b) was no matrix to spectral: it had no row at all."""
    p = planted_expert_units_store(tmp_path / "r.zarr", "rank", expert=J)
    findings = gf.analyze(p, progress=False, only=["spectral"])
    t = findings.table("spectral")
    per = t[(t["tensor"] == "moe.w") & t["head"].notna()].set_index("head")
    assert sorted(per.index.astype(int)) == [0, 1, 2, 3] and (t["tensor"] == "moe.w").sum() == 5   # + the unit
    assert per.loc[J, "stable_rank"] < 1.2 and per.loc[J, "stable_rank_first"] > 4                 # rank 1 from ~6
    quiet = per.drop(index=J)["stable_rank_drop"].to_numpy()
    assert np.all(quiet < 1.3), quiet
    flags = [f for f in findings.flags if f.tensor == "moe.w" and f.evidence["reason"] == "rank_collapse"]
    assert [f.head for f in flags] == [J] and flags[0].severity >= 0.5 and flags[0].evidence["expert"] == J
    assert flags[0].summary.startswith(f"moe.w expert {J}: the window-mean gradient's stable rank fell")
    assert "diluted by its other experts" in flags[0].summary


def test_precision_judges_each_expert(tmp_path) -> None:
    """Planted: expert 2's weights are 1000x its neighbours' and its updates a tenth: every update is below half
    a bf16 ULP (swamped) while about 4% of the others' are; the whole unit's share (28%) dilutes it."""
    p = planted_expert_units_store(tmp_path / "p.zarr", "precision", expert=J)
    findings = gf.analyze(p, progress=False, only=["precision"])
    t = findings.table("precision")
    per = t[(t["tensor"] == "moe.w") & t["head"].notna()].set_index("head")
    assert sorted(per.index.astype(int)) == [0, 1, 2, 3]
    assert per.loc[J, "swamped_bf16"] == 1.0 and np.all(per.drop(index=J)["swamped_bf16"] < 0.1)
    whole = t[(t["tensor"] == "moe.w") & t["head"].isna()].iloc[0]
    np.testing.assert_allclose(whole["swamped_bf16"], per["swamped_bf16"].mean(), rtol=0.02)  # equal-size experts
    (flag,) = [f for f in findings.flags if f.tensor == "moe.w"]
    assert flag.head == J and flag.evidence["expert"] == J and flag.severity >= 0.9
    assert flag.summary.startswith(f"moe.w expert {J}: 100% of its weight updates")
