"""Megatron-LM mixture-of-experts dumps: experts stored as ``(N, E, ...)`` units, per-token tensors whose shape varies.

The fixtures are written byte for byte in the layout of NVIDIA/Megatron-LM at commit
``d98e8a64ddf34856e74b24714e3bedb2f5a39553``: ``megatron/training/checkpointing.py`` ``save_grads``
(``<save>/<label>/iter_<7 digits>/mp_rank_<tp:02d>[_<ep:03d>].pth``, ``torch.save`` of
``{"model_chunk0": {name: tensor}}``), the expert names of ``megatron/core/transformer/moe/experts.py``
(``SequentialMLP``: ``experts.local_experts.<j>.linear_fc1.weight``; ``TEGroupedMLP``:
``experts.linear_fc1.weight<j>``, ``j`` local to the expert rank) and the per-module keys of
``megatron/training/dgrad_logging.py`` (``<module>/output<k>``, ``<module>/input<k>``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import gradforensics as gf  # noqa: E402
from gradforensics.cli import main  # noqa: E402
from gradforensics.errors import CheckpointError, ImportSourceError  # noqa: E402

E, H, F = 4, 6, 8


def _write(save: Path, label: str, it: int, files: dict[str, dict[str, torch.Tensor]]) -> None:
    d = save / label / f"iter_{it:07d}"
    d.mkdir(parents=True)
    for fname, sd in files.items():
        torch.save({"model_chunk0": sd}, d / fname)


def _expert_name(layer: int, j: int, leaf: str, grouped: bool) -> str:
    return (f"decoder.layers.{layer}.mlp.experts.{leaf}.weight{j}" if grouped
            else f"decoder.layers.{layer}.mlp.experts.local_experts.{j}.{leaf}.weight")


def _truth(seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One iteration's unsharded gradients: per layer the router, every expert's fc1 / fc2, the attention."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(2):
        p = f"decoder.layers.{layer}."
        out[p + "mlp.router.weight"] = torch.randn(E, H, generator=g)
        out[p + "self_attention.linear_qkv.weight"] = torch.randn(3 * H, H, generator=g)
        for j in range(E):
            out[(p, j, "linear_fc1")] = torch.randn(F, H, generator=g)      # type: ignore[index]
            out[(p, j, "linear_fc2")] = torch.randn(H, F, generator=g)      # type: ignore[index]
    return {k: v.to(dtype) for k, v in out.items()}  # type: ignore[misc]


def _dump_experts(save: Path, it: int, truth: dict, *, grouped: bool, label: str = "wgrads") -> None:
    """TP 2 x EP 2 (ETP = TP): fc1 rows and fc2 columns split over TP, experts 2 per expert rank, every
    non-expert tensor repeated on each expert rank (``save_grads``' note)."""
    files = {}
    for tp in range(2):
        for ep in range(2):
            sd = {}
            for k, t in truth.items():
                if isinstance(k, tuple):
                    p, j, leaf = k
                    if j // 2 != ep:
                        continue
                    part = t.chunk(2, 0)[tp] if leaf == "linear_fc1" else t.chunk(2, 1)[tp]
                    sd[_expert_name(int(p.split(".")[2]), j % 2, leaf, grouped)] = part.clone()
                elif k.endswith("linear_qkv.weight"):
                    sd[k] = t.chunk(2, 0)[tp].clone()
                else:
                    sd[k] = t.clone()
            files[f"mp_rank_{tp:02d}_{ep:03d}.pth"] = sd
    _write(save, label, it, files)


def _bits(a: np.ndarray | torch.Tensor) -> np.ndarray:
    """The stored bits: a bfloat16 tensor as the uint16 patterns the store keeps, else its values."""
    if isinstance(a, np.ndarray):
        return a
    return a.view(torch.int16).numpy().view(np.uint16) if a.dtype == torch.bfloat16 else a.numpy()


@pytest.mark.parametrize("grouped", [False, True], ids=["sequential", "grouped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_experts_are_one_unit_per_layer_and_weight_each_slice_its_expert_bit_for_bit(tmp_path, grouped, dtype):
    truths = {it: _truth(it, dtype) for it in (5, 10, 15)}
    for it, t in truths.items():
        _dump_experts(tmp_path / "save", it, t, grouped=grouped)
    _dump_experts(tmp_path / "save", 10, _truth(99, dtype), grouped=grouped, label="params")
    store = gf.import_run(tmp_path / "save", tmp_path / "s.zarr", heads=None, layout="tp=2,ep=2")
    units = {f"decoder.layers.{i}.mlp.experts.{leaf}.weight" for i in range(2) for leaf in ("linear_fc1", "linear_fc2")}
    assert units <= set(store.grads)
    assert not [n for n in store.grads if "local_experts" in n or n[-1].isdigit()]   # no per-expert tensor left
    for unit in units:
        leaf = unit.split(".")[-2]
        layer = unit.split(".")[2]
        assert store.experts_of(unit) == E and store.grads[unit].attrs["experts"] == E
        got = store.read(f"grads/{unit}")
        assert got.shape == ((3, E, F, H) if leaf == "linear_fc1" else (3, E, H, F))
        for i, it in enumerate(truths):
            for j in range(E):
                want = truths[it][(f"decoder.layers.{layer}.", j, leaf)]
                assert np.array_equal(_bits(got[i, j]), _bits(want)), (unit, it, j)
    assert store.meta.extra["import"]["experts_units"] == {u: E for u in sorted(units)}
    assert store.weights[units.pop()].shape[1] == E          # the params snapshot is stacked alike


def test_the_analyses_read_imported_experts_like_captured_ones(tmp_path):
    """drift reads each experts unit as one tensor (as a captured fused unit); experts has no router statistics to
    read without tokens_per_expert: an empty table, no flag."""
    for it in range(1, 10):
        _dump_experts(tmp_path / "save", it, _truth(it, torch.float32), grouped=True)
    store = gf.import_run(tmp_path / "save", tmp_path / "s.zarr", heads=None, layout="tp=2,ep=2")
    found = gf.analyze(store, only=["experts", "drift"], progress=False)
    drift = found.table("drift")
    assert drift is not None
    assert set(drift["tensor"]) == set(store.grads) and "decoder.layers.1.mlp.experts.linear_fc2.weight" in store.grads
    assert not [f for f in found.flags if f.kind == "experts"]


# ------------------------------------------------------------------ dgrads whose shape varies
TOKENS = {1: 5, 2: 9, 3: 7}          # tokens routed to the experts of layer 0 in each saved iteration
S, B = 3, 2


def _dgrads_truth(it: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(it)
    return {"decoder.layers.0.self_attention.linear_qkv/output0": torch.randn(S, B, 3 * H, generator=g),
            "decoder.layers.0.self_attention.linear_proj/output0": torch.randn(S, B, H, generator=g),
            "decoder.layers.0.mlp.router/input0": torch.randn(S * B, H, generator=g),
            "decoder.layers.0.mlp.experts.linear_fc1/output0": torch.randn(TOKENS[it], F, generator=g),
            "decoder.layers.0.mlp.experts.linear_fc2/input0": torch.randn(TOKENS[it], F, generator=g)}


def _dump_dgrads(save: Path, *, ep: int = 1, fixed: bool = False) -> dict[int, dict[str, torch.Tensor]]:
    """TP 2: column-parallel outputs split along the last axis, the rest the same on both ranks."""
    truths = {}
    for it in TOKENS:
        t = _dgrads_truth(it)
        if fixed:
            t = {n: (v[:4] if "experts" in n else v) for n, v in t.items()}
        truths[it] = t
        files = {}
        for tp in range(2):
            for e in range(ep):
                sd = {n: (v.chunk(2, -1)[tp] if n.endswith(("linear_qkv/output0", "linear_fc1/output0",
                                                              "linear_fc2/input0")) else v).clone()
                      for n, v in t.items()}
                if e:                               # another expert rank's tokens under the same names
                    sd = {n: (v + 1 if "experts" in n else v) for n, v in sd.items()}
                files[f"mp_rank_{tp:02d}" + (f"_{e:03d}" if ep > 1 else "") + ".pth"] = sd
        _write(save, "dgrads", it, files)
    return truths


def test_moe_activation_gradients_of_varying_shape_are_named_and_the_rest_imported(tmp_path, capsys):
    truths = _dump_dgrads(tmp_path / "save")
    out = tmp_path / "d.zarr"
    assert main(["import", str(tmp_path / "save"), "--format", "megatron", "--kind", "dgrads", "--heads", "none",
                 "--layout", "tp=2", "--out", str(out)]) == 0
    err = [ln for ln in capsys.readouterr().err.splitlines() if "not imported" in ln]
    assert len(err) == 1 and "decoder.layers.0.mlp.experts.linear_fc1.output0" in err[0] and "(5, 8), (9, 8)" in err[0]
    store = gf.open_store(out)
    varying = {"decoder.layers.0.mlp.experts.linear_fc1.output0", "decoder.layers.0.mlp.experts.linear_fc2.input0"}
    assert set(store.meta.extra["import"]["not_imported"]) == varying
    assert store.n_records == 3 and not varying & set(store.grads)
    for name in ("decoder.layers.0.self_attention.linear_qkv/output0", "decoder.layers.0.mlp.router/input0",
                 "decoder.layers.0.self_attention.linear_proj/output0"):
        got = store.read(f"grads/{name.replace('/', '.')}")
        for i, it in enumerate(TOKENS):
            assert np.array_equal(got[i], truths[it][name].numpy()), name


def test_only_varying_tensors_chosen_is_one_line(tmp_path):
    _dump_dgrads(tmp_path / "save")
    with pytest.raises(ImportSourceError, match=r"every tensor chosen is left out: .*experts.linear_fc1/output0: its "
                                                r"shape changes between saved iterations") as e:
        gf.import_run(tmp_path / "save", tmp_path / "d.zarr", kind="dgrads", heads=None, tensors=["*experts*"],
                      layout="tp=2")
    assert "\n" not in str(e.value)


def test_grouped_experts_per_token_tensors_under_expert_parallelism_are_left_out_even_of_fixed_shape(tmp_path):
    """Capacity-padded routing gives fixed shapes; each expert rank still holds other experts' tokens."""
    truths = _dump_dgrads(tmp_path / "save", ep=2, fixed=True)
    store = gf.import_run(tmp_path / "save", tmp_path / "d.zarr", kind="dgrads", heads=None, layout="tp=2,ep=2")
    left = store.meta.extra["import"]["not_imported"]
    assert set(left) == {"decoder.layers.0.mlp.experts.linear_fc1.output0",
                         "decoder.layers.0.mlp.experts.linear_fc2.input0"}
    assert all("each of the 2 expert ranks holds its own experts' tokens" in why for why in left.values())
    got = store.read("grads/decoder.layers.0.mlp.router.input0")
    assert np.array_equal(got[2], truths[3]["decoder.layers.0.mlp.router/input0"].numpy())


def test_fixed_shape_expert_activation_gradients_without_expert_parallelism_are_imported(tmp_path):
    truths = _dump_dgrads(tmp_path / "save", fixed=True)
    store = gf.import_run(tmp_path / "save", tmp_path / "d.zarr", kind="dgrads", heads=None, layout="tp=2")
    assert store.meta.extra["import"]["not_imported"] == {}
    got = store.read("grads/decoder.layers.0.mlp.experts.linear_fc1.output0")
    assert np.array_equal(got[1], truths[2]["decoder.layers.0.mlp.experts.linear_fc1/output0"].numpy())


# ------------------------------------------------------------------ router loads from tokens_per_expert/
def _tokens(it: int, layer: int) -> list[list[int]]:
    """Per micro-batch (2), the tokens routed to each of the E experts (top-2: 32 tokens, 64 assignments): layer 0
    collapses onto experts 0 and 1 from iteration 6 (expert 0 in every token's top 2), layer 1 stays balanced."""
    if layer == 0 and it >= 6:
        return [[32, 30, 1, 1], [32, 29, 2, 1]]
    return [[16 + it % 2, 16, 15, 17 - it % 2], [16, 17, 16 - it % 2, 15 + it % 2]]


def _log_tokens(save: Path, iters, *, tp: int = 2, ep: int = 2) -> None:
    """``save_tpe``: every rank appends, per logged iteration and layer, its local experts' counts per micro-batch;
    ranks in Megatron-LM's expert order tp-ep-dp-pp (ETP = TP): rank r is expert rank (r // tp) % ep."""
    d = save / "tokens_per_expert"
    d.mkdir(parents=True, exist_ok=True)
    n_local = E // ep
    for r in range(tp * ep):
        e = (r // tp) % ep
        with open(d / f"rank{r}.jsonl", "a") as f:
            for it in iters:
                for layer in range(2):
                    tpe = [mb[e * n_local:(e + 1) * n_local] for mb in _tokens(it, layer)]
                    f.write(json.dumps({"iter": it, "block": "decoder", "layer": layer, "tpe": tpe}) + "\n")


def test_tokens_per_expert_become_router_loads_and_the_experts_analysis_names_the_collapse(tmp_path):
    iters = range(1, 13)
    for it in iters:
        _dump_experts(tmp_path / "save", it, _truth(it, torch.float32), grouped=True)
    _log_tokens(tmp_path / "save", iters)
    store = gf.import_run(tmp_path / "save", tmp_path / "s.zarr", heads=None, layout="tp=2,ep=2", moe_topk=2)
    assert store.router_modules == ["decoder.layers.0.mlp.router", "decoder.layers.1.mlp.router"]
    for layer in range(2):
        load = store.router(f"decoder.layers.{layer}.mlp.router", "load")
        want = np.array([np.sum(_tokens(it, layer), axis=0) / np.sum(_tokens(it, layer)) for it in iters])
        np.testing.assert_allclose(load, want, rtol=1e-6)
        assert np.array_equal(store.router(f"decoder.layers.{layer}.mlp.router", "max_share"), load.max(axis=1))
        assert np.isnan(store.router(f"decoder.layers.{layer}.mlp.router", "entropy")).all()
    assert store.arrays["router/decoder.layers.0.mlp.router/load"].attrs["top_k"] == 2
    found = gf.analyze(store, only=["experts"], progress=False)
    flags = sorted(found.flags, key=lambda f: -f.severity)
    assert flags and flags[0].tensor == "decoder.layers.0.mlp.router" and flags[0].severity >= 0.5
    assert "collapsed onto expert 0" in flags[0].summary
    assert not [f for f in flags if f.tensor == "decoder.layers.1.mlp.router" and f.severity >= 0.5]


def test_tokens_per_expert_not_read_says_why_and_a_malformed_line_is_one_line(tmp_path):
    for it in (1, 2):
        _dump_experts(tmp_path / "save", it, _truth(it, torch.float32), grouped=True)
    _log_tokens(tmp_path / "save", (1, 2))
    store = gf.import_run(tmp_path / "save", tmp_path / "a.zarr", heads=None, layout="tp=2,ep=2")
    assert not store.router_modules
    assert "give the run's --moe-router-topk as --moe-topk K" in store.meta.extra["import"]["router"]
    dense = tmp_path / "dense"                  # one dense rank file, the log of several ranks, no --layout
    (dense / "wgrads" / "iter_0000001").mkdir(parents=True)
    torch.save({"model_chunk0": {"w.weight": torch.ones(2, 2)}}, dense / "wgrads" / "iter_0000001" / "mp_rank_00.pth")
    _log_tokens(dense, (1,))
    store = gf.import_run(dense, tmp_path / "b.zarr", heads=None, moe_topk=2)
    assert "give --layout (ep=, etp=)" in store.meta.extra["import"]["router"] and not store.router_modules
    with open(tmp_path / "save" / "tokens_per_expert" / "rank3.jsonl", "a") as f:
        f.write('{"iter": 2, "block": "decoder", "layer": 0, "tpe": [[1, -4]]}\n')
    with pytest.raises(CheckpointError, match=r"rank3.jsonl:5: 'tpe' must be a list of micro-batches") as e:
        gf.import_run(tmp_path / "save", tmp_path / "c.zarr", heads=None, layout="tp=2,ep=2", moe_topk=2)
    assert "\n" not in str(e.value)
