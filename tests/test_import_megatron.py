"""``gradforensics import --format megatron``: Megatron-LM dumps, sharded here as Megatron shards them, joined back.

The reference is an unsharded Megatron-core GPT parameter set (names as
``GPTModel.named_parameters()`` gives them: ``embedding.word_embeddings.weight``,
``decoder.layers.<i>.self_attention.linear_qkv.weight``, ...), with one random gradient
per tensor and iteration.  :func:`write_dump` cuts it the way Megatron's parallel layers
hold it - column-parallel rows and row-parallel columns split evenly over the
tensor-parallel ranks (a gated ``linear_fc1`` split half by half), the fused QKV rows
(``[group][q.. | k | v][d]``) split by query group, ``decoder.layers`` numbered locally
per pipeline stage and virtual chunk, experts spread over the expert ranks, every
non-expert tensor repeated on each of them - and writes each rank's
``{"model_chunk<i>": {name: tensor}}`` with ``torch.save`` at
``<save>/wgrads/iter_<7 digits>/mp_rank_<tp:02d>[_<pp:03d>][_<ep:03d>].pth`` (the layout of
``save_grads`` in ``megatron/training/checkpointing.py``).  The import must give the
reference back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import gradforensics as gf  # noqa: E402
from gradforensics.store.heads import HeadSpec  # noqa: E402


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    vp: int = 1
    ep: int = 1
    layers: int = 4
    hidden: int = 16
    heads: int = 4
    groups: int = 2
    head_dim: int = 4
    ffn: int = 8
    vocab: int = 32
    experts: int = 0            # 0: a dense MLP
    gated: bool = True


def reference(lay: Layout, seed: int) -> dict[str, torch.Tensor]:
    """The unsharded gradients of one iteration."""
    g = torch.Generator().manual_seed(seed)
    h, r = lay.hidden, lay.heads // lay.groups
    qkv_rows = lay.groups * (r + 2) * lay.head_dim
    fc1 = 2 * lay.ffn if lay.gated else lay.ffn
    shapes = {"embedding.word_embeddings.weight": (lay.vocab, h), "decoder.final_layernorm.weight": (h,),
              "output_layer.weight": (lay.vocab, h)}
    for i in range(lay.layers):
        p = f"decoder.layers.{i}."
        shapes.update({p + "self_attention.linear_qkv.layer_norm_weight": (h,),
                       p + "self_attention.linear_qkv.weight": (qkv_rows, h),
                       p + "self_attention.linear_qkv.bias": (qkv_rows,),
                       p + "self_attention.linear_proj.weight": (h, lay.heads * lay.head_dim),
                       p + "self_attention.linear_proj.bias": (h,)})
        if lay.experts:
            shapes[p + "mlp.router.weight"] = (lay.experts, h)
            for e in range(lay.experts):
                shapes[p + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = (fc1, h)
                shapes[p + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = (h, lay.ffn)
        else:
            shapes.update({p + "mlp.linear_fc1.layer_norm_weight": (h,), p + "mlp.linear_fc1.weight": (fc1, h),
                           p + "mlp.linear_fc2.weight": (h, lay.ffn)})
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def _tp_part(name: str, t: torch.Tensor, rank: int, lay: Layout) -> torch.Tensor:
    leaf, param = name.split(".")[-2:]
    if lay.gated and leaf == "linear_fc1" and param == "weight":
        gate, up = t.chunk(2, dim=0)
        return torch.cat([gate.chunk(lay.tp, 0)[rank], up.chunk(lay.tp, 0)[rank]], dim=0).clone()
    if leaf in ("linear_qkv", "linear_fc1", "word_embeddings", "output_layer") and param in ("weight", "bias"):
        return t.chunk(lay.tp, 0)[rank].clone()
    if leaf in ("linear_proj", "linear_fc2") and param == "weight":
        return t.chunk(lay.tp, 1)[rank].clone()
    return t.clone()


def _chunk_of(name: str, lay: Layout) -> tuple[int, int, str] | None:
    """(virtual chunk, pipeline rank, local name) of a non-expert tensor."""
    per = lay.layers // (lay.pp * lay.vp)
    parts = name.split(".")
    if parts[0] == "decoder" and parts[1] == "layers":
        i = int(parts[2])
        c, p = divmod(i // per, lay.pp)
        return c, p, ".".join(["decoder", "layers", str(i % per), *parts[3:]])
    if name.startswith("embedding."):
        return 0, 0, name
    return lay.vp - 1, lay.pp - 1, name


def write_dump(save: Path, lay: Layout, grads_by_iter: dict[int, dict[str, torch.Tensor]],
               kind: str = "wgrads") -> Path:
    n_local = lay.experts // lay.ep if lay.experts else 0
    for it, grads in grads_by_iter.items():
        d = save / kind / f"iter_{it:07d}"
        d.mkdir(parents=True)
        for t in range(lay.tp):
            for p in range(lay.pp):
                for e in range(lay.ep):
                    chunks: dict[str, dict[str, torch.Tensor]] = {f"model_chunk{c}": {} for c in range(lay.vp)}
                    for name, g in grads.items():
                        where = _chunk_of(name, lay)
                        assert where is not None
                        c, pp, local = where
                        if pp != p:
                            continue
                        if ".experts.local_experts." in local:
                            head, _, rest = local.partition(".experts.local_experts.")
                            j, _, tail = rest.partition(".")
                            if int(j) // n_local != e:
                                continue
                            local = f"{head}.experts.local_experts.{int(j) % n_local}.{tail}"
                        chunks[f"model_chunk{c}"][local] = _tp_part(name, g, t, lay)
                    fname = f"mp_rank_{t:02d}" + (f"_{p:03d}" if lay.pp > 1 else "") + \
                        (f"_{e:03d}" if lay.ep > 1 else "")
                    torch.save(chunks, d / f"{fname}.pth")
    return save


def as_units(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """*grads* with each layer's experts (``local_experts.<j>.X`` or grouped ``X<j>``) stacked in expert order into
    one ``(E, ...)`` tensor named without the expert index, as the import stores them (the test's own stacking)."""
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[int, torch.Tensor]] = {}
    for n, t in grads.items():
        m = re.match(r"^(.*\.experts\.)local_experts\.(\d+)\.(.*)$", n)
        g = re.match(r"^(.*\.experts\.linear_fc[12]\.weight)(\d+)$", n)
        if m:
            groups.setdefault(m.group(1) + m.group(3), {})[int(m.group(2))] = t
        elif g:
            groups.setdefault(g.group(1), {})[int(g.group(2))] = t
        else:
            out[n] = t
    for unit, by in groups.items():
        out[unit] = torch.stack([by[j] for j in range(len(by))])
    return out


def _merged(store, name: str) -> np.ndarray:
    data = store.read(f"grads/{name}")
    spec = HeadSpec.from_attrs(store.grads[name].attrs)
    return data if spec is None else np.stack([spec.merge(r) for r in data])


LAYOUTS = {
    "tp2_pp2": Layout(tp=2, pp=2),
    "tp2_pp2_vp2": Layout(tp=2, pp=2, vp=2),
    "tp2_ep2": Layout(tp=2, ep=2, experts=4),
    "pp2_ep2": Layout(pp=2, ep=2, experts=4, gated=False),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(LAYOUTS))
def test_joined_gradients_equal_the_unsharded_ones(tmp_path, case):
    lay = LAYOUTS[case]
    ref = {it: reference(lay, it) for it in (10, 20)}
    save = write_dump(tmp_path / "save", lay, ref)
    layout = f"tp={lay.tp},pp={lay.pp},ep={lay.ep},vp={lay.vp}" if lay.experts else None     # experts need it
    store = gf.import_run(save, tmp_path / "imp.zarr", gated_mlp=lay.gated, heads=None, layout=layout)
    assert store.batches()["step"].tolist() == [10, 20]
    ref = {it: as_units(g) for it, g in ref.items()}
    want = {n for n, t in ref[10].items() if t.ndim >= 2}
    assert set(store.grads) == want
    for name in want:
        got = _merged(store, name)
        for i, it in enumerate((10, 20)):
            assert np.array_equal(got[i], ref[it][name].numpy()), (case, name, it)


def test_qkv_split_by_query_group_and_a_planted_head_lands_in_its_head(tmp_path):
    lay = LAYOUTS["tp2_pp2"]
    r, d = lay.heads // lay.groups, lay.head_dim
    ref = reference(lay, 0)
    qkv = "decoder.layers.2.self_attention.linear_qkv.weight"
    planted = 3                                   # query head 3: group 1, second query head of it
    x = ref[qkv].view(lay.groups, r + 2, d, lay.hidden)
    x[planted // r, planted % r] += 100.0
    save = write_dump(tmp_path / "save", lay, {5: ref})
    store = gf.import_run(save, tmp_path / "imp.zarr", format="megatron", gated_mlp=True,
                          num_heads=lay.heads, num_query_groups=lay.groups)
    info = store.grads[qkv]
    assert info.heads == lay.heads + 2 * lay.groups and info.attrs["role"] == "qkv"
    blocks = store.read(f"grads/{qkv}")[0]               # (H + 2G, d, hidden): q heads, k groups, v groups
    for h in range(lay.heads):
        assert np.array_equal(blocks[h], x[h // r, h % r].numpy()), h
    for g in range(lay.groups):
        assert np.array_equal(blocks[lay.heads + g], x[g, r].numpy())
        assert np.array_equal(blocks[lay.heads + lay.groups + g], x[g, r + 1].numpy())
    big = np.abs(blocks).reshape(len(blocks), -1).max(axis=1)
    assert np.argmax(big) == planted and big[planted] > 90 and np.delete(big, planted).max() < 10
    proj = store.grads["decoder.layers.2.self_attention.linear_proj.weight"]
    assert proj.heads == lay.heads and proj.attrs["split_axis"] == 1


def test_multi_head_attention_gets_qkv_labels(tmp_path):
    lay = Layout(tp=2, groups=4)
    ref = reference(lay, 1)
    save = write_dump(tmp_path / "save", lay, {1: ref})
    store = gf.import_run(save, tmp_path / "imp.zarr", format="megatron", gated_mlp=True, num_heads=4)
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert store.grads[qkv].attrs["head_labels"][:5] == ["q0", "q1", "q2", "q3", "k0"]
    x = ref[qkv].view(4, 3, lay.head_dim, lay.hidden)
    blocks = store.read(f"grads/{qkv}")[0]
    assert np.array_equal(blocks[4 + 2], x[2, 1].numpy()) and np.array_equal(blocks[8 + 1], x[1, 2].numpy())


def test_params_dump_becomes_weight_snapshots(tmp_path):
    lay = LAYOUTS["tp2_pp2"]
    grads = {it: reference(lay, it) for it in (2, 4)}
    params = {it: reference(lay, 100 + it) for it in (2, 4)}
    save = write_dump(tmp_path / "save", lay, grads)
    write_dump(save, lay, params, kind="params")
    store = gf.import_run(save, tmp_path / "imp.h5", format="megatron", gated_mlp=True, heads=None,
                          tensors=["*.linear_fc1.weight"])
    assert store.weight_records().tolist() == [0, 1]
    name = "decoder.layers.3.mlp.linear_fc1.weight"
    w = store.read(f"weights/{name}")
    assert np.array_equal(w[1], params[4][name].numpy())
    assert np.array_equal(_merged(store, name)[0], grads[2][name].numpy())
