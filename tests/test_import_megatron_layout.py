"""``--layout tp=,pp=,ep=,etp=,vp=``: the run's parallel sizes checked against the dump, ETP != TP, MTP under PP.

The dumps are written rank by rank as Megatron-LM writes them, read from NVIDIA/Megatron-LM at
commit ``d98e8a64ddf34856e74b24714e3bedb2f5a39553`` (August 2026):

* ``megatron/training/checkpointing.py`` ``save_grads``: only ranks of expert-data-parallel rank 0
  write, to ``<save>/wgrads/iter_<7 digits>/mp_rank_<tp:02d>[_<pp:03d>][_<ep:03d>].pth`` (``_<pp>`` when
  the pipeline size is above 1, ``_<ep>`` when the expert-parallel size is), ``torch.save(dict)`` of
  ``{"model_chunk<i>": {name: tensor}}``; the name carries the *dense* tensor-parallel rank only.
* ``megatron/core/parallel_state.py`` ``initialize_model_parallel``: the dense grid ``tp-cp-ep-dp-pp``
  (ep=1) and the expert grid ``tp-ep-dp-pp`` with ``tp = expert_tensor_parallel_size`` over the same
  world, so a stage's local rank ``r`` has tensor-parallel rank ``r % tp``, expert tensor-parallel rank
  ``r % etp``, expert rank ``(r // etp) % ep`` and expert-data-parallel rank ``r // (etp * ep)``.  Under
  ETP > TP two such ranks share one file name: the later write is what is on disk (the writer here
  writes in rank order, the same outcome).
* ``megatron/core/transformer/multi_token_prediction.py``: the MTP block's ``layers`` (a ``ModuleList`` of
  ``MultiTokenPredictionLayer`` with ``enorm``, ``hnorm``, ``eh_proj``, ``mtp_model_layer``,
  ``final_layernorm``) is built on the last pipeline stage only (``mtp_on_this_rank``,
  ``get_mtp_num_layers_to_build``) and numbered from 0 apart from the decoder (``get_mtp_layer_offset``
  is 0 without a custom pipeline layout).

The truth is the unsharded gradient built here; the import must give it back bit for bit.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from test_import_megatron import as_units  # noqa: E402

import gradforensics as gf  # noqa: E402
from gradforensics.cli import main  # noqa: E402
from gradforensics.errors import MissingShardError, ShardMismatchError, SpecError  # noqa: E402
from gradforensics.importing.megatron import parse_layout  # noqa: E402

H, F, V = 8, 4, 16
COLUMN = ("word_embeddings", "output_layer", "linear_qkv", "linear_fc1", "eh_proj")
ROW = ("linear_proj", "linear_fc2")


def truth(seed: int, *, layers: int = 2, experts: int = 0, mtp: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes: dict[str, tuple[int, ...]] = {"embedding.word_embeddings.weight": (V, H),
                                          "decoder.final_layernorm.weight": (H,), "output_layer.weight": (V, H)}
    for i in range(layers):
        p = f"decoder.layers.{i}."
        shapes |= {p + "self_attention.linear_qkv.layer_norm_weight": (H,),
                   p + "self_attention.linear_proj.weight": (H, H)}
        if experts:
            shapes[p + "mlp.router.weight"] = (experts, H)
            for e in range(experts):
                shapes[p + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = (F, H)
                shapes[p + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = (H, F)
        else:
            shapes[p + "mlp.linear_fc1.weight"] = (F, H)
    for i in range(mtp):
        p = f"mtp.layers.{i}."
        shapes |= {p + "enorm.weight": (H,), p + "eh_proj.weight": (H, 2 * H),
                   p + "mtp_model_layer.self_attention.linear_proj.weight": (H, H)}
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def _part(name: str, t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    leaf, param = name.split(".")[-2:]
    if leaf in COLUMN and param in ("weight", "bias"):
        return t.chunk(size, 0)[rank].clone()
    if leaf in ROW and param == "weight":
        return t.chunk(size, 1)[rank].clone()
    return t.clone()


def _place(name: str, layers: int, pp: int, vp: int) -> tuple[int, int, str]:
    """(pipeline rank, virtual chunk, local name) as Megatron places a tensor."""
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        per = layers // (pp * vp)
        c, p = divmod(int(parts[2]) // per, pp)
        return p, c, ".".join(["decoder", "layers", str(int(parts[2]) % per), *parts[3:]])
    if name.startswith("embedding."):
        return 0, 0, name
    return pp - 1, vp - 1, name                  # final norm, output layer and the MTP block: the last stage


def save_grads(save: Path, it: int, grads: dict[str, torch.Tensor], *, tp: int = 1, pp: int = 1, ep: int = 1,
               etp: int | None = None, vp: int = 1, layers: int = 2, experts: int = 0) -> None:
    """Every rank of every stage runs ``save_grads``; those of expert-data-parallel rank 0 write."""
    etp = tp if etp is None else etp
    world = math.lcm(tp, etp * ep)               # one stage's ranks: tp * dp == etp * ep * edp
    n_local = experts // ep if experts else 0
    d = save / "wgrads" / f"iter_{it:07d}"
    d.mkdir(parents=True, exist_ok=True)
    for p in range(pp):
        for r in range(world):
            t, et, e, edp = r % tp, r % etp, (r // etp) % ep, r // (etp * ep)
            if edp != 0:
                continue
            chunks: dict[str, dict[str, torch.Tensor]] = {f"model_chunk{c}": {} for c in range(vp)}
            for name, g in grads.items():
                sp, c, local = _place(name, layers, pp, vp)
                if sp != p:
                    continue
                if ".experts.local_experts." in local:
                    head, _, rest = local.partition(".experts.local_experts.")
                    j, _, tail = rest.partition(".")
                    if int(j) // n_local != e:
                        continue
                    chunks[f"model_chunk{c}"][f"{head}.experts.local_experts.{int(j) % n_local}.{tail}"] = \
                        _part(name, g, et, etp)
                else:
                    chunks[f"model_chunk{c}"][local] = _part(name, g, t, tp)
            fname = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") + (f"_{e:03d}" if ep > 1 else "")
            torch.save(dict(chunks), d / f"{fname}.pth")


def _dump(save: Path, **lay) -> dict[int, dict[str, torch.Tensor]]:
    gsize = {k: lay[k] for k in ("layers", "experts") if k in lay}
    mtp = lay.pop("mtp", 0)
    ref = {it: truth(it, **gsize, mtp=mtp) for it in (1, 2)}
    for it, g in ref.items():
        save_grads(save, it, g, **lay)
    return ref


def _equal(store, ref: dict[int, dict[str, torch.Tensor]]) -> None:
    ref = {it: as_units(g) for it, g in ref.items()}          # experts stacked (E, ...), as the import stores them
    want = {n for n, t in ref[1].items() if t.ndim >= 2}
    assert set(store.grads) == want
    for n in want:
        got = store.read(f"grads/{n}")
        for i, it in enumerate((1, 2)):
            assert torch.equal(torch.from_numpy(got[i]), ref[it][n]), n


def _one_line(e: pytest.ExceptionInfo[BaseException]) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


# ------------------------------------------------------------------ the layout, given and checked
def test_layout_parses_and_malformed_ones_fail_in_one_line():
    lay = parse_layout("tp=2,pp=2,ep=2,etp=1,vp=2")
    assert (lay.tp, lay.pp, lay.ep, lay.etp_size, lay.vp) == (2, 2, 2, 1, 2)
    assert parse_layout("tp=4").etp_size == 4 and parse_layout({"ep": 2}).ep == 2
    for bad in ("tp2", "tp=x", "dp=2", "tp=0"):
        with pytest.raises(SpecError, match="--layout"):
            parse_layout(bad)


def test_a_layout_that_fits_the_files_joins_them(tmp_path):
    ref = _dump(tmp_path / "save", tp=2, pp=2, ep=2, layers=4, experts=4)
    store = gf.import_run(tmp_path / "save", tmp_path / "a.zarr", heads=None, layout="tp=2,pp=2,ep=2")
    _equal(store, ref)
    assert store.meta.extra["import"]["layout"] == "tp=2,pp=2,ep=2,etp=2,vp=1"


@pytest.mark.parametrize(("layout", "says"), [
    ("tp=4,pp=2,ep=2", "mp_rank_02_000_000.pth is missing"),
    ("tp=1,pp=2,ep=2", "mp_rank_01_000_000.pth: not written by --layout tp=1,pp=2,ep=2,etp=1,vp=1 (its "
                       "tensor-parallel rank is outside it)"),
    ("tp=2,pp=2,ep=1", "the file name does not fit --layout tp=2,pp=2,ep=1"),
    ("tp=2,pp=3,ep=2", "mp_rank_00_002_000.pth is missing"),
    ("tp=2,pp=2,ep=2,vp=2", "holds 1 model chunk(s) (model_chunk0); --layout vp=2"),
])
def test_a_layout_that_disagrees_with_the_files_is_refused_naming_what_differs(tmp_path, layout, says):
    _dump(tmp_path / "save", tp=2, pp=2, ep=2, layers=4, experts=4)
    with pytest.raises((MissingShardError, ShardMismatchError)) as e:
        gf.import_run(tmp_path / "save", tmp_path / "a.zarr", heads=None, layout=layout)
    assert says in _one_line(e)


# ------------------------------------------------------------------ expert tensor-parallel size != TP
@pytest.mark.parametrize("lay", [dict(tp=2, ep=2, etp=1), dict(tp=2, ep=4, etp=1), dict(tp=4, ep=2, etp=2),
                                 dict(tp=2, pp=2, ep=2, etp=1)], ids=str)
def test_etp_below_tp_is_joined_with_the_layout(tmp_path, lay):
    """Each expert is whole (ETP 1) or split over ETP ranks; the files are a diagonal of the TP x EP grid."""
    ref = _dump(tmp_path / "save", layers=2 * lay.get("pp", 1), experts=4, **lay)
    with pytest.raises(MissingShardError) as e:          # the file names alone: a grid with holes
        gf.import_run(tmp_path / "save", tmp_path / "a.zarr", heads=None)
    assert "give --layout tp=,ep=,etp=" in _one_line(e)
    text = ",".join(f"{k}={v}" for k, v in lay.items())
    store = gf.import_run(tmp_path / "save", tmp_path / "b.zarr", heads=None, layout=text)
    _equal(store, ref)


def test_the_command_takes_layout_and_refuses_a_wrong_one_in_one_line(tmp_path, capsys):
    ref = _dump(tmp_path / "save", tp=2, ep=2, etp=1, experts=4)
    argv = ["import", str(tmp_path / "save"), "--format", "megatron", "--heads", "none", "--quiet", "--out"]
    assert main([*argv, str(tmp_path / "a.zarr"), "--layout", "tp=2,ep=2,etp=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "mp_rank_00_001.pth is missing (--layout tp=2,pp=1,ep=2,etp=2,vp=1 writes 4 files here, 2 are present)" \
        in err and len(err.splitlines()) == 1
    assert main([*argv, str(tmp_path / "b.zarr"), "--layout", "tp=2,ep=2,etp=1"]) == 0
    _equal(gf.open_store(tmp_path / "b.zarr"), ref)


def test_etp_below_tp_where_dense_shards_were_never_written_is_refused(tmp_path):
    _dump(tmp_path / "save", tp=2, ep=1, etp=1, experts=2)           # only local rank 0 writes
    with pytest.raises(SpecError) as e:
        gf.import_run(tmp_path / "save", tmp_path / "a.zarr", heads=None, layout="tp=2,ep=1,etp=1")
    assert "only 1 of the 2 tensor-parallel ranks write a file" in _one_line(e)


def test_etp_above_tp_is_refused_with_the_layout(tmp_path):
    """TP 1, ETP 2: both expert shards go to one file name; the one on disk is half an expert."""
    _dump(tmp_path / "save", tp=1, ep=2, etp=2, experts=4)
    assert sorted(p.name for p in (tmp_path / "save/wgrads/iter_0000001").iterdir()) == [
        "mp_rank_00_000.pth", "mp_rank_00_001.pth"]
    with pytest.raises(SpecError) as e:
        gf.import_run(tmp_path / "save", tmp_path / "a.zarr", heads=None, layout="tp=1,ep=2,etp=2")
    assert "expert tensor-parallel size above the tensor-parallel size is not supported" in _one_line(e)


# ------------------------------------------------------------------ MTP layers under pipeline parallelism
@pytest.mark.parametrize("vp", [1, 2])
def test_mtp_layers_keep_their_own_numbers_under_pipeline_parallelism(tmp_path, vp):
    ref = _dump(tmp_path / "save", pp=2, vp=vp, layers=4, mtp=1)
    kw = {"layout": f"pp=2,vp={vp}"} if vp > 1 else {}
    store = gf.import_run(tmp_path / "save", tmp_path / "a.zarr", heads=None, **kw)
    assert "mtp.layers.0.eh_proj.weight" in store.grads
    assert "decoder.layers.3.self_attention.linear_proj.weight" in store.grads
    _equal(store, ref)
