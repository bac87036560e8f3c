"""Hand-built Findings with known truth, for the report tests (no store, no dask).

A conflict planted on ``model.layers.5–6`` q_proj/k_proj, heads 2 and 5, between
zh and en; a noise flag on one MLP; a non-finite loss record; a healthy code
source.  Flags carry ``evidence["analysis"]`` naming fake analyses that the
tests register (``install(monkeypatch)``), so the report draws with plots whose
behaviour the test controls (one of them raises).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from gradforensics.analysis.contract.model import Analysis, AnalysisResult, Findings, Flag

N_LAYERS, HEADS = 8, 8
CONFLICT_LAYERS, CONFLICT_HEADS, CONFLICT_MODULES = (5, 6), (2, 5), ("q_proj", "k_proj")
PAIRS = (("zh", "en"), ("zh", "code"), ("en", "code"))


def tensor(layer: int, module: str) -> str:
    return f"model.layers.{layer}.self_attn.{module}.weight"


def conflict_plot(result: AnalysisResult, flag: Flag, ax) -> None:
    t = result.table
    sub = t[(t.tensor == flag.tensor) & (t["head"].astype("Int64") == flag.head)]
    ax.bar([f"{a}/{b}" for a, b in zip(sub.source_a, sub.source_b)], sub.cosine, color="#b2182b")
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xlabel("source pair")
    ax.set_ylabel("cosine of mean gradients")
    ax.set_title("zh and en pull opposite ways")


def broken_plot(result: AnalysisResult, flag: Flag, ax) -> None:
    raise ValueError("planted plot bug")


def noop(*args, **kwargs):
    raise AssertionError("the report must not compute")


FAKES = {
    "tconflict": Analysis("tconflict", ("gram",), noop, noop, conflict_plot),
    "tnoise": Analysis("tnoise", ("gram",), noop, noop, broken_plot),
}


def install(monkeypatch) -> None:
    """Register the fake analyses (only them) for the duration of a test."""
    import gradforensics.analysis as analysis

    monkeypatch.setattr(analysis, "REGISTRY", dict(FAKES))


def findings(healthy: bool = False) -> Findings:
    rows, nrows, flags = [], [], []
    for layer in range(N_LAYERS):
        for module in ("q_proj", "k_proj", "v_proj", "o_proj"):
            t = tensor(layer, module)
            for head in [None, *range(HEADS)]:
                for a, b in PAIRS:
                    planted = (not healthy and layer in CONFLICT_LAYERS and module in CONFLICT_MODULES
                               and head in CONFLICT_HEADS and (a, b) == ("zh", "en"))
                    cos = -0.62 - 0.01 * (layer - 5) if planted else 0.05
                    rows.append({"tensor": t, "head": head, "source_a": a, "source_b": b, "cosine": cos,
                                 "p_value": 0.0005 if planted else 0.5})
                    if planted:
                        flags.append(Flag("conflict", t, head, (a, b), 0.91 if layer == 5 else 0.84, (0, 95),
                                          {"analysis": "tconflict", "cosine": cos, "p_value": 0.0005},
                                          f"{t} head {head}: zh and en point opposite ways (cos {cos:.2f})."))
                nrows.append({"tensor": t, "head": head, "source": "", "b_simple": 100.0, "snr": 0.5})
        nrows.append({"tensor": f"model.layers.{layer}.mlp.down_proj.weight", "head": None, "source": "",
                      "b_simple": 100.0, "snr": 0.5})
    if not healthy:
        flags.append(Flag("noise", "model.layers.0.mlp.down_proj.weight", None, (), 0.55, (0, 95),
                          {"analysis": "tnoise", "snr": 0.1, "b_simple": 2000.0}, "SNR 0.1: updates are noise."))
        flags.append(Flag("nonfinite", "batches/loss", None, ("code",), 0.6, (10, 10),
                          {"analysis": "tnoise", "nonfinite": 3}, "record 10 has a NaN loss."))
    results = {"tconflict": AnalysisResult(pd.DataFrame(rows), {"cos": np.zeros(3)}),
               "tnoise": AnalysisResult(pd.DataFrame(nrows))}
    header = {"model": {"class": "LlamaForCausalLM", "n_params": 123456},
              "sources": {"zh": 1 / 3, "en": 1 / 3, "code": 1 / 3},
              "versions": {"gradforensics": "test"}}
    return Findings("dump.zarr", 96, "replay", ("zh", "en", "code"), header, results, flags)
