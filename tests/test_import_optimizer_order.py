"""Adam state of a safetensors checkpoint series is named right or not at all (never by the sorted key order).

A torch optimizer numbers its parameters in the order the model registered them;
``model.safetensors`` stores the names sorted (``layers.10`` before ``layers.2``).  Without
a ``config.json`` to rebuild the model's order, that sorted order fits every moment's shape
when layers share shapes and used to name layer 10's state as layer 2's.  The truth here
is the optimizer's own ``state_dict()`` against ``named_parameters()``.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

import gradforensics as gf  # noqa: E402


def _series(root, *, safetensors: bool) -> dict[int, dict[str, float]]:
    """Three checkpoints of a 12-layer stack trained with Adam; {step: {name: ||exp_avg||}} as the truth."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4, bias=False) for _ in range(12)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    names = [n for n, _ in model.named_parameters()]
    truth = {}
    for step in (1, 2, 3):
        loss = model(torch.randn(8, 4)).pow(2).mean() * (step + 1)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sd = opt.state_dict()
        truth[step] = {names[i]: float(st["exp_avg"].double().norm()) for i, st in sd["state"].items()}
        if safetensors:
            d = root / f"checkpoint-{step}"
            d.mkdir(parents=True)
            save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(d / "model.safetensors"))
            torch.save(sd, d / "optimizer.pt")
        else:
            root.mkdir(exist_ok=True)
            torch.save({"model": model.state_dict(), "optimizer": sd}, root / f"step_{step}.pt")
    return truth


def test_sorted_safetensors_names_do_not_name_the_optimizer_state(tmp_path):
    _series(tmp_path / "run", safetensors=True)
    store = gf.import_run(tmp_path / "run", tmp_path / "imp.zarr", tensors=["*"])
    imported = store.meta.extra["import"]
    assert imported["optimizer"] == {}, "the sorted key order must not name the state (layer 10 as layer 2)"
    assert "config.json" in imported["optimizer_note"]


def test_torch_files_keep_the_registration_order_and_name_every_layer_right(tmp_path):
    truth = _series(tmp_path / "run", safetensors=False)
    store = gf.import_run(tmp_path / "run", tmp_path / "imp.zarr", tensors=["*"])
    table = store.meta.extra["import"]["optimizer"]
    for name in ("2.weight", "10.weight"):
        for j, step in enumerate((1, 2, 3)):
            assert table[name]["exp_avg_norm"][j] == pytest.approx(truth[step][name], rel=1e-9), (name, step)


def test_state_keyed_by_parameter_name_is_named_as_it_is(tmp_path):
    """``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` keys the state by name."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    torch.manual_seed(1)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4, bias=False) for _ in range(12)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    run = tmp_path / "run"
    run.mkdir()
    truth = {}
    for step in (1, 2):
        loss = model(torch.randn(8, 4)).pow(2).mean() * (step + 1)
        opt.zero_grad()
        loss.backward()
        opt.step()
        named = get_optimizer_state_dict(model, opt)
        assert all(isinstance(k, str) for k in named["state"])
        truth[step] = {k: float(v["exp_avg"].double().norm()) for k, v in named["state"].items()}
        torch.save({"model": model.state_dict(), "optimizer": named}, run / f"step_{step}.pt")
    table = gf.import_run(run, tmp_path / "imp.zarr", tensors=["*"]).meta.extra["import"]["optimizer"]
    for name in ("2.weight", "10.weight"):
        assert table[name]["exp_avg_norm"] == pytest.approx([truth[1][name], truth[2][name]], rel=1e-9)
