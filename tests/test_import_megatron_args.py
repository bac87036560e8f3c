"""Megatron-LM: the layout from the run's own saved arguments, no silent expert layouts, padded vocabulary, SP.

Everything is written byte for byte in Megatron-LM's layout, read from NVIDIA/Megatron-LM at commit
``d98e8a64ddf34856e74b24714e3bedb2f5a39553`` (August 2026):

* the saved arguments: ``megatron/training/checkpointing.py`` ``generate_state_dict`` puts the
  ``argparse.Namespace`` under ``state_dict['args']`` (with ``checkpoint_version`` 3.0 and
  ``iteration``); the legacy ``torch`` format writes it with ``torch.save`` to
  ``<save>/iter_<N:07d>/mp_rank_<tp:02d>[_<pp:03d>][_<ep:03d>]/model_optim_rng.pt`` (``get_checkpoint_name``)
  and the tracker ``<save>/latest_checkpointed_iteration.txt``; a ``torch_dist`` checkpoint of the older form
  keeps the common dict in ``<save>/iter_<N:07d>/common.pt``
  (``megatron/core/dist_checkpointing/strategies/common.py`` ``save_common``), the current form as the
  ``ShardedObject("common_state", data, global_shape=(1,), global_offset=(0,))`` inside the distributed
  checkpoint (``serialization.py`` ``save``), stored by ``torch.distributed.checkpoint`` under
  ``common_state/shard_0_1`` as the bytes of ``torch.save([common dict])`` (``strategies/torch.py``
  ``_mcore_to_torch_sharded_object``), beside ``metadata.json`` (``save_config``).  The Namespace holds enums
  (``attention_backend``: ``megatron/core/transformer/enums.py`` ``AttnBackend``) and torch dtypes
  (``params_dtype``), stood in for here by an enum of this module and ``torch.bfloat16``;
* the dumps: ``save_grads`` (see tests/test_import_megatron_layout.py, whose writer is reused);
* the padded vocabulary: ``vocab_size_with_padding`` (``megatron/core/tokenizers/utils/build_tokenizer.py``)
  pads to a multiple of ``make_vocab_size_divisible_by * tensor_model_parallel_size``; ``word_embeddings``
  and ``output_layer`` (vocab-parallel) hold the padded rows, split over the TP ranks;
* sequence parallelism: ``megatron/core/distributed/finalize_model_grads.py``
  ``_allreduce_non_tensor_model_parallel_grads`` all-reduces the grads of ``sequence_parallel`` parameters
  (the layer norms) over the TP group inside ``forward_backward_func`` (``finalize_model_grads_func``),
  before ``training.py`` calls ``save_grads`` for ``wgrads``: every rank holds the same sum.  ``dgrads``
  (``megatron/training/dgrad_logging.py``) are backward hooks on the linear layers only: under SP a
  column-parallel layer's input and a row-parallel layer's output are ``[s/tp, b, h]``, the sequence
  split over the TP ranks (``megatron/core/tensor_parallel/layers.py``), the other sides as without SP.
"""

from __future__ import annotations

import argparse
import enum
import io
import os
import pickle
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

import gradforensics as gf  # noqa: E402
from gradforensics.cli import main  # noqa: E402
from gradforensics.commands.inspect import summarize, summary_lines  # noqa: E402
from gradforensics.errors import CheckpointError, ImportSourceError, ShardMismatchError, SpecError  # noqa: E402
from gradforensics.importing.megatron_args import Opaque, read_args, read_pickle  # noqa: E402
from tests.test_import_megatron_layout import _dump, _equal  # noqa: E402


class AttnBackend(enum.Enum):
    """Stands in for Megatron-LM's ``AttnBackend`` enum: pickled by its qualified name."""

    auto = 5


class Hostile:
    """What a poisoned checkpoint could hold: unpickling it would run a shell command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def megatron_args(**over) -> argparse.Namespace:
    args = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, expert_model_parallel_size=1,
                expert_tensor_parallel_size=None, virtual_pipeline_model_parallel_size=None,
                context_parallel_size=1, sequence_parallel=False, num_attention_heads=2, group_query_attention=False,
                num_query_groups=1, swiglu=False, padded_vocab_size=16, vocab_size=None,
                make_vocab_size_divisible_by=128, params_dtype=torch.bfloat16, attention_backend=AttnBackend.auto,
                save="/lustre/run/save", seq_length=8)
    args.update(over)
    return argparse.Namespace(**args)


def save_checkpoint(save: Path, it: int, args: argparse.Namespace, fmt: str = "torch") -> Path:
    """``save_checkpoint``'s files that hold the arguments, and the tracker."""
    sd = {"args": args, "checkpoint_version": 3.0, "iteration": it}
    d = save / f"iter_{it:07d}"
    if fmt == "torch":
        tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
        ep = args.expert_model_parallel_size
        for t in range(tp):
            name = f"mp_rank_{t:02d}" + (f"_{0:03d}" if pp > 1 else "") + (f"_{0:03d}" if ep > 1 else "")
            (d / name).mkdir(parents=True)
            torch.save({**sd, "model": {"decoder.final_layernorm.weight": torch.ones(4)}},
                       d / name / "model_optim_rng.pt")
    elif fmt == "torch_dist_common_pt":
        d.mkdir(parents=True)
        torch.save(sd, d / "common.pt")
    elif fmt in ("torch_dcp", "fsdp_dtensor"):      # the whole state dict through torch's DCP, args a bytes entry
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save({**sd, "model": {"decoder.final_layernorm.weight": torch.ones(4)}}, checkpoint_id=str(d),
                     no_dist=True)
    else:               # torch_dist now: the common dict as the ShardedObject "common_state" inside the DCP
        blob = io.BytesIO()
        torch.save([sd], blob)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save({"common_state/shard_0_1": blob, "decoder.final_layernorm.weight": torch.ones(4)},
                     checkpoint_id=str(d), no_dist=True)
        (d / "metadata.json").write_text('{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')
    (save / "latest_checkpointed_iteration.txt").write_text(str(it))
    return d


def _one_line(e: pytest.ExceptionInfo[BaseException]) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


MOE = dict(tensor_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=1)


# ------------------------------------------------------------------ 1. the run's saved arguments
FORMATS = {"torch": "mp_rank_00_000/model_optim_rng.pt", "torch_dist_common_pt": "common.pt", "torch_dist": ".metadata",
           "torch_dcp": ".metadata", "fsdp_dtensor": ".metadata"}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_arguments_are_read_and_nothing_in_them_is_constructed(tmp_path, fmt):
    d = save_checkpoint(tmp_path, 3, megatron_args(**MOE, sequence_parallel=True), fmt)
    f = d / FORMATS[fmt]
    a = read_args(f)
    assert (a.tp, a.pp, a.ep, a.etp, a.vp, a.sp, a.num_heads, a.padded_vocab_size) == (2, 1, 2, 1, 1, True, 2, 16)
    ns = read_pickle(f)["args"]
    enum_value, dtype = ns.attention_backend, ns.params_dtype     # a reduced instance; a global (pickled by name)
    assert isinstance(enum_value, Opaque) and enum_value.qualname == f"{__name__}.AttnBackend"
    assert enum_value.args == (5,)
    assert isinstance(dtype, type) and issubclass(dtype, Opaque) and dtype.qualname == "torch.bfloat16"


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_hostile_pickle_in_the_arguments_runs_nothing(tmp_path, fmt):
    marker = tmp_path / "pwned"
    ref = _dump(tmp_path / "save", tp=2, ep=2, etp=1, experts=4)
    d = save_checkpoint(tmp_path / "save", 2, megatron_args(**MOE, evil=Hostile(marker)), fmt)
    store = gf.import_run(tmp_path / "save", tmp_path / "a.zarr", heads=None)
    _equal(store, ref)
    assert not marker.exists()
    ev = read_pickle(d / FORMATS[fmt])["args"].evil
    assert isinstance(ev, Opaque) and ev.qualname == "posix.system" and ev.args == (f"touch {marker}",)
    (tmp_path / "dcp").mkdir()                       # the distributed checkpoint's own metadata poisoned
    (tmp_path / "dcp/.metadata").write_bytes(pickle.dumps(Hostile(marker)))
    with pytest.raises(CheckpointError) as e:
        read_args(tmp_path / "dcp/.metadata")
    assert "not a distributed checkpoint's metadata" in _one_line(e) and not marker.exists()


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_an_moe_dump_is_joined_with_the_runs_own_layout_and_inspect_says_so(tmp_path, fmt):
    ref = _dump(tmp_path / "save", tp=2, ep=2, etp=1, experts=4)
    save_checkpoint(tmp_path / "save", 2, megatron_args(**MOE), fmt)
    store = gf.import_run(tmp_path / "save", tmp_path / "a.zarr", heads=None)
    _equal(store, ref)
    imp = store.meta.extra["import"]
    assert imp["layout"] == "tp=2,pp=1,ep=2,etp=1,vp=1" and imp["layout_from"] == "the run's saved arguments"
    assert imp["run_args"]["source"].endswith(FORMATS[fmt].split("/")[-1])
    text = "\n".join(summary_lines(summarize(store)))
    assert "megatron layout: tp=2,pp=1,ep=2,etp=1,vp=1 (from the run's saved arguments" in text


def test_args_from_a_checkpoint_elsewhere(tmp_path):
    ref = _dump(tmp_path / "save", tp=2, ep=2, etp=1, experts=4)
    save_checkpoint(tmp_path / "ckpt", 7, megatron_args(**MOE), "torch_dist")
    store = gf.import_run(tmp_path / "save", tmp_path / "a.zarr", heads=None, args_from=tmp_path / "ckpt")
    _equal(store, ref)
    with pytest.raises(CheckpointError) as e:
        gf.import_run(tmp_path / "save", tmp_path / "b.zarr", heads=None, args_from=tmp_path / "nothing")
    assert "--args-from" in _one_line(e)
    save_checkpoint(tmp_path / "save", 9, megatron_args(**{**MOE, "tensor_model_parallel_size": 4}), "torch_dist")
    with pytest.raises(SpecError, match=r"--layout tp=2 disagrees .* tensor_model_parallel_size=4"):  # another run's
        gf.import_run(tmp_path / "save", tmp_path / "c.zarr", heads=None, layout="tp=2,ep=2,etp=1")
    with pytest.raises(ImportSourceError) as e:                              # not looked for: no layout
        gf.import_run(tmp_path / "save", tmp_path / "d.zarr", heads=None, args_from="none")
    assert "give --layout tp=,ep=,etp= or --args-from CHECKPOINT" in _one_line(e)
    _equal(gf.import_run(tmp_path / "save", tmp_path / "e.zarr", heads=None, args_from="none",
                         layout="tp=2,ep=2,etp=1"), ref)


@pytest.mark.parametrize(("layout", "says"), [
    ("tp=2,ep=2,etp=2", "--layout etp=2 disagrees with the run's saved arguments: expert_tensor_parallel_size=1"),
    ("tp=2,ep=2,pp=2", "--layout pp=2 disagrees with the run's saved arguments: pipeline_model_parallel_size=1"),
    ("tp=2,ep=2,sp=1", "--layout sp=1 disagrees with the run's saved arguments: sequence_parallel=False"),
])
def test_a_layout_that_disagrees_with_the_saved_arguments_is_one_line_naming_the_field(tmp_path, capsys, layout,
                                                                                        says):
    _dump(tmp_path / "save", tp=2, ep=2, etp=1, experts=4)
    save_checkpoint(tmp_path / "save", 2, megatron_args(**MOE))
    argv = ["import", str(tmp_path / "save"), "--format", "megatron", "--heads", "none", "--quiet", "--out",
            str(tmp_path / "a.zarr"), "--layout", layout]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1
    assert main([*argv[:-1], "tp=2,ep=2,etp=1"]) == 0          # the same sizes: agreed


def test_other_fields_must_agree_and_have_megatrons_types(tmp_path):
    _dump(tmp_path / "save", tp=2, ep=2, etp=1, experts=4)
    save_checkpoint(tmp_path / "save", 2, megatron_args(**MOE))
    with pytest.raises(SpecError) as e:
        gf.import_run(tmp_path / "save", tmp_path / "a.zarr", heads=None, num_heads=4)
    assert "--num-heads 4 disagrees with the run's saved arguments: num_attention_heads=2" in _one_line(e)
    save_checkpoint(tmp_path / "bad", 2, megatron_args(**{**MOE, "tensor_model_parallel_size": AttnBackend.auto}),
                    "torch_dist_common_pt")
    with pytest.raises(CheckpointError) as e:
        gf.import_run(tmp_path / "save", tmp_path / "b.zarr", heads=None, args_from=tmp_path / "bad")
    assert f"the saved argument tensor_model_parallel_size is {__name__}.AttnBackend" in _one_line(e)


# ------------------------------------------------------------------ 2. no silent expert layouts
EXPERT_CASES = {
    # TP 1, ETP 2: both expert shards go to one file name, the later one survives: half of each expert
    "etp_above_tp": (dict(tp=1, ep=2, etp=2, experts=4), "expert tensor-parallel size above the tensor-parallel"),
    # TP 4, ETP 2, EP 1: only local ranks 0 and 1 write; the files look like TP 2 with half the dense shards
    "etp_ep_below_tp": (dict(tp=4, ep=1, etp=2, experts=2), "only 2 of the 4 tensor-parallel ranks write a file"),
    # ETP = TP, Megatron-LM's default: joined right, but the files cannot tell it from the others
    "etp_is_tp": (dict(tp=2, ep=2, experts=4), None),
}


@pytest.mark.parametrize("case", sorted(EXPERT_CASES))
def test_expert_dumps_without_a_layout_are_refused_and_joined_or_refused_with_the_args(tmp_path, case):
    lay, with_args = EXPERT_CASES[case]
    ref = _dump(tmp_path / "save", **lay)
    with pytest.raises(ImportSourceError) as e:
        gf.import_run(tmp_path / "save", tmp_path / "a.zarr", heads=None)
    msg = _one_line(e)
    assert "no layout is known" in msg and "Pass --layout tp=,pp=,ep=,etp= or --args-from" in msg
    assert "looked for" in msg and "model_optim_rng.pt" in msg
    assert "the torch, torch_dist, torch_dcp and fsdp_dtensor checkpoint formats" in msg
    save_checkpoint(tmp_path / "save", 2, megatron_args(tensor_model_parallel_size=lay["tp"],
                                                        expert_model_parallel_size=lay["ep"],
                                                        expert_tensor_parallel_size=lay.get("etp")))
    if with_args is None:
        _equal(gf.import_run(tmp_path / "save", tmp_path / "b.zarr", heads=None), ref)
    else:
        with pytest.raises(SpecError) as e:
            gf.import_run(tmp_path / "save", tmp_path / "b.zarr", heads=None)
        assert with_args in _one_line(e)


# ------------------------------------------------------------------ 3. the padded vocabulary
V, VPAD, H = 13, 16, 4        # 13 tokens padded to a multiple of 4 (make_vocab_size_divisible_by) x TP 2


def _vocab_dump(save: Path) -> dict[int, dict[str, torch.Tensor]]:
    """TP 2: the vocab-parallel embedding and output layer with the padded rows, split by rows."""
    ref = {}
    for it in (1, 2):
        g = torch.Generator().manual_seed(it)
        full = {"embedding.word_embeddings.weight": torch.randn(VPAD, H, generator=g),
                "output_layer.weight": torch.randn(VPAD, H, generator=g),
                "decoder.layers.0.self_attention.linear_proj.weight": torch.randn(H, H, generator=g)}
        ref[it] = full
        d = save / "wgrads" / f"iter_{it:07d}"
        d.mkdir(parents=True)
        for t in range(2):
            sd = {n: x.chunk(2, 1 if "linear_proj" in n else 0)[t].clone() for n, x in full.items()}
            torch.save({"model_chunk0": sd}, d / f"mp_rank_{t:02d}.pth")
    return ref


def test_padded_vocabulary_rows_are_dropped_and_recorded(tmp_path):
    ref = _vocab_dump(tmp_path / "save")
    args = megatron_args(tensor_model_parallel_size=2, padded_vocab_size=VPAD, make_vocab_size_divisible_by=4)
    save_checkpoint(tmp_path / "save", 2, args, "torch_dist_common_pt")
    # the arguments alone: the padded size is checked, the true size is not known, nothing dropped
    store = gf.import_run(tmp_path / "save", tmp_path / "a.zarr", heads=None)
    assert store.read("grads/output_layer.weight").shape == (2, VPAD, H)
    assert store.meta.extra["import"]["vocab"]["padded"] == VPAD and store.meta.extra["import"]["vocab"]["size"] is None
    # with the true size: the unpadded tensor, rows past it dropped
    store = gf.import_run(tmp_path / "save", tmp_path / "b.zarr", heads=None, vocab_size=V)
    for n in ("embedding.word_embeddings.weight", "output_layer.weight"):
        got = store.read(f"grads/{n}")
        for i, it in enumerate((1, 2)):
            assert torch.equal(torch.from_numpy(got[i]), ref[it][n][:V]), n
    assert store.meta.extra["import"]["vocab"] == {"size": V, "padded": VPAD, "rows_dropped": VPAD - V,
                                                   "from": "--vocab-size"}
    text = "\n".join(summary_lines(summarize(store)))
    assert f"vocabulary: {V} tokens, {VPAD - V} padded rows dropped" in text


def test_a_vocabulary_that_does_not_fit_the_rows_is_refused(tmp_path):
    _vocab_dump(tmp_path / "save")
    with pytest.raises(ShardMismatchError) as e:                     # no arguments: only the size is checked
        gf.import_run(tmp_path / "save", tmp_path / "a.zarr", heads=None, vocab_size=VPAD + 1)
    assert f"has {VPAD} vocabulary rows, fewer than the vocabulary size {VPAD + 1}" in _one_line(e)
    store = gf.import_run(tmp_path / "save", tmp_path / "b.zarr", heads=None, vocab_size=V)   # no arguments
    assert store.read("grads/output_layer.weight").shape == (2, V, H)
    save_checkpoint(tmp_path / "save", 2, megatron_args(tensor_model_parallel_size=2, padded_vocab_size=24),
                    "torch_dist_common_pt")
    with pytest.raises(ShardMismatchError) as e:
        gf.import_run(tmp_path / "save", tmp_path / "c.zarr", heads=None, vocab_size=V)
    assert f"has {VPAD} vocabulary rows; the run's padded_vocab_size is 24" in _one_line(e)


# ------------------------------------------------------------------ 4. sequence parallelism
S, B = 8, 2
QKV, PROJ, NORM = ("decoder.layers.0.self_attention.linear_qkv", "decoder.layers.0.self_attention.linear_proj",
                   "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight")


def _sp_dump(save: Path, *, sp: bool = True, reduced: bool = True) -> dict[int, dict[str, torch.Tensor]]:
    """TP 2 with SP: wgrads (the layer norm's grad all-reduced, the same on both ranks) and dgrads.

    ``sp=False``: a run without SP (a column-parallel input and a row-parallel output whole on every rank);
    ``reduced=False``: the layer norm's per-rank partial sums, as they are before ``finalize_model_grads``.
    """
    ref = {}
    for it in (1, 2):
        g = torch.Generator().manual_seed(it)
        full = {NORM: torch.randn(H, generator=g), f"{QKV}.weight": torch.randn(3 * H, H, generator=g),
                f"{PROJ}.weight": torch.randn(H, H, generator=g),
                f"{QKV}/input0": torch.randn(S, B, H, generator=g), f"{QKV}/output0": torch.randn(S, B, 3 * H, generator=g),
                f"{PROJ}/input0": torch.randn(S, B, H, generator=g), f"{PROJ}/output0": torch.randn(S, B, H, generator=g)}
        ref[it] = full
        seq = 0 if sp else None
        axis = {NORM: None, f"{QKV}.weight": 0, f"{PROJ}.weight": 1, f"{QKV}/input0": seq, f"{QKV}/output0": -1,
                f"{PROJ}/input0": -1, f"{PROJ}/output0": seq}
        partial = [full[NORM] * 0.25, full[NORM] * 0.75]
        for kind in ("wgrads", "dgrads"):
            d = save / kind / f"iter_{it:07d}"
            d.mkdir(parents=True)
            for t in range(2):
                sd = {n: (x.clone() if axis[n] is None else x.chunk(2, axis[n])[t].clone())
                      for n, x in full.items() if ("/" in n) == (kind == "dgrads")}
                if kind == "wgrads" and not reduced:
                    sd[NORM] = partial[t].clone()
                torch.save({"model_chunk0": sd}, d / f"mp_rank_{t:02d}.pth")
    return ref


def test_sequence_parallel_wgrads_import_as_without_it(tmp_path):
    ref = _sp_dump(tmp_path / "save")
    store = gf.import_run(tmp_path / "save", tmp_path / "a.zarr", heads=None, tensors=["*"], layout="tp=2,sp=1")
    for n in (NORM, f"{QKV}.weight", f"{PROJ}.weight"):
        for i, it in enumerate((1, 2)):
            assert torch.equal(torch.from_numpy(store.read(f"grads/{n}")[i]), ref[it][n]), n
    assert store.meta.extra["import"]["layout"] == "tp=2,pp=1,ep=1,etp=2,vp=1,sp=1"


def test_sequence_parallel_layer_norm_partial_sums_are_refused_naming_the_tensor(tmp_path):
    """What a dump taken before Megatron-LM's all-reduce would hold: each rank's partial sum."""
    _sp_dump(tmp_path / "save", reduced=False)
    with pytest.raises(ShardMismatchError) as e:
        gf.import_run(tmp_path / "save", tmp_path / "a.zarr", heads=None, tensors=["*"], layout="tp=2,sp=1")
    assert f"{NORM} differs between tensor-parallel ranks 0 and 1" in _one_line(e)


def test_sp_given_for_a_run_without_it_is_refused(tmp_path):
    _sp_dump(tmp_path / "save", sp=False)
    with pytest.raises(ShardMismatchError) as e:
        gf.import_run(tmp_path / "save", tmp_path / "a.zarr", heads=None, kind="dgrads", layout="tp=2,sp=1")
    assert "sequence-parallel layout says split along axis 0" in _one_line(e)
    assert "a run without sequence parallelism?" in _one_line(e)
    gf.import_run(tmp_path / "save", tmp_path / "b.zarr", heads=None, kind="dgrads", layout="tp=2")


def test_sequence_parallel_dgrads_are_joined_along_the_sequence_or_refused_in_one_line(tmp_path):
    ref = _sp_dump(tmp_path / "save")
    with pytest.raises(ShardMismatchError) as e:                     # SP not known: refused, the fix named
        gf.import_run(tmp_path / "save", tmp_path / "a.zarr", heads=None, kind="dgrads")
    assert "a sequence-parallel run? give --layout ...,sp=1" in _one_line(e)
    save_checkpoint(tmp_path / "save", 2, megatron_args(tensor_model_parallel_size=2, sequence_parallel=True))
    for out, kw in (("b.zarr", {"layout": "tp=2,sp=1"}), ("c.zarr", {})):       # --layout, or the saved arguments
        store = gf.import_run(tmp_path / "save", tmp_path / out, heads=None, kind="dgrads", **kw)
        for n in (f"{QKV}/input0", f"{QKV}/output0", f"{PROJ}/input0", f"{PROJ}/output0"):
            got = store.read(f"grads/{n.replace('/', '.')}")
            for i, it in enumerate((1, 2)):
                assert torch.equal(torch.from_numpy(got[i]), ref[it][n]), n


def test_a_context_parallel_dgrads_dump_is_refused(tmp_path):
    _sp_dump(tmp_path / "save")
    save_checkpoint(tmp_path / "save", 2, megatron_args(tensor_model_parallel_size=2, context_parallel_size=2))
    with pytest.raises(SpecError) as e:
        gf.import_run(tmp_path / "save", tmp_path / "a.zarr", heads=None, kind="dgrads")
    assert "context_parallel_size=2" in _one_line(e)


# ------------------------------------------------------------------ the router's top-k
def test_moe_topk_defaults_to_the_saved_moe_router_topk_and_a_disagreement_is_one_line(tmp_path):
    """tokens_per_expert/ is read with the run's own k (``moe_router_topk``) when --moe-topk is not given."""
    import numpy as np

    from tests.test_import_megatron_moe import _dump_experts, _log_tokens, _tokens, _truth

    save, iters = tmp_path / "save", range(1, 5)
    for it in iters:
        _dump_experts(save, it, _truth(it, torch.float32), grouped=True)
    _log_tokens(save, iters)
    save_checkpoint(save, 4, megatron_args(tensor_model_parallel_size=2, expert_model_parallel_size=2,
                                           moe_router_topk=2))
    store = gf.import_run(save, tmp_path / "a.zarr", heads=None)
    load = store.arrays["router/decoder.layers.0.mlp.router/load"]
    assert load.attrs["top_k"] == 2 and store.meta.extra["import"]["run_args"]["moe_topk"] == 2
    want = np.array([np.sum(_tokens(it, 0), axis=0) / np.sum(_tokens(it, 0)) for it in iters])
    np.testing.assert_allclose(store.router("decoder.layers.0.mlp.router", "load"), want, rtol=1e-6)
    assert gf.import_run(save, tmp_path / "b.zarr", heads=None, moe_topk=2).arrays[
        "router/decoder.layers.0.mlp.router/load"].attrs["top_k"] == 2                  # agreed
    with pytest.raises(SpecError) as e:
        gf.import_run(save, tmp_path / "c.zarr", heads=None, moe_topk=1)
    assert "--moe-topk 1 disagrees with the run's saved arguments: moe_router_topk=2 in" in _one_line(e)
    assert not (tmp_path / "c.zarr").exists()
