"""One rule names an optimizer state dict's numbered parameters, for replay and for import alike."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from gradforensics.importing.optimizer import name_states  # noqa: E402
from gradforensics.replay.optimstate import fit_order, map_state  # noqa: E402


class Pair(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(3, 3))
        self.bias = torch.nn.Parameter(torch.zeros(3, 3))     # a bias of the weights' shape


class Net(torch.nn.Module):
    """Weights and biases of one shape, so only the param groups can tell the orders apart."""

    def __init__(self) -> None:
        super().__init__()
        self.a = Pair()
        self.b = Pair()


def _trained(groups: str) -> tuple[Net, dict]:
    torch.manual_seed(0)
    net = Net()
    named = dict(net.named_parameters())
    if groups == "trainer":          # the Hugging Face Trainer's two groups: decayed weights, then biases
        params = [{"params": [named["a.weight"], named["b.weight"]], "weight_decay": 0.1},
                  {"params": [named["a.bias"], named["b.bias"]], "weight_decay": 0.0}]
    else:
        params = [{"params": list(net.parameters())}]
    opt = torch.optim.AdamW(params, lr=1e-2)
    for i, p in enumerate(net.parameters()):       # a distinct gradient per tensor: its moments name it
        p.grad = torch.full_like(p, float(i + 1))
    opt.step()
    return net, opt.state_dict()


@pytest.mark.parametrize("groups", ["trainer", "plain"])
def test_replay_and_import_name_the_same_tensors(groups):
    net, sd = _trained(groups)
    expected = {n: float(i + 1) for i, (n, _) in enumerate(net.named_parameters())}
    mapped = map_state(sd, net, "opt")
    imported = name_states(sd, net.state_dict(), [n for n, _ in net.named_parameters()])
    assert set(mapped.per_tensor) == set(imported) == set(expected)
    for name, g in expected.items():       # Adam's first moment after one step is (1 - β₁)·g
        assert torch.allclose(mapped.per_tensor[name]["exp_avg"], torch.full((3, 3), 0.1 * g))
        assert torch.equal(imported[name][0]["exp_avg"], mapped.per_tensor[name]["exp_avg"])
    want = "hf-trainer" if groups == "trainer" else "parameters"
    assert mapped.mapping.startswith(f"{want} (")          # both orders fit by shape: the groups chose


def test_no_order_fits_says_why_and_import_keeps_nothing():
    net, sd = _trained("plain")
    shapes = {n: (4, 4) for n, _ in net.named_parameters()}
    label, order, why = fit_order(sd, {"parameters": list(shapes)}, shapes)
    assert (label, order) == ("", [])
    assert "has shape (3, 3) but parameter a.weight has (4, 4)" in why[0]
    other = {n: torch.zeros(4, 4) for n in shapes}
    assert name_states(sd, other) == {}
    assert name_states({"state": {}, "param_groups": [{"params": ["x"]}]}, other) == {}


@pytest.mark.parametrize("group", [{"lr": "x"}, {"lr": 1e-3, "betas": "ab"}, {"lr": 1e-3, "betas": (0.9,)},
                                   {"lr": float("nan")}, {"lr": 1e-3, "eps": [1]}])
def test_malformed_hyper_parameters_are_one_line_and_import_keeps_no_summary(group):
    from gradforensics.errors import SpecError
    from gradforensics.importing.optimizer import optim_group
    from gradforensics.replay.optimstate import hyper_of

    state = {0: {"exp_avg": torch.zeros(3, 3), "exp_avg_sq": torch.ones(3, 3), "step": torch.tensor(3.0)}}
    opt = {"state": state, "param_groups": [{"params": [0], **group}]}
    with pytest.raises(SpecError) as err:
        hyper_of(opt)
    assert "\n" not in str(err.value)
    assert optim_group(opt, {"w": torch.zeros(3, 3)}, ["w"], "x") is None
