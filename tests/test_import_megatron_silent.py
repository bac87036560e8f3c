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
import shutil
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


# ------------------------------------------------------------------ 4. tokens_per_expert under pipeline parallelism
N_EXPERTS, PP_LAYERS = 4, 4          # 4 decoder layers (2 per stage), 4 experts (2 per expert rank)


def _pp_tokens(it: int, layer: int) -> list[list[int]]:
    """Per micro-batch, the tokens routed to each of the 4 experts of global *layer*: each layer its own shares."""
    return [[10 * (layer + 1) + it, 5 + layer, 3, 1 + layer * it], [8, 2 * layer + 1, 4 + it, 6]]


def _pp_dump(save: Path, iters, *, last_stage_moe: bool = True) -> None:
    """TP 1, PP 2, EP 2 (world 4, ranks in Megatron-LM's order tp-cp-ep-dp-pp: rank r is pipeline stage r // 2,
    expert rank r % 2): wgrads of every stage's layers (stage-local numbers 0, 1; each with a router and two grouped
    local experts) and every rank's ``tokens_per_expert`` log of its stage-local layers."""
    g = torch.Generator().manual_seed(0)
    for it in iters:
        files = {}
        for p in range(2):
            for e in range(2):
                sd: dict[str, torch.Tensor] = {}
                for local in range(2):
                    pre = f"decoder.layers.{local}.mlp."
                    if p == 1 and not last_stage_moe:
                        sd[pre + "linear_fc1.weight"] = torch.randn(F, H, generator=g)
                        continue
                    sd[pre + "router.weight"] = torch.ones(N_EXPERTS, H)
                    for j in range(2):
                        sd[f"{pre}experts.linear_fc1.weight{j}"] = torch.randn(F, H, generator=g)
                files[f"mp_rank_00_{p:03d}_{e:03d}.pth"] = sd
        _save(save, "wgrads", it, files)
    d = save / "tokens_per_expert"
    d.mkdir(parents=True, exist_ok=True)
    for r in range(4):
        p, e = r // 2, r % 2
        if p == 1 and not last_stage_moe:
            continue
        with open(d / f"rank{r}.jsonl", "a") as f:
            for it in iters:
                for local in range(2):
                    tpe = [mb[2 * e:2 * e + 2] for mb in _pp_tokens(it, 2 * p + local)]
                    f.write(json.dumps({"iter": it, "block": "decoder", "layer": local, "tpe": tpe}) + "\n")


def test_tokens_per_expert_under_pipeline_parallelism_land_on_their_global_layers(tmp_path):
    """Before: not read under PP ("the log's layer numbers are per stage")."""
    iters = (1, 2, 3)
    _pp_dump(tmp_path / "save", iters)
    store = gf.import_run(tmp_path / "save", tmp_path / "s.zarr", heads=None, layout="pp=2,ep=2", moe_topk=2)
    assert store.router_modules == [f"decoder.layers.{i}.mlp.router" for i in range(PP_LAYERS)]
    for layer in range(PP_LAYERS):
        load = store.router(f"decoder.layers.{layer}.mlp.router", "load")
        want = np.array([np.sum(_pp_tokens(it, layer), axis=0) / np.sum(_pp_tokens(it, layer)) for it in iters])
        np.testing.assert_allclose(load, want, rtol=1e-6)
    router = store.meta.extra["import"]["router"]
    assert router.startswith("load and max_share from tokens_per_expert/")
    assert "default rank order tp-cp-ep-dp-pp, unchecked" in router      # no saved arguments: the assumption said


def test_tokens_per_expert_under_pp_with_tp_pp_dp_mapping_is_not_read(tmp_path):
    """A run with --use-tp-pp-dp-mapping puts its ranks on other stages: the default placement would be wrong
    silently; its saved arguments say so and the log is not read (with the arguments saying the default order,
    it is read and nothing is said to be unchecked)."""
    from tests.test_import_megatron_args import megatron_args, save_checkpoint

    for name, mapping in (("odd", True), ("plain", False)):
        save = tmp_path / name
        _pp_dump(save, (1, 2))
        save_checkpoint(save, 2, megatron_args(pipeline_model_parallel_size=2, expert_model_parallel_size=2,
                                               moe_router_topk=2, use_tp_pp_dp_mapping=mapping, num_attention_heads=4,
                                               padded_vocab_size=None))
        store = gf.import_run(save, tmp_path / f"{name}.zarr", heads=None)
        router = store.meta.extra["import"]["router"]
        if mapping:
            assert not store.router_modules and "--use-tp-pp-dp-mapping" in router, router
        else:
            assert store.router_modules and "unchecked" not in router, router


def test_tokens_per_expert_under_pp_that_cannot_be_placed_is_not_read_and_says_why(tmp_path):
    _pp_dump(tmp_path / "a", (1, 2), last_stage_moe=False)
    store = gf.import_run(tmp_path / "a", tmp_path / "a.zarr", heads=None, layout="pp=2,ep=2", moe_topk=2)
    assert not store.router_modules
    assert "the last pipeline stage has no expert layer" in store.meta.extra["import"]["router"]
    _pp_dump(tmp_path / "b", (1, 2))
    (tmp_path / "b" / "tokens_per_expert" / "rank1.jsonl").unlink()
    store = gf.import_run(tmp_path / "b", tmp_path / "b.zarr", heads=None, layout="pp=2,ep=2", moe_topk=2)
    assert "rank1.jsonl is missing: pipeline stage 0" in store.meta.extra["import"]["router"]
    with open(tmp_path / "b" / "tokens_per_expert" / "rank3.jsonl", "a") as f:     # a layer stage 1 does not have
        f.write(json.dumps({"iter": 2, "block": "decoder", "layer": 2, "tpe": [[1, 1]]}) + "\n")
    (tmp_path / "b" / "tokens_per_expert" / "rank1.jsonl").write_text((tmp_path / "b" / "tokens_per_expert" /
                                                                       "rank0.jsonl").read_text())
    store = gf.import_run(tmp_path / "b", tmp_path / "c.zarr", heads=None, layout="pp=2,ep=2", moe_topk=2)
    assert "logs layer 2 of pipeline stage 1, which has no experts in the dump" in store.meta.extra["import"]["router"]


def test_tokens_per_expert_with_virtual_stages_is_not_read_and_says_why(tmp_path):
    from gradforensics.importing.megatron import parse_layout
    from gradforensics.importing.megatron_routing import joined_routing

    (tmp_path / "tokens_per_expert").mkdir()
    (tmp_path / "tokens_per_expert" / "rank0.jsonl").write_text('{"iter": 1, "block": "decoder", "layer": 0, '
                                                                '"tpe": [[1, 1]]}\n')
    why = joined_routing(tmp_path, parse_layout("pp=2,vp=2"), [1], 1, stages={0: (0, frozenset({0}))})
    assert isinstance(why, str) and "virtual pipeline stages (vp=2)" in why and "mixing the chunks" in why


def test_an_activations_import_places_tokens_per_expert_by_its_own_stages(tmp_path):
    """``--kind activations``: the stages are read from the activations dump's own layer names."""
    save = tmp_path / "save"
    _pp_dump(save, (1, 2))
    shutil.rmtree(save / "wgrads")
    g = torch.Generator().manual_seed(3)
    for it in (1, 2):
        _save(save, "activations", it, {f"mp_rank_00_{p:03d}_{e:03d}.pth": {
            f"decoder.layers.{local}.mlp.router/output0": torch.randn(S * B, N_EXPERTS, generator=g)
            for local in range(2)} for p in range(2) for e in range(2)})
    store = gf.import_run(save, tmp_path / "a.zarr", kind="activations", layout="pp=2,ep=2", moe_topk=2)
    assert store.router_modules == [f"decoder.layers.{i}.mlp.router" for i in range(PP_LAYERS)]
    load = store.router("decoder.layers.3.mlp.router", "load")
    np.testing.assert_allclose(load[1], np.sum(_pp_tokens(2, 3), axis=0) / np.sum(_pp_tokens(2, 3)), rtol=1e-6)
