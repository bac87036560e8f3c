"""``experts=`` under FSDP2 (``fully_shard``) on 2 real gloo ranks on CPU.

Oracle: a plain (unsharded) copy of the model, same initialisation, run on the union of the two ranks'
batches (FSDP's reduced gradient is the mean of the ranks' gradients: equal batches, the union's mean
loss).  Each per-expert unit equals the plain model's expert gradients (fused: the (E, ...) weight's
``.grad``; listed: the members' stacked), each expert's sketch the sketch of that expert's own gradient,
the router loads the union's top-2 token counts, ``router/aux_loss`` the mean of the ranks' reported
auxiliary losses.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from _multirank_workers import MOE_E, K, MoeNet, moe_batch, moe_loss, moe_worker  # noqa: E402
from test_multirank import run_ranks  # noqa: E402

import gradforensics as gf  # noqa: E402
from gradforensics.recording.sketch import Sketcher  # noqa: E402

pytestmark = pytest.mark.slow
WORLD = 2


def test_fsdp_records_per_expert_units_sketches_and_router_loads(tmp_path: Path) -> None:
    assert run_ranks(moe_worker, WORLD, str(tmp_path)) == [0, 0]
    store = gf.open_store(tmp_path / "moe.zarr")
    assert store.n_records == 3
    assert store.experts_of("a.experts.weight") == MOE_E and store.experts_of("b.experts.weight") == MOE_E
    assert store.router_modules == ["a.gate", "b.gate"]
    torch.set_num_threads(1)
    plain, sk = MoeNet(), Sketcher(k=K)
    counts: dict[str, list] = {"a.gate": [], "b.gate": []}
    mods = dict(plain.named_modules())
    for name in counts:
        mods[name].register_forward_hook(
            lambda m, i, o, name=name: counts[name].append(torch.topk(o, 2, dim=-1).indices.reshape(-1)))
    for step in range(3):
        xs, ys = zip(*(moe_batch(r, step) for r in range(WORLD)), strict=True)
        for name in counts:
            counts[name].clear()
        plain.zero_grad()
        loss, _ = moe_loss(plain, (torch.cat(xs), torch.cat(ys)))
        loss.backward()
        grads = {n: p.grad.numpy() for n, p in plain.named_parameters()}
        units = {"a.experts.weight": grads["a.experts.weight"],
                 "b.experts.weight": np.stack([grads[f"b.experts.{e}.weight"] for e in range(MOE_E)])}
        for unit, want in units.items():
            np.testing.assert_allclose(store.read(f"grads/{unit}")[step], want, rtol=1e-5, atol=1e-7)
            np.testing.assert_allclose(store.read(f"sketch/{unit}")[step], np.stack([sk.project(w) for w in want]),
                                       rtol=1e-4, atol=1e-6)
        for name, idx in counts.items():
            c = torch.bincount(torch.cat(idx), minlength=MOE_E).double()
            np.testing.assert_array_equal(store.router(name, "load")[step], (c / c.sum()).numpy().astype(np.float32))
        with torch.no_grad():
            aux = [float(moe_loss(plain, moe_batch(r, step))[1]) for r in range(WORLD)]
        assert store.model_aux_loss()[step] == pytest.approx(np.mean(aux), rel=1e-5)
        assert store.batches()["loss"][step] == pytest.approx(float(loss.detach()), rel=1e-5)


def test_fsdp_on_a_transformers_mixtral_equals_an_unsharded_run(tmp_path: Path) -> None:
    """A real ``MixtralForCausalLM`` (fused experts ``gate_up_proj`` / ``down_proj``), each decoder layer and the
    root ``fully_shard``-ed over 2 gloo ranks: each per-expert unit equals the unsharded model's ``.grad`` on the
    union of the ranks' batches (float32 sums in another order: 1e-5), each router's load its top-2 counts there."""
    from _multirank_workers import HF_MOE_E, HF_MOE_K, HF_MOE_STEPS, hf_mixtral, hf_moe_ids, hf_moe_worker

    assert run_ranks(hf_moe_worker, WORLD, str(tmp_path)) == [0, 0]
    store = gf.open_store(tmp_path / "hf.zarr")
    assert store.n_records == HF_MOE_STEPS
    routers = [f"model.layers.{i}.mlp.gate" for i in range(2)]
    units = [f"model.layers.{i}.mlp.experts.{w}" for i in range(2) for w in ("gate_up_proj", "down_proj")]
    assert store.router_modules == routers and all(store.experts_of(u) == HF_MOE_E for u in units)
    torch.set_num_threads(1)
    plain = hf_mixtral()
    mods = dict(plain.named_modules())
    seen: dict[str, list] = {r: [] for r in routers}
    for r in routers:
        mods[r].register_forward_hook(lambda m, a, o, r=r: seen[r].append(a[0].detach().reshape(-1, 16)))
    for step in range(HF_MOE_STEPS):
        for r in routers:
            seen[r].clear()
        plain.zero_grad()
        ids = torch.cat([hf_moe_ids(rank, step) for rank in range(WORLD)])
        loss = plain(input_ids=ids, labels=ids).loss
        loss.backward()
        for u in units:
            want = dict(plain.named_parameters())[u].grad.numpy()
            np.testing.assert_allclose(store.read(f"grads/{u}")[step], want, rtol=1e-5, atol=1e-7)
        for r in routers:
            z = torch.cat(seen[r]) @ mods[r].weight.detach().T
            c = torch.bincount(torch.topk(z, HF_MOE_K, dim=-1).indices.reshape(-1), minlength=HF_MOE_E).double()
            np.testing.assert_array_equal(store.router(r, "load")[step], (c / c.sum()).numpy().astype(np.float32))
        assert store.batches()["loss"][step] == pytest.approx(float(loss.detach()), rel=1e-5)
