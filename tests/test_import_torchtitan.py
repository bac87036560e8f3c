"""torchtitan's DCP checkpoints: model tensors flat at the top level, the optimizer flattened beside them.

Layout read from torchtitan's source (pytorch/torchtitan main, 2025-26):
``torchtitan/components/checkpoint.py`` ``CheckpointManager._flattened_model_states_sd`` saves
``{**model.state_dict(), "optimizer": ..., "lr_scheduler": ..., "dataloader": ..., "train_state": ...}``
with ``dcp.save`` into ``<folder>/step-<N>/``, and ``torchtitan/components/optimizer.py``
``OptimizersContainer.state_dict`` is ``get_optimizer_state_dict(model, opt,
options=StateDictOptions(flatten_optimizer_state_dict=True))`` (keys ``state.<fqn>.exp_avg``,
``param_groups.<fqn>.lr``).  torchtitan itself does not install beside torch 2.13 here, so the
state dict is built in that shape from torch's own ``get_model_state_dict`` /
``get_optimizer_state_dict`` and written by torch's real DCP writer.  Before: the Adam moments
(``optimizer.state.*.exp_avg``) were imported as model weights and no optimizer summary was kept.
"""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

import gradforensics as gf  # noqa: E402

STEPS = (10, 20, 30)


@pytest.fixture(scope="module")
def titan_run(tmp_path_factory):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    root = tmp_path_factory.mktemp("titan") / "checkpoint"
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    weights, moments = {}, {}
    for step in range(STEPS[-1] + 1):
        if step in STEPS:
            optim = get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
            state = {**get_model_state_dict(model), "optimizer": optim,
                     "lr_scheduler": {"last_epoch": step}, "train_state": {"step": step}}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.save(state, checkpoint_id=str(root / f"step-{step}"))
            weights[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
            moments[step] = {k[len("state."):-len(".exp_avg")]: v.double().norm().item()
                             for k, v in optim.items() if k.startswith("state.") and k.endswith(".exp_avg")}
        model(torch.randn(16, 6)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return root, weights, moments


def test_model_tensors_only_and_the_flattened_optimizer_named(titan_run, tmp_path):
    root, weights, moments = titan_run
    store = gf.import_run(root, tmp_path / "imp.zarr", tensors=["*"])
    assert set(store.grads) == set(weights[10]), sorted(store.grads)       # no optimizer.state.* among them
    got = store.read("grads/2.weight")
    assert torch.equal(torch.from_numpy(got[0]), weights[20]["2.weight"] - weights[10]["2.weight"])
    table = store.meta.extra["import"]["optimizer"]
    for name in ("0.weight", "2.weight", "2.bias"):
        assert table[name]["exp_avg_norm"] == pytest.approx([moments[s][name] for s in STEPS], rel=1e-9)
