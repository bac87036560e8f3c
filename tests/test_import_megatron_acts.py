"""Megatron-LM ``activations/`` dumps (``--save-activations-interval``) as activation statistics (``acts/<module>/``).

The fixture is written byte for byte in the layout of NVIDIA/Megatron-LM at commit
``d98e8a64ddf34856e74b24714e3bedb2f5a39553``: ``megatron/training/activation_logging.py``
(``ActivationLogger._make_activation_hook``: ``<module>/input<k>``, ``<module>/output<k>`` of every
linear layer, norm and router as ``detach().cpu()`` tensors, keyword arguments as given - ``None`` - and
``TEGroupedLinear``'s ``m_splits`` list as ``input1``; ``save_activations`` -> ``save_grads(..., "activations")``),
``megatron/training/checkpointing.py`` ``save_grads`` (``<save>/activations/iter_<7 digits>/mp_rank_<tp:02d>.pth``
of ``{"model_chunk0": {...}}``) and the tensor-parallel layout of ``megatron/core/tensor_parallel/layers.py``
(a column-parallel output and a row-parallel input split along the last axis, a row-parallel output
all-reduced - or, under sequence parallelism, reduce-scattered along the sequence axis 0 - and a norm's
output replicated, or sequence-split under sequence parallelism).

The oracle is a direct torch computation of each statistic on the unsharded activations.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import gradforensics as gf  # noqa: E402
from gradforensics.errors import ShardMismatchError  # noqa: E402
from gradforensics.importing.megatron import MegatronSpec, parse_layout  # noqa: E402
from gradforensics.importing.megatron_acts import ActivationStats  # noqa: E402

S, B, H, F, E, TP = 4, 2, 8, 6, 4, 2
ITERS = (2, 4, 6)
L0 = "decoder.layers.0."
L1 = "decoder.layers.1.mlp.experts."


def truth(it: int) -> dict[str, torch.Tensor]:
    """One iteration's unsharded activations ([sequence, batch, features]; the router's [tokens, experts])."""
    g = torch.Generator().manual_seed(it)
    post = torch.relu(torch.randn(S, B, F, generator=g))
    post[..., 1] = 0.0                                                  # a dead unit
    return {L0 + "input_layernorm/output0": torch.randn(S, B, H, generator=g),
            L0 + "self_attention.linear_qkv/output0": 3 * torch.randn(S, B, 3 * H, generator=g),
            L0 + "self_attention.linear_proj/input0": torch.randn(S, B, H, generator=g),
            L0 + "self_attention.linear_proj/output0": torch.randn(S, B, H, generator=g),
            L0 + "mlp.linear_fc1/output0": torch.randn(S, B, 2 * F, generator=g),    # gated: [gate | up]
            L0 + "mlp.linear_fc2/input0": post,
            L0 + "mlp.router/output0": torch.softmax(torch.randn(S * B, E, generator=g), -1),
            **{f"{L1}local_experts.{j}.linear_fc1/output0": torch.randn(m, 2 * F, generator=g) + j     # gated
               for j, m in enumerate(routed(it))}}


def routed(it: int) -> list[int]:
    """Tokens routed to each expert of layer 1 (TEGroupedLinear's m_splits), different every iteration."""
    return [it, 1, 5 - it % 3, 2]


def shard(name: str, t: torch.Tensor, rank: int, sp: bool) -> torch.Tensor:
    if name.endswith(("linear_qkv/output0", "linear_proj/input0", "linear_fc2/input0")):
        return t.chunk(TP, -1)[rank].clone()
    if name.endswith("linear_fc1/output0"):                            # each rank: its gate rows, its up rows
        gate, up = t.chunk(2, -1)
        return torch.cat([gate.chunk(TP, -1)[rank], up.chunk(TP, -1)[rank]], -1).clone()
    return t.chunk(TP, 0)[rank].clone() if sp else t.clone()


def write(save: Path, *, sp: bool = False, iters=ITERS, label: str = "activations") -> dict[int, dict]:
    truths = {it: truth(it) for it in iters}
    for it, acts in truths.items():
        d = save / label / f"iter_{it:07d}"
        d.mkdir(parents=True)
        for rank in range(TP):
            sd: dict[str, object] = {n: shard(n, t, rank, sp) for n, t in acts.items() if not n.startswith(L1)}
            grouped = torch.cat([acts[f"{L1}local_experts.{j}.linear_fc1/output0"] for j in range(E)])
            sd[L1 + "linear_fc1/output0"] = shard(L1 + "linear_fc1/output0", grouped, rank, sp)   # [gate | up] / TP
            sd[L1 + "linear_fc1/input1"] = routed(it)                                # m_splits: a list
            sd[L1 + "linear_fc2/output0"] = torch.randn(sum(routed(it)), H)          # no input1 saved here
            sd[L0 + "self_attention.linear_qkv/output1"] = torch.zeros(3 * H // TP)       # a bias: 1-D
            sd[L0 + "mlp.router/output1"] = torch.ones(S * B, E, dtype=torch.bool)        # routing map
            sd[L0 + "self_attention.linear_qkv/inference_context"] = None                 # a keyword argument
            torch.save({"model_chunk0": sd}, d / f"mp_rank_{rank:02d}.pth")
    return truths


def oracle(a: torch.Tensor, first: torch.Tensor) -> dict[str, np.ndarray]:
    """The statistics, computed here with torch on the unsharded activation (units on the last axis)."""
    x = a.reshape(-1, a.shape[-1]).double()
    scale = float(torch.quantile(first.reshape(-1).abs().double(), 0.99))
    mean = x.mean(0)
    c = x - x.reshape(-1).mean()
    m2, m4 = (c ** 2).mean(), (c ** 4).mean()
    low = (x.abs() <= 0.05 * scale).double()
    return {"scale": np.array(scale), "mean": mean.numpy(), "std": x.std(0, unbiased=False).numpy(),
            "frac_low": low.mean(0).numpy(), "frac_high": (x.abs() >= 0.9 * scale).double().mean(0).numpy(),
            "dead": (low.min(0).values == 1).numpy().astype(np.uint8), "kurtosis": np.array([m4 / m2 ** 2 - 3])}


def _module(name: str) -> str:
    return name.removesuffix("/output0").replace("/", ".")


def check(get, truths: dict[int, dict[str, torch.Tensor]]) -> None:
    first = truths[ITERS[0]]
    for name in first:
        for i, it in enumerate(ITERS):
            want = oracle(truths[it][name], first[name])
            got = get(_module(name), i)
            assert got["scale"] == pytest.approx(float(want["scale"]), rel=1e-6), name
            for k in ("mean", "std", "frac_low", "frac_high", "kurtosis"):
                np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=f"{name} {k} {it}")
            assert np.array_equal(got["dead"], want["dead"]), name
            assert int(got["hist"].sum()) == truths[it][name].numel()


def test_activations_import_equals_torch_statistics_of_the_unsharded_activations(tmp_path):
    truths = write(tmp_path / "save")
    store = gf.import_run(tmp_path / "save", tmp_path / "a.zarr", kind="activations", gated_mlp=True,
                          layout="tp=2")
    assert store.n_records == 3 and store.batches()["step"].tolist() == list(ITERS) and not store.grads

    def get(module: str, i: int) -> dict:
        out = {k: store.act(module, k)[i] for k in ("mean", "std", "frac_low", "frac_high", "kurtosis", "dead",
                                                    "hist")}
        return {**out, "scale": store.act_attrs(module)["scale"]}

    check(get, truths)
    assert set(store.act_modules) == {_module(n) for n in truths[2]}
    attrs = store.act_attrs(L0 + "mlp.linear_fc2.input0")
    assert attrs["units"] == F and attrs["unit_axis"] == 2 and "Megatron" in attrs["unit_axis_from"]
    left = store.meta.extra["import"]["not_imported"]           # the grouped module's tensor without m_splits
    assert list(left) == [L1 + "linear_fc2/output0"] and "without its tokens per expert" in left[L1 + "linear_fc2/output0"]
    assert store.act(L1 + "local_experts.1.linear_fc1", "hist").sum(axis=1).tolist() == [2 * F] * 3   # 1 token
    assert store.act(L0 + "mlp.linear_fc2.input0", "dead")[:, 1].tolist() == [1, 1, 1]


def test_sequence_parallel_activations_are_joined_along_the_sequence(tmp_path):
    truths = write(tmp_path / "save", sp=True)
    spec = MegatronSpec(kind="activations", gated_mlp=True, layout=parse_layout("tp=2"))
    with pytest.raises(ShardMismatchError, match="differs between tensor-parallel ranks 0 and 1") as e:
        ActivationStats(spec).rows(tmp_path / "save" / "activations" / "iter_0000002")   # without sp: refused
    assert "\n" not in str(e.value)
    stats = ActivationStats(spec, sequence_parallel=True)
    rows = {it: stats.rows(tmp_path / "save" / "activations" / f"iter_{it:07d}") for it in ITERS}

    def get(module: str, i: int) -> dict:
        r = rows[ITERS[i]]
        return {**{k: r[f"acts/{module}/{k}"].data for k in ("mean", "std", "frac_low", "frac_high", "kurtosis",
                                                            "dead", "hist")},
                "scale": r[f"acts/{module}/hist"].attrs["scale"]}

    check(get, truths)


def test_activations_join_the_gradient_records_at_the_same_iterations(tmp_path):
    write(tmp_path / "save")
    for it in ITERS:
        d = tmp_path / "save" / "wgrads" / f"iter_{it:07d}"
        d.mkdir(parents=True)
        for rank in range(TP):
            torch.save({"model_chunk0": {L0 + "mlp.linear_fc2.weight": torch.randn(H, F // TP)}},
                       d / f"mp_rank_{rank:02d}.pth")
    store = gf.import_run(tmp_path / "save", tmp_path / "w.zarr", gated_mlp=True, layout="tp=2")
    assert list(store.grads) == [L0 + "mlp.linear_fc2.weight"]
    assert store.act(L0 + "mlp.linear_fc2.input0", "dead").shape == (3, F)
    assert store.meta.extra["import"]["activations"].startswith("statistics of the last micro-batch")
    found = gf.analyze(store, only=["saturation"], progress=False)
    assert found.table("saturation") is not None


def test_activations_at_other_iterations_are_not_joined_and_say_so(tmp_path):
    write(tmp_path / "save", iters=(2, 4))
    for it in (2, 3):
        d = tmp_path / "save" / "wgrads" / f"iter_{it:07d}"
        d.mkdir(parents=True)
        torch.save({"model_chunk0": {"w.weight": torch.randn(3, 3)}}, d / "mp_rank_00.pth")
    store = gf.import_run(tmp_path / "save", tmp_path / "w.zarr")
    assert not store.act_modules
    assert store.meta.extra["import"]["activations"].startswith("not joined: activations/ has no iter_0000003")


def test_a_pickle_payload_among_the_call_arguments_runs_nothing(tmp_path, capsys):
    """The hook saves keyword arguments as given: a hostile one is refused with the file, nothing executed."""
    from test_import_hostile import Payload, _refused

    write(tmp_path / "save", iters=(2,))
    marker = tmp_path / "PWNED"
    target = tmp_path / "save" / "activations" / "iter_0000002" / "mp_rank_01.pth"
    torch.save({"model_chunk0": {L0 + "mlp.linear_fc2/input0": torch.zeros(S, B, F // TP),
                                 L0 + "mlp.linear_fc2/packed_seq_params": Payload(marker)}}, target)
    _refused(tmp_path, capsys, [str(tmp_path / "save"), "--format", "megatron", "--kind", "activations"],
             "mp_rank_01.pth", "refused to unpickle", "nothing in the file")
    assert not marker.exists()


def test_a_tokens_per_expert_line_that_is_not_json_is_one_line(tmp_path, capsys):
    from test_import_hostile import _refused

    (tmp_path / "save" / "wgrads" / "iter_0000002").mkdir(parents=True)
    torch.save({"model_chunk0": {"w.weight": torch.ones(2, 2)}},
               tmp_path / "save" / "wgrads" / "iter_0000002" / "mp_rank_00.pth")
    (tmp_path / "save" / "tokens_per_expert").mkdir()
    (tmp_path / "save" / "tokens_per_expert" / "rank0.jsonl").write_bytes(b"\x80\x04not json\n")
    _refused(tmp_path, capsys, [str(tmp_path / "save"), "--format", "megatron", "--moe-topk", "2"],
             "rank0.jsonl:1: not a JSON object")


def test_an_activations_import_also_reads_the_router_loads(tmp_path):
    write(tmp_path / "save")
    (tmp_path / "save" / "tokens_per_expert").mkdir()
    counts = {it: [[it, 2, 3, 1], [1, 1, 2, 2]] for it in ITERS}
    (tmp_path / "save" / "tokens_per_expert" / "rank0.jsonl").write_text("".join(
        json.dumps({"iter": it, "block": "decoder", "layer": 1, "tpe": c}) + "\n" for it, c in counts.items()))
    store = gf.import_run(tmp_path / "save", tmp_path / "a.zarr", kind="activations", gated_mlp=True, moe_topk=2,
                          layout="tp=2")
    load = store.router("decoder.layers.1.mlp.router", "load")
    want = np.array([np.sum(counts[it], axis=0) / np.sum(counts[it]) for it in ITERS])
    np.testing.assert_allclose(load, want, rtol=1e-6)
    assert store.meta.extra["import"]["router"].startswith("load and max_share from tokens_per_expert/")
