"""The twin zoo's harness (:mod:`gradforensics.testing.twins`) and ``benchmarks/calibration.py --twins``.

Fast: :class:`Expect`, :func:`built`, :func:`score` on hand-made arms, the table of a family not built.
Slow: :func:`judge` on a stub family (a real 6-step tanh MLP on digits, recorded live, at two
learning rates; registered by monkeypatching ``FAMILIES``), the benchmark's ``--twins`` path on it,
the zoo's own q.k truth of the HF runs against the attention probabilities transformers returns, and
the ``mlp-eos`` family end to end.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from gradforensics.analysis.contract.model import Flag
from gradforensics.testing import twins
from gradforensics.testing.twins import FAMILIES, Expect, Family, Judged

STUB = "gradforensics.testing.twins.stub_family"


def _flag(kind: str, tensor: str, severity: float, head: int | None = None, sources: tuple[str, ...] = ()) -> Flag:
    return Flag(kind, tensor, head, sources, severity, (0, 1), {}, f"{kind}.")


def _benchmark() -> types.ModuleType:
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "calibration.py"
    spec = importlib.util.spec_from_file_location("calibration_benchmark", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ------------------------------------------------------------------ fast
def test_expect_matches_kind_tensor_head_and_sources() -> None:
    e = Expect("conflict", tensor="layers.*.q", head=1, sources=("broken",))
    assert e.matches(_flag("conflict", "layers.3.q", 0.9, head=1, sources=("broken", "web")))
    assert not e.matches(_flag("drift", "layers.3.q", 0.9, head=1, sources=("broken",)))       # kind
    assert not e.matches(_flag("conflict", "layers.3.k", 0.9, head=1, sources=("broken",)))    # tensor glob
    assert not e.matches(_flag("conflict", "layers.3.q", 0.9, head=2, sources=("broken",)))    # head
    assert not e.matches(_flag("conflict", "layers.3.q", 0.9, head=1, sources=("web",)))       # a source missing
    assert Expect("saturation").matches(_flag("saturation", "anything", 0.1))
    assert str(e) == "conflict on layers.*.q head 1 naming broken"


def test_every_family_is_well_formed() -> None:
    for name, fam in FAMILIES.items():
        assert fam.name == name and fam.sick not in fam.healthy and len(set(fam.arms)) == len(fam.arms)
        assert fam.healthy, name


def test_built_says_not_built_for_a_missing_module(monkeypatch) -> None:
    monkeypatch.setitem(FAMILIES, "ghost", Family("ghost", "no_such_family", "sick", ("well",), Expect("drift")))
    assert twins.built("ghost") == "not built"
    assert twins.built("llama") is None                     # hf_runs is here


def test_score_row_margin_and_match(monkeypatch) -> None:
    monkeypatch.setitem(FAMILIES, "ghost", Family("ghost", "no_such_family", "sick", ("well", "low"),
                                                  Expect("oscillation", tensor="0.*"), info=("z",)))
    arms = {
        "sick": Judged("ghost", "sick", 1, {"x": 2.0}, [_flag("oscillation", "0.weight", 0.8),
                                                         _flag("drift", "2.weight", 0.3)], 1.0, 2.0),
        "well": Judged("ghost", "well", 1, {"x": 1.0}, [_flag("drift", "0.bias", 0.45),
                                                         _flag("oscillation", "0.weight", 0.2)], 1.0, 2.0),
        "low": Judged("ghost", "low", 1, {"x": 1.0}, [_flag("oscillation", "2.weight", 0.55)], 1.0, 2.0),
        "z": Judged("ghost", "z", 1, {"x": 1.5}, [], 1.0, 2.0),
    }
    row = twins.score("ghost", arms)
    assert row["matches"] and row["sick"]["kind"] == "oscillation" and row["seed"] == 1
    assert row["twins"]["well"]["flags_ge_0.5"] == 0 and row["twins"]["low"]["flags_ge_0.5"] == 1
    assert row["twins"]["well"]["largest"]["kind"] == "drift"
    assert row["margin"] == pytest.approx(0.8 - 0.55)       # the twins' largest *oscillation*
    assert row["expected_margin"] == pytest.approx(0.25) and row["info"] == {"z": None}
    json.dumps(row)
    arms["sick"].flags[0] = _flag("oscillation", "0.weight", 0.45)          # below 0.5: no first flag
    assert not twins.score("ghost", arms)["matches"]


def test_benchmark_reports_a_family_not_built(monkeypatch, capsys) -> None:
    monkeypatch.setitem(FAMILIES, "ghost", Family("ghost", "no_such_family", "sick", ("well",), Expect("drift")))
    assert _benchmark().main(["--twins", "ghost", "--json"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert json.loads(out[0]) == {"family": "ghost", "status": "not built"}
    assert out[-1].split() == ["ghost", "-", "not", "built"]


def test_benchmark_reports_a_family_that_fails(monkeypatch, capsys) -> None:
    def broken(arm: str, path: Path, *, seed: int = 0) -> dict[str, float]:
        raise RuntimeError("the family module is under construction")

    mod = types.ModuleType(STUB)
    mod.train = broken  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, STUB, mod)
    monkeypatch.setitem(FAMILIES, "stub", Family("stub", "stub_family", "high", ("low",), Expect("drift")))
    assert _benchmark().main(["--twins", "stub", "--seeds", "1", "--json"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert json.loads(out[0])["status"] == "failed: RuntimeError: the family module is under construction"
    assert out[-1].startswith("stub") and "failed" in out[-1]


# ------------------------------------------------------------------ slow: real runs
def _stub_train(arm: str, path: Path, *, seed: int = 0) -> dict[str, float]:
    """A real 6-step full-batch GD run of a small tanh MLP on digits, recorded live; truth: the losses."""
    import torch

    import gradforensics as gf
    from gradforensics.testing import real_runs

    torch.set_num_threads(1)
    x, y = real_runs.digits()
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.Tanh(), torch.nn.Linear(16, 10))
    lr = {"high": 3.0, "low": 0.05}[arm]
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    with gf.Recorder(path, model=model, sources=["digits"], mode="training", overwrite=True) as rec:
        for step in range(6):
            loss = real_runs.mse(model, x, y)
            loss.backward()
            rec.record(step=step, loss=loss.item(), source="digits", n_samples=len(x), lr=lr)
            losses.append(loss.item())
            opt.step()
            opt.zero_grad(set_to_none=True)
    return {"loss_first": losses[0], "loss_last": losses[-1]}


@pytest.fixture
def stub(monkeypatch) -> str:
    mod = types.ModuleType(STUB)
    mod.train = _stub_train  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, STUB, mod)
    monkeypatch.setitem(FAMILIES, "stub", Family("stub", "stub_family", "high", ("low",), Expect("oscillation")))
    return "stub"


@pytest.mark.slow
def test_judge_trains_and_analyses_every_arm(stub, tmp_path) -> None:
    judged = twins.judge(stub, tmp_path, seed=0)
    assert list(judged) == ["high", "low"]
    for arm, j in judged.items():
        assert (j.family, j.arm, j.seed) == ("stub", arm, 0) and j.train_s > 0 and j.analyze_s > 0
        assert (tmp_path / f"stub-{arm}-0.zarr").is_dir()
        sev = [f.severity for f in j.flags]
        assert sev == sorted(sev, reverse=True)
        assert j.largest("no-such-kind") == 0.0
        assert f"stub/{arm} seed 0" in twins.describe(j)
    # the truth, measured by the stub itself: GD at 3.0 on this loss does not descend like GD at 0.05
    assert judged["low"].truth["loss_last"] < judged["low"].truth["loss_first"]
    assert judged["high"].truth["loss_first"] == pytest.approx(judged["low"].truth["loss_first"])
    with pytest.raises(ValueError, match="has arms high, low"):
        twins.train(stub, "medium", tmp_path / "x.zarr")


@pytest.mark.slow
def test_benchmark_twins_path_on_the_stub(stub, capsys) -> None:
    assert _benchmark().main(["--twins", stub, "--seeds", "1", "--json"]) == 0
    out = capsys.readouterr().out.splitlines()
    row = json.loads(out[0])
    assert row["family"] == "stub" and row["seed"] == 0 and set(row["truth"]) == {"high", "low"}
    assert set(row["seconds"]) == {"high", "low"} and "low" in row["twins"]
    assert out[1].split()[:2] == ["family", "seed"] and out[2].split()[:2] == ["stub", "0"]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_hf_truth_hook_agrees_with_the_attention_transformers_returns(arch) -> None:
    """The zoo's own q.k (RoPE, GQA, scale, causal mask) gives the entropy of transformers' eager attention."""
    import torch
    import transformers

    from gradforensics.testing.twins import hf_runs

    torch.manual_seed(0)
    if arch == "llama":
        cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                       attn_implementation="eager")
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                      attn_implementation="eager")
        model = transformers.GPT2LMHeadModel(cfg)
    model.eval()                             # GPT-2's attention dropout: the probabilities returned are after it
    for p in model.parameters():             # larger weights: logits well away from 0, entropies well below 1
        p.data.mul_(6.0)
    watch, truth = hf_runs.attention_truth(arch)
    watch(model)
    ids = torch.randint(0, 64, (3, 16))
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids, output_attentions=True)
    got = truth()
    t = ids.shape[1]
    for i, a in enumerate(out.attentions):                 # (batch, heads, seq, seq), rows sum to 1
        ent = -(a * a.clamp_min(1e-30).log()).sum(-1)[..., 1:] / torch.log(torch.arange(2, t + 1.0))
        assert got[f"entropy_last_{i}"] == pytest.approx(float(ent.mean(dim=(0, 2)).min()), abs=1e-5)
        assert got[f"max_logit_first_{i}"] == got[f"max_logit_last_{i}"] > 1.0
    assert got["loss_first"] == pytest.approx(float(out.loss))
    assert np.isfinite(list(got.values())).all()


@pytest.mark.slow
def test_mlp_eos_family_end_to_end(tmp_path) -> None:
    """The family the zoo inherits from real_runs: EoS GD is flagged as expected, its eta-0.1 twin is quiet."""
    judged = twins.judge("mlp-eos", tmp_path, seed=0)
    row = twins.score("mlp-eos", judged)
    assert row["matches"], twins.describe(judged["mlp-eos"])
    assert row["twins"]["mlp-gd"]["flags_ge_0.5"] == 0, twins.describe(judged["mlp-gd"])
    sick, twin = judged["mlp-eos"].truth, judged["mlp-gd"].truth    # power iteration and gradient cosines, plain torch
    assert sick["lambda_eta"] > 1.8 and twin["lambda_eta"] < 1.5
    assert sick["cos_consecutive"] < -0.5 and twin["cos_consecutive"] > 0.9
