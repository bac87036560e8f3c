"""Curvature and optimizer state at the checkpoint, on real runs made here (issue 23).

* an edge-of-stability run: full-batch GD on a tanh MLP on sklearn digits at lr 1.0 (the
  loss rises on about half the steps), saved as a raw torch checkpoint with its optimizer,
  replayed with a CheckpointProbe; lambda_max*lr against an independent power iteration,
  a curvature flag naming the blocks, and the same model at lr/4 without one;
* an Adam run whose side input is zero for a stretch (its tensor's gradients vanish) and
  returns at the replay: the optimizer flag names that tensor; a healthy Adam run does not flag.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sklearn")

import gradforensics as gf  # noqa: E402
from gradforensics.errors import CorruptStoreError, GradforensicsError  # noqa: E402
from gradforensics.replay.probe import CheckpointProbe, CurvatureSpec  # noqa: E402
from gradforensics.replay.run import replay  # noqa: E402
from gradforensics.store.probes import CurvatureData, OptimData, read_curvature, read_optim, write_probes  # noqa: E402
from gradforensics.store.reader import open_store  # noqa: E402


def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data[:512], dtype=torch.float32) / 16.0
    y = torch.nn.functional.one_hot(torch.tensor(d.target[:512]), 10).float()
    return x, y


def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 10))


def _mse(m: torch.nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.mse_loss(m(b[0]), b[1])


def _gd_checkpoint(path, lr: float, steps: int = 300) -> list[float]:
    torch.set_num_threads(1)
    x, y = _digits()
    net = _mlp()
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = _mse(net, (x, y))
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    torch.save({"model": net.state_dict(), "optimizer": opt.state_dict()}, path)
    return losses


def _replay_checkpoint(ckpt, out, spec: CurvatureSpec, batches) -> gf.Findings:
    from gradforensics.replay.untrusted import read_state_dict

    net = _mlp(1)                                     # other init: the weights come from the file
    net.load_state_dict(read_state_dict(ckpt))
    probe = CheckpointProbe.from_checkpoint(ckpt, net, spec)
    replay(net, {"digits": batches}, _mse, out, n_per_source=len(batches), progress=False, probe=probe)
    return gf.analyze(out, only=["curvature", "optimizer"])


def _power_iteration(net: torch.nn.Module, batch, iters: int = 60) -> float:
    """lambda_max of the loss Hessian by power iteration on torch.autograd.functional.hvp (independent of Lanczos)."""
    params = {n: p.detach() for n, p in net.named_parameters()}
    names = list(params)

    def f(*flat: torch.Tensor) -> torch.Tensor:
        return _mse(lambda x: torch.func.functional_call(net, dict(zip(names, flat)), (x,)), batch)

    gen = torch.Generator().manual_seed(3)
    v = tuple(torch.randn(p.shape, generator=gen) for p in params.values())
    lam = 0.0
    for _ in range(iters):
        norm = torch.sqrt(sum((t * t).sum() for t in v))
        v = tuple(t / norm for t in v)
        _, hv = torch.autograd.functional.hvp(f, tuple(params.values()), v)
        lam = float(sum((a * b).sum() for a, b in zip(v, hv)))
        v = hv
    return lam


@pytest.mark.slow
def test_edge_of_stability_is_flagged_with_the_lr_and_the_blocks(tmp_path):
    losses = _gd_checkpoint(tmp_path / "eos.pt", lr=1.0)
    rises = np.mean(np.diff(losses[-100:]) > 0)
    assert rises > 0.3                                  # the loss oscillates: edge of stability
    x, y = _digits()
    found = _replay_checkpoint(tmp_path / "eos.pt", tmp_path / "eos.zarr", CurvatureSpec(k=2, batches=1),
                               [(x, y)] * 2)
    table = found.table("curvature")
    whole = table[(table["tensor"] == "model") & (table["source"] == "")].iloc[0]
    net = _mlp(1)
    from gradforensics.replay.untrusted import read_state_dict

    net.load_state_dict(read_state_dict(tmp_path / "eos.pt"))
    ref = _power_iteration(net, (x, y)) * 1.0
    assert abs(whole["lambda_max"] * whole["lr"] - ref) <= 0.10 * ref
    assert whole["threshold"] == 2.0 and whole["ratio"] >= 1.0 and bool(whole["converged"])
    flags = [f for f in found.flags if f.kind == "curvature"]
    assert flags and flags[0].severity >= 0.5
    top_mass = table[(table["tensor"] != "model")].sort_values("mass", ascending=False)["tensor"].iloc[0]
    assert flags[0].tensor == top_mass == "0.weight"
    assert flags[0].evidence["blocks"][0] == top_mass
    r = flags[0].evidence["ratio"]
    assert f">= {r:.2f}x" in flags[0].summary and f"<= {1.0 / r:.3g}" in flags[0].summary
    assert not [f for f in found.flags if f.kind == "optimizer" and f.severity >= 0.5]
    csv = table.columns.tolist()
    assert csv[:3] == ["tensor", "head", "source"] and {"lambda_max", "lr", "threshold", "ratio"} <= set(csv)


@pytest.mark.slow
def test_four_times_smaller_lr_is_not_flagged(tmp_path):
    _gd_checkpoint(tmp_path / "calm.pt", lr=0.25)
    x, y = _digits()
    found = _replay_checkpoint(tmp_path / "calm.pt", tmp_path / "calm.zarr", CurvatureSpec(k=1, batches=1,
                               blocks="layer"), [(x, y)])
    assert not [f for f in found.flags if f.kind == "curvature"]
    table = found.table("curvature")
    assert set(table["tensor"]) == {"model", "0", "2"}
    assert float(table[table["tensor"] == "model"]["ratio"].iloc[0]) < 0.5


# ---------------------------------------------------------------- Adam
def _side_model(seed: int = 0) -> torch.nn.Module:
    class Side(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Linear(64, 32)
            self.side = torch.nn.Linear(8, 32, bias=False)
            self.head = torch.nn.Linear(32, 10)

        def forward(self, b):
            return self.head(torch.tanh(self.body(b[0]) + self.side(b[1])))

    torch.manual_seed(seed)
    return Side()


def _adam_checkpoint(path, vanish: bool) -> tuple[torch.nn.Module, list]:
    """300 Adam steps on minibatches; with *vanish*, the side input is zero for the last 250 (no side gradient)."""
    torch.set_num_threads(1)
    x, y = _digits()
    gen = torch.Generator().manual_seed(0)
    side = torch.randn(512, 8, generator=gen)
    net = _side_model()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3, betas=(0.9, 0.99))
    for step in range(300):
        idx = torch.randint(0, 512, (64,), generator=gen)
        s = side[idx] * (0.0 if vanish and step >= 50 else 1.0)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(net((x[idx], s)), y[idx])
        loss.backward()
        opt.step()
    torch.save({"model": net.state_dict(), "optimizer": opt.state_dict()}, path)
    batches = [((x[i:i + 64], side[i:i + 64]), y[i:i + 64]) for i in range(0, 256, 64)]
    return net, batches


def _adam_findings(tmp_path, vanish: bool) -> gf.Findings:
    net, batches = _adam_checkpoint(tmp_path / "adam.pt", vanish)
    probe = CheckpointProbe.from_checkpoint(tmp_path / "adam.pt", net, CurvatureSpec(k=1, batches=1, max_iter=20))
    assert probe.hyper.optimizer == "adam" and probe.hyper.beta2 == 0.99 and probe.state.mapping == "parameters"
    replay(net, {"digits": batches}, lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]), tmp_path / "a.zarr",
           n_per_source=len(batches), progress=False, probe=probe)
    return gf.analyze(tmp_path / "a.zarr", only=["curvature", "optimizer"])


@pytest.mark.slow
def test_stale_preconditioner_names_the_tensor_whose_gradients_returned(tmp_path):
    found = _adam_findings(tmp_path, vanish=True)
    top = [f for f in found.flags if f.kind == "optimizer" and f.severity >= 0.5]
    assert top and {f.tensor for f in top} == {"side.weight"}
    assert top[0].evidence["problem"] == "stale preconditioner" and top[0].evidence["ratio_q50"] > 10
    t = found.table("optimizer").set_index("tensor")
    assert t.loc["body.weight", "ratio_q50"] < 10
    assert not [f for f in found.flags if f.kind == "curvature"]       # preconditioned sharpness below 38/lr


@pytest.mark.slow
def test_healthy_adam_raises_no_optimizer_flag(tmp_path):
    found = _adam_findings(tmp_path, vanish=False)
    assert not [f for f in found.flags if f.severity >= 0.5]
    t = found.table("optimizer")
    assert (t["ratio_q50"] < 10).all()
    c = found.table("curvature")
    pre = c[(c["tensor"] == "model") & (c["operator"] == "preconditioned")].iloc[0]
    assert pre["threshold"] == pytest.approx(38.0) and pre["ratio"] < 1


def test_nan_weights_are_named_before_any_batch_not_a_preconditioner_failure(tmp_path):
    """Issue 42: NaN weights with an Adam state failed after every batch with "preconditioner: P = ... must be
    finite"; the tensor is named at once and nothing is written."""
    from gradforensics.errors import CheckpointError

    torch.set_num_threads(1)
    x, y = _digits()
    net = _side_model()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    for i in range(0, 256, 64):                     # a few real Adam steps: exp_avg_sq exists for every tensor
        opt.zero_grad()
        torch.nn.functional.mse_loss(net((x[i:i + 64], torch.ones(64, 8))), y[i:i + 64]).backward()
        opt.step()
    with torch.no_grad():
        net.body.weight[3, :5] = float("nan")
        net.head.weight[0, 0] = float("inf")
    torch.save({"model": net.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "nan.pt")
    with pytest.raises(CheckpointError) as info:
        CheckpointProbe.from_checkpoint(tmp_path / "nan.pt", net, CurvatureSpec(k=1, batches=1, max_iter=5))
    assert str(info.value).startswith("curvature=: the checkpoint's weights are not finite: body.weight (5 NaN of "
                                      "2048), head.weight (1 infinite of 320); "), str(info.value)
    assert "preconditioner" not in str(info.value) and info.value.cli.startswith("--curvature: ")


# ---------------------------------------------------------------- the stored groups
def _tiny_store(path) -> None:
    rng = np.random.default_rng(0)
    with gf.Recorder(path, sources=["a"], mode="replay") as rec:
        for _ in range(4):
            rec.record(step=0, loss=1.0, source="a", n_samples=8, grads={"w": rng.standard_normal((4, 4))})


def _curv(ratio_row: float = 1.0) -> CurvatureData:
    rows = [{"block": "model", "tensors": ["w"], "source": "", "operator": "hessian", "mass": {"w": 1.0}},
            {"block": "w", "tensors": ["w"], "source": "", "operator": "hessian"}]
    return CurvatureData(rows, np.array([[3.0 * ratio_row], [3.0 * ratio_row]]), np.zeros((2, 1)),
                         np.array([5, 5]), np.array([1, 1], dtype=np.uint8),
                         {"hyper": {"optimizer": "sgd", "lr": 1.0}, "lrs": {"model": 1.0, "w": 1.0}})


@pytest.mark.parametrize("suffix", [".zarr", ".h5"])
def test_groups_round_trip_and_are_checked_at_open(tmp_path, suffix):
    path = tmp_path / f"s{suffix}"
    _tiny_store(path)
    optim = OptimData(["w"], ["ratio_q50", "eps_share"], np.array([[50.0, 0.1]]), np.zeros((1, 3), dtype=np.int64),
                      {"edges": [0.0, 1.0, 2.0, 3.0], "hyper": {"optimizer": "adam"}})
    write_probes(path, _curv(), optim)
    st = open_store(path)
    c, o = read_curvature(st), read_optim(st)
    assert c.rows[0]["mass"] == {"w": 1.0} and c.eigenvalues.tolist() == [[3.0], [3.0]]
    assert o.tensors == ["w"] and o.column("ratio_q50").tolist() == [50.0] and o.attrs["edges"] == [0, 1, 2, 3]
    from gradforensics.commands.inspect import summarize

    assert (summarize(st)["curvature_rows"], summarize(st)["optim_tensors"]) == (2, 1)
    found = gf.analyze(path, only=["curvature"])
    assert found.flags[0].kind == "curvature" and found.flags[0].evidence["ratio"] == pytest.approx(1.5)


def test_damaged_groups_are_refused_in_one_line(tmp_path):
    path = tmp_path / "s.zarr"
    _tiny_store(path)
    bad = _curv()
    write_probes(path, CurvatureData(bad.rows[:1], bad.eigenvalues, bad.residuals, bad.iterations, bad.converged,
                                     bad.attrs), None)
    with pytest.raises(CorruptStoreError, match=r"curvature/eigenvalues has shape \(2, 1\) with 1 rows"):
        open_store(path)


def test_optimizer_state_that_does_not_fit_is_refused(tmp_path):
    net = _mlp()
    other = torch.nn.Linear(3, 3)
    opt = torch.optim.Adam(other.parameters())
    other(torch.ones(1, 3)).sum().backward()
    opt.step()
    torch.save({"model": net.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "x.pt")
    with pytest.raises(GradforensicsError, match="does not fit the model") as err:
        CheckpointProbe.from_checkpoint(tmp_path / "x.pt", net, CurvatureSpec())
    assert "\n" not in str(err.value)


def test_mapping_by_shape_and_by_groups():
    """Orders that shapes cannot tell apart: the Trainer's (decay, no decay) groups decide; else named order."""
    from gradforensics.replay.optimstate import map_state

    class Affine(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bias = torch.nn.Parameter(torch.zeros(4))       # named first, but in the Trainer's second group
            self.gain = torch.nn.Parameter(torch.ones(4))

        def forward(self, x):
            return x * self.gain + self.bias

    net = Affine()
    opt = torch.optim.AdamW([{"params": [net.gain], "weight_decay": 0.1}, {"params": [net.bias], "weight_decay": 0.0}])
    (net(torch.arange(4.0)) ** 2).sum().backward()
    net.bias.grad.mul_(1000.0)                                 # tell the two apart by their moments
    opt.step()
    state = map_state(opt.state_dict(), net, "opt")
    assert state.mapping.startswith("hf-trainer (parameters order fits by shape too")
    for n, p in net.named_parameters():
        assert torch.equal(state.per_tensor[n]["exp_avg"], opt.state[p]["exp_avg"])
    plain = torch.optim.Adam(net.parameters())
    (net(torch.arange(4.0)) ** 2).sum().backward()
    plain.step()
    assert map_state(plain.state_dict(), net, "opt").mapping.startswith("parameters (hf-trainer")


def test_the_raw_hessian_under_adam_is_not_judged_not_an_all_clear(tmp_path):
    """Issue 45: ``--curvature --optimizer adam`` without the optimizer state measures the raw Hessian only, whose
    ratio has no threshold under Adam: no flag can fire, and the findings say so (``not_judged``)."""
    from gradforensics.reporting import summary

    path = tmp_path / "adam.zarr"
    _tiny_store(path)
    curv = _curv(ratio_row=50.0)                                   # a huge λ: under SGD it would be flagged
    curv.attrs["hyper"] = {"optimizer": "adam", "lr": 1.0}
    write_probes(path, curv, None)
    found = gf.analyze(path, only=["curvature"], progress=False)
    assert found.flags == []
    (nj,) = found.not_judged
    assert nj.kind == "curvature" and "no stability verdict" in nj.reason and "optimizer.pt" in nj.needed
    assert "Nothing here needs action" not in summary.verdict(found)
    path2 = tmp_path / "sgd.zarr"                                  # with a threshold: judged (and flagged)
    _tiny_store(path2)
    write_probes(path2, _curv(ratio_row=50.0), None)
    found = gf.analyze(path2, only=["curvature"], progress=False)
    assert found.not_judged == [] and found.flags[0].kind == "curvature"
