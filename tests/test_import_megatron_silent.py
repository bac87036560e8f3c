"""Megatron-LM: the last silent joins of issue 41 - gated ``linear_fc1`` activation gradients, dense dgrads under
expert parallelism, and ``tokens_per_expert/`` under pipeline parallelism.

Rank files are written byte for byte in ``save_grads``' layout, read from NVIDIA/Megatron-LM at commit
``d98e8a64ddf34856e74b24714e3bedb2f5a39553`` (``megatron/training/checkpointing.py`` ``save_grads``:
``<save>/<kind>/iter_<N:07d>/mp_rank_<tp:02d>[_<pp:03d>][_<ep:03d>].pth``, ``torch.save({"model_chunk<i>":
{key: tensor}})``; ``dgrads`` keys ``<module>/output<k>`` from ``megatron/training/dgrad_logging.py``):

* a gated MLP (``--swiglu``): ``megatron/core/transformer/mlp.py`` builds ``linear_fc1`` as one
  column-parallel linear of ``2 * ffn`` outputs whose rank-local shard is ``[its gate rows | its up rows]``
  (``apply_swiglu_sharded_factory`` cuts each rank's weight in two halves), and its activation function
  (``glu``, ``bias_swiglu_impl``) chunks each rank's own output in two along the last axis: the output's
  activation gradient on rank ``t`` is ``[d gate_t | d up_t]``, not ``t``-th slice of ``[d gate | d up]``;
* under expert parallelism every expert rank writes a file (``save_grads`` runs on expert-data-parallel rank
  0, which spans the expert ranks) and the dense layers of expert rank ``e`` ran their own data-parallel
  micro-batch;
* ``tokens_per_expert/rank<R>.jsonl``: ``megatron/training/activation_logging.py`` ``save_tpe``, ``layer`` the
  layer number inside the rank's model chunk.

The truth is the unsharded tensor built here.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import gradforensics as gf  # noqa: E402
from gradforensics.commands.inspect import summarize, summary_lines  # noqa: E402

S, B, H, F = 4, 2, 6, 4
FC1, FC2 = "decoder.layers.0.mlp.linear_fc1", "decoder.layers.0.mlp.linear_fc2"


def _save(save: Path, kind: str, it: int, files: dict[str, dict[str, torch.Tensor]]) -> None:
    d = save / kind / f"iter_{it:07d}"
    d.mkdir(parents=True, exist_ok=True)
    for name, sd in files.items():
        torch.save({"model_chunk0": sd}, d / name)


# ------------------------------------------------------------------ 1. gated linear_fc1 activation gradients
def _gated_dump(save: Path, kind: str, tp: int = 2) -> dict[int, dict[str, torch.Tensor]]:
    """TP ``tp``, SwiGLU: ``linear_fc1``'s output (and its gradient) ``[S, B, 2F]`` = ``[gate | up]`` unsharded; rank
    ``t`` holds ``[gate_t | up_t]`` (its weight shard's rows)."""
    truths = {}
    for it in (1, 2):
        g = torch.Generator().manual_seed(it)
        gate, up = torch.randn(S, B, F, generator=g), torch.randn(S, B, F, generator=g) + 3.0
        full = {f"{FC1}/output0": torch.cat([gate, up], dim=-1), f"{FC1}/input0": torch.randn(S, B, H, generator=g),
                f"{FC2}/input0": torch.randn(S, B, F, generator=g), f"{FC2}/output0": torch.randn(S, B, H, generator=g)}
        truths[it] = full
        files = {}
        for t in range(tp):
            files[f"mp_rank_{t:02d}.pth"] = {
                f"{FC1}/output0": torch.cat([gate.chunk(tp, -1)[t], up.chunk(tp, -1)[t]], dim=-1).clone(),
                f"{FC1}/input0": full[f"{FC1}/input0"].clone(),
                f"{FC2}/input0": full[f"{FC2}/input0"].chunk(tp, -1)[t].clone(),
                f"{FC2}/output0": full[f"{FC2}/output0"].clone()}
        _save(save, kind, it, files)
    return truths


def test_gated_fc1_activation_gradients_are_joined_half_by_half(tmp_path):
    """Before: joined rank by rank, ``[g0 u0 g1 u1]`` - the gate's second half stored among the up units."""
    truths = _gated_dump(tmp_path / "save", "dgrads")
    store = gf.import_run(tmp_path / "save", tmp_path / "d.zarr", kind="dgrads", heads=None, gated_mlp=True,
                          layout="tp=2")
    for n in (f"{FC1}/output0", f"{FC1}/input0", f"{FC2}/input0", f"{FC2}/output0"):
        got = store.read(f"grads/{n.replace('/', '.')}")
        for i, it in enumerate((1, 2)):
            assert torch.equal(torch.from_numpy(got[i]), truths[it][n]), n
    plain = gf.import_run(tmp_path / "save", tmp_path / "p.zarr", kind="dgrads", heads=None, layout="tp=2")
    rank_by_rank = torch.from_numpy(plain.read(f"grads/{FC1}.output0")[0])     # without --gated-mlp: as dumped
    assert not torch.equal(rank_by_rank, truths[1][f"{FC1}/output0"])


def test_gated_fc1_activations_are_joined_half_by_half_once(tmp_path):
    """The activations path joins through the same merge: the up half's statistics are its own (mean ~3)."""
    truths = _gated_dump(tmp_path / "save", "activations", tp=4)
    store = gf.import_run(tmp_path / "save", tmp_path / "a.zarr", kind="activations", gated_mlp=True, layout="tp=4",
                          tensors=[f"{FC1}/output0"])
    mean = store.read(f"acts/{FC1}/mean")
    want = truths[1][f"{FC1}/output0"].reshape(-1, 2 * F).mean(0).numpy()
    np.testing.assert_allclose(mean[0], want, rtol=1e-5, atol=1e-6)
    assert (mean[0][F:] > 1.5).all() and (mean[0][:F] < 1.5).all()


# ------------------------------------------------------------------ 2. dense dgrads / activations under EP
PROJ_OUT = "decoder.layers.0.self_attention.linear_proj/output0"
EXPERT_IN = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc2/input0"


def _ep_dump(save: Path, kind: str) -> dict[int, list[dict[str, torch.Tensor]]]:
    """TP 1, EP 2: each expert rank's file holds its own micro-batch's dense activation gradient (other tokens)
    and its local expert's (fixed shape: capacity-padded routing)."""
    per_rank = {}
    for it in (1, 2):
        g = torch.Generator().manual_seed(10 + it)
        files, ranks = {}, []
        for e in range(2):
            sd = {PROJ_OUT: torch.randn(S, B, H, generator=g) + 5.0 * e, EXPERT_IN: torch.randn(3, F, generator=g)}
            ranks.append(sd)
            files[f"mp_rank_00_{e:03d}.pth"] = {n: t.clone() for n, t in sd.items()}
        per_rank[it] = ranks
        _save(save, kind, it, files)
    return per_rank


@pytest.mark.parametrize("kind", ["dgrads", "activations"])
def test_dense_tensors_under_expert_parallelism_are_expert_rank_0s_micro_batch_and_say_so(tmp_path, kind):
    """Before: merge() said the expert ranks' dense copies were equal and the store did not say whose tokens."""
    per_rank = _ep_dump(tmp_path / "save", kind)
    store = gf.import_run(tmp_path / "save", tmp_path / "s.zarr", kind=kind, heads=None, layout="ep=2")
    if kind == "dgrads":
        got = store.read(f"grads/{PROJ_OUT.replace('/', '.')}")
        for i, it in enumerate((1, 2)):
            assert torch.equal(torch.from_numpy(got[i]), per_rank[it][0][PROJ_OUT])          # expert rank 0's
        experts = store.read("grads/decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.input0")
        assert torch.equal(torch.from_numpy(experts[0]), per_rank[1][1][EXPERT_IN])         # every expert rank's
    else:
        mean = store.read("acts/decoder.layers.0.self_attention.linear_proj/mean")
        want = per_rank[1][0][PROJ_OUT].reshape(-1, H).mean(0).numpy()
        np.testing.assert_allclose(mean[0], want, rtol=1e-5, atol=1e-6)
    dense = store.meta.extra["import"]["dense"]
    what = "activation gradients" if kind == "dgrads" else "activations"
    assert dense.startswith("expert rank 0's micro-batch") and f"the dense {what} of the other" in dense
    assert f"  dense layers: {dense}" in summary_lines(summarize(store))


def test_wgrads_under_expert_parallelism_say_nothing_of_micro_batches(tmp_path):
    save = tmp_path / "save"
    for it in (1, 2):
        w = torch.randn(H, H)
        _save(save, "wgrads", it, {f"mp_rank_00_{e:03d}.pth": {"decoder.layers.0.self_attention.linear_proj.weight":
                                                                w.clone()} for e in range(2)})
    store = gf.import_run(save, tmp_path / "w.zarr", heads=None, layout="ep=2")
    assert store.meta.extra["import"]["dense"] is None
