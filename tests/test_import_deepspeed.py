"""DeepSpeed universal checkpoints (``ds_to_universal``'s output), one per step, imported as a checkpoint series.

DeepSpeed's converter needs a checkpoint from DeepSpeed's own engine, which does not train on
this CPU-only machine; the files are written byte for byte in the layout read from its source
(deepspeedai/DeepSpeed ``deepspeed/checkpoint/ds_to_universal.py`` at
4fd8dbdf511c49fc0bf058f4ac453d642b1cb8ac: ``merge_tp_slices`` saves
``torch.save({"cat_dim": d, "param": tensor})`` as ``zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt`` and the
step as ``zero/<name>/step.pt``; ``merge_zero3_slices`` the bare tensor; ``_save_optimizer_state``
``zero/optimizer_state.pt`` with ``param_groups``; keys ``param``, ``cat_dim`` from
``deepspeed/checkpoint/constants.py``).  The truth: the live model's weights and Adam's own state.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import gradforensics as gf  # noqa: E402

STEPS = (100, 200, 300)


def _write(root, model, opt, step, *, zero3):
    d = root / f"global_step{step}_universal" / "zero"
    names = dict(model.named_parameters())
    ids = {id(p): n for n, p in names.items()}
    for group in opt.param_groups:
        for p in group["params"]:
            name = ids[id(p)]
            st = opt.state[p]
            (d / name).mkdir(parents=True)
            for key, t in (("fp32", p.detach()), ("exp_avg", st["exp_avg"]), ("exp_avg_sq", st["exp_avg_sq"])):
                obj = t.clone() if zero3 else {"cat_dim": 0, "param": t.clone()}
                torch.save(obj, d / name / f"{key}.pt")
            torch.save(st["step"].clone(), d / name / "step.pt")
    groups = [{k: v for k, v in g.items() if k != "params"} | {"params": list(range(len(g["params"])))}
              for g in opt.param_groups]
    torch.save({"param_groups": groups, "zero_stage": 3 if zero3 else 2}, d / "optimizer_state.pt")


@pytest.mark.parametrize("zero3", [False, True])
def test_universal_checkpoints_give_weights_updates_and_adam_state_by_name(tmp_path, zero3):
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    weights, m_norms = {}, {}
    for step in range(1, STEPS[-1] + 1):
        model(torch.randn(16, 6)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if step in STEPS:
            _write(tmp_path / "run", model, opt, step, zero3=zero3)
            weights[step] = {n: p.detach().clone() for n, p in model.named_parameters()}
            m_norms[step] = {n: opt.state[p]["exp_avg"].double().norm().item() for n, p in model.named_parameters()}
    (tmp_path / "run" / "latest_universal").write_text("global_step300_universal")
    store = gf.import_run(tmp_path / "run", tmp_path / "imp.zarr", tensors=["*"])
    assert store.batches()["step"].tolist() == [200, 300]
    assert set(store.grads) == set(weights[100])
    got = store.read("grads/0.weight")
    assert torch.equal(torch.from_numpy(got[1]), weights[300]["0.weight"] - weights[200]["0.weight"])
    imported = store.meta.extra["import"]
    assert imported["kind"] == "deepspeed"
    for name in ("0.weight", "2.bias"):
        assert imported["optimizer"][name]["exp_avg_norm"] == pytest.approx([m_norms[s][name] for s in STEPS],
                                                                            rel=1e-9)
        assert imported["optimizer"][name]["step"] == list(STEPS)
