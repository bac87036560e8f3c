"""Megatron-LM joins are verified against the ranks' values, never assumed from a name list.

Rank files are written in ``save_grads``' layout (``<save>/wgrads/iter_<7 digits>/mp_rank_<tp:02d>[_<pp:03d>].pth``,
``torch.save({"model_chunk0": {name: tensor}})``; ``megatron/training/checkpointing.py``, as read for
``tests/test_import_megatron.py``).  Cases the name rules cannot know: an MLA ``linear_q_proj`` split along
axis 0 (Megatron-LM's ``MLASelfAttention`` builds it as a column-parallel linear), a layer norm the ranks did
not synchronise, expert weights replicated across tensor-parallel ranks (expert TP size 1 under TP 2), and one
name on two pipeline stages.  Dumps with experts are imported with ``--layout`` (without a layout they are refused:
tests/test_import_megatron_args.py).  The truth is the unsharded tensor built here.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import gradforensics as gf  # noqa: E402
from gradforensics.commands.import_ import parse_tp_splits  # noqa: E402
from gradforensics.errors import ShardMismatchError, SpecError  # noqa: E402

QPROJ = "decoder.layers.0.self_attention.linear_q_proj.weight"
NORM = "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"
EXPERT = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"
PROJ = "decoder.layers.0.self_attention.linear_proj.weight"


def _truth(it: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(it)
    return {QPROJ: torch.randn(8, 6, generator=g), NORM: torch.randn(6, generator=g),
            EXPERT: torch.randn(4, 6, generator=g), PROJ: torch.randn(6, 8, generator=g)}


def _write(save, it: int, per_rank: list[dict[str, torch.Tensor]], pp: int | None = None) -> None:
    d = save / "wgrads" / f"iter_{it:07d}"
    d.mkdir(parents=True, exist_ok=True)
    for t, sd in enumerate(per_rank):
        name = f"mp_rank_{t:02d}" + (f"_{pp:03d}" if pp is not None else "")
        torch.save({"model_chunk0": sd}, d / f"{name}.pth")


def _tp2(save, *, qproj_split=True, norm_synced=True, expert_replicated=False) -> dict[int, dict]:
    truths = {}
    for it in (1, 2):
        ref = _truth(it)
        truths[it] = ref
        ranks = []
        for t in range(2):
            norm = ref[NORM] if norm_synced or t == 0 else ref[NORM] + 1e-3
            ranks.append({QPROJ: ref[QPROJ].chunk(2, 0)[t].clone() if qproj_split else ref[QPROJ].clone(),
                          NORM: norm.clone(),
                          EXPERT: ref[EXPERT].clone() if expert_replicated else ref[EXPERT].chunk(2, 0)[t].clone(),
                          PROJ: ref[PROJ].chunk(2, 1)[t].clone()})
        _write(save, it, ranks)
    return truths


def test_a_tensor_split_under_an_unknown_name_is_refused_then_joined_with_its_layout(tmp_path):
    truths = _tp2(tmp_path / "save")
    with pytest.raises(ShardMismatchError) as e:
        gf.import_run(tmp_path / "save", tmp_path / "a.zarr", heads=None, layout="tp=2")
    msg = str(e.value)
    assert QPROJ in msg and "ranks 0 and 1" in msg and "--tp-split 'decoder.layers.*.self_attention" in msg
    assert "\n" not in msg
    store = gf.import_run(tmp_path / "save", tmp_path / "b.zarr", heads=None, layout="tp=2",
                          tp_splits={"*.linear_q_proj.weight": 0})
    got = store.read(f"grads/{QPROJ}")
    for i, it in enumerate((1, 2)):
        assert torch.equal(torch.from_numpy(got[i]), truths[it][QPROJ])
        assert torch.equal(torch.from_numpy(store.read(f"grads/{PROJ}")[i]), truths[it][PROJ])


def test_replicated_tensors_must_be_the_same_bits_on_every_rank(tmp_path):
    _tp2(tmp_path / "save", norm_synced=False)
    with pytest.raises(ShardMismatchError, match="layer_norm_weight differs between tensor-parallel ranks 0 and 1"):
        gf.import_run(tmp_path / "save", tmp_path / "a.zarr", heads=None, tensors=["*"], layout="tp=2",
                      tp_splits={"*.linear_q_proj.weight": 0})


def test_experts_replicated_across_tp_ranks_are_refused_not_doubled(tmp_path):
    """Expert TP 1 under TP 2: each rank holds the whole expert; joining by name would double its rows."""
    truths = _tp2(tmp_path / "save", expert_replicated=True)
    with pytest.raises(ShardMismatchError, match="same values on all 2 tensor-parallel ranks"):
        gf.import_run(tmp_path / "save", tmp_path / "a.zarr", heads=None, layout="tp=2",
                      tp_splits={"*.linear_q_proj.weight": 0})
    store = gf.import_run(tmp_path / "save", tmp_path / "b.zarr", heads=None, layout="tp=2",
                          tp_splits={"*.linear_q_proj.weight": 0, "*.experts.*": None})
    got = store.read(f"grads/{EXPERT.replace('local_experts.0.', '')}")      # the experts unit (N, E, ...)
    assert got.shape == (2, 1, 4, 6)
    assert torch.equal(torch.from_numpy(got[1, 0]), truths[2][EXPERT])


@pytest.mark.parametrize("same", [True, False])
def test_one_name_on_two_pipeline_stages_is_kept_once_only_when_identical(tmp_path, same):
    save = tmp_path / "save"
    shared = "decoder.shared_norm.weight"
    for it in (1, 2):
        ref = _truth(it)
        other = ref[NORM] if same else ref[NORM] * 2
        _write(save, it, [{"decoder.layers.0.self_attention.linear_proj.weight": ref[PROJ], shared: ref[NORM]}], pp=0)
        _write(save, it, [{"decoder.layers.0.mlp.linear_fc2.weight": ref[QPROJ], shared: other}], pp=1)
    if same:
        store = gf.import_run(save, tmp_path / "a.zarr", heads=None, tensors=["*"])
        assert torch.equal(torch.from_numpy(store.read(f"grads/{shared}")[0]), _truth(1)[NORM])
        assert "decoder.layers.1.mlp.linear_fc2.weight" in store.grads       # the second stage's layer renumbered
    else:
        with pytest.raises(ShardMismatchError, match="two stages hold one name"):
            gf.import_run(save, tmp_path / "a.zarr", heads=None, tensors=["*"])


def test_tp_split_entries_parse_or_fail_in_one_line():
    assert parse_tp_splits(["*.q_proj.weight=0", "*.experts.*=none", "a=b=1"]) == {
        "*.q_proj.weight": 0, "*.experts.*": None, "a=b": 1}
    for bad in ("nosign", "=1", "x=abc"):
        with pytest.raises(SpecError):
            parse_tp_splits([bad])
