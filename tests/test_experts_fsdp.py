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
