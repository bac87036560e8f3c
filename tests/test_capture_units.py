"""Activation units on the module kind's feature axis, per-unit ``dead`` / ``saturated``, and
``--model-factory`` models called as ``model(input_ids)``.

Real small torch models defined here: a CNN with BatchNorm (Conv2d 16 and 32 channels, 12 of the 32
killed by a BatchNorm bias of -1e3 before the ReLU), a GRU language model (``batch_first`` both ways), a Linear
MLP, a Conv1d net, and a nanoGPT-style LM (fused q|k|v ``nn.Linear``, SDPA, tied embeddings, its own
``config`` dataclass) built by ``--model-factory``.  Oracle: the same statistics computed here from the
module's output on the same batch (captured with a plain forward hook), moved to (positions, units) by hand.
Tolerances: shares and dead/saturated exactly; mean and std to 1e-5 relative; the module's excess kurtosis
(``scipy.stats.kurtosis`` of all its outputs) to 1e-5 relative.
"""

from __future__ import annotations

import dataclasses
import json
import random
import warnings

import numpy as np
import pytest
import scipy.stats

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import gradforensics as gf  # noqa: E402
from gradforensics import cli  # noqa: E402
from gradforensics.errors import SpecError  # noqa: E402
from gradforensics.recording.units import kind_axis  # noqa: E402
from gradforensics.store.reader import open_store  # noqa: E402

torch.set_num_threads(1)
RECORDS = 3


# ---------------------------------------------------------------- models
class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1, self.act1 = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU()
        self.conv2, self.bn2, self.act2 = nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU()
        self.pool, self.head = nn.AdaptiveAvgPool2d(1), nn.Linear(32, 10)

    def forward(self, x):
        x = self.act1(self.bn1(self.conv1(x)))
        x = self.act2(self.bn2(self.conv2(x)))
        return self.head(self.pool(x).flatten(1))


def dead_cnn() -> CNN:
    torch.manual_seed(0)
    m = CNN()
    with torch.no_grad():
        m.bn2.bias[:12] = -1e3            # 12 of 32 channels never pass the ReLU
    return m


class GRULM(nn.Module):
    def __init__(self, batch_first: bool, vocab: int = 50, hidden: int = 24) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.emb, self.rnn = nn.Embedding(vocab, 16), nn.GRU(16, hidden, batch_first=batch_first)
        self.act, self.out = nn.Tanh(), nn.Linear(hidden, vocab)

    def forward(self, ids):                                   # ids (B, T)
        x = self.emb(ids if self.batch_first else ids.T)
        h, _ = self.rnn(x)
        return self.out(self.act(h))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(12, 40), nn.GELU(), nn.Linear(40, 3)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Conv1dNet(nn.Module):
    """(N, C, L) outputs: 3-D, channels on axis 1 - the rank alone cannot tell."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.act, self.act2 = nn.Conv1d(4, 8, 3), nn.ReLU(), nn.ReLU()
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.act2(F.max_pool1d(self.act(self.conv(x)), 2))).sum()


# ---------------------------------------------------------------- oracle
def run(model, path, batches, loss_fn, modules, **kw):
    """Record *modules* over *batches* (one record each); return the outputs a plain hook saw, per module."""
    seen: dict[str, list] = {m: [] for m in modules}
    named = dict(model.named_modules())
    handles = [named[m].register_forward_hook(
        lambda mod, a, o, m=m: seen[m].append((o[0] if isinstance(o, tuple) else o).detach().clone()))
        for m in modules]
    with gf.Recorder(path, model=model, sources=["s"], activations=list(modules), heads=None, **kw) as rec:
        for i, x in enumerate(batches):
            loss_fn(model(x)).backward()
            rec.record(step=i, loss=0.0, source="s")
            model.zero_grad()
    for h in handles:
        h.remove()
    return seen


def oracle(outs, axis, low, high, bounds=None):
    """dead / saturated / shares / mean / std of one record from its (..., units on *axis*, ...) outputs."""
    a = torch.cat([o.movedim(axis, -1).reshape(-1, o.shape[axis]) for o in outs]).double()
    near = a.abs() <= low
    top = (a >= 0.9 * bounds[1]) | (a <= 0.9 * bounds[0]) if bounds else a.abs() >= high
    return {"dead": near.all(0).numpy().astype(np.uint8), "saturated": top.all(0).numpy().astype(np.uint8),
            "frac_low": near.double().mean(0).numpy(), "frac_high": top.double().mean(0).numpy(),
            "mean": a.mean(0).numpy(), "std": a.std(0, unbiased=False).numpy()}


def check_against_oracle(store, module, outs_per_record, axis, bounds=None):
    attrs = store.act_attrs(module)
    assert attrs["unit_axis"] == axis
    units = outs_per_record[0][0].shape[axis]
    assert attrs["units"] == units
    for r, outs in enumerate(outs_per_record):
        # the module's excess kurtosis over all its outputs of the record: SciPy on the same values
        pooled = torch.cat([o.reshape(-1) for o in outs]).double().numpy()
        np.testing.assert_allclose(store.act(module, "kurtosis")[r], [scipy.stats.kurtosis(pooled)], rtol=1e-5,
                                   err_msg=f"{module} kurtosis")
        want = oracle(outs, axis, attrs["low"], attrs["high"], bounds)
        for stat, w in want.items():
            got = store.act(module, stat)
            assert got.shape == (len(outs_per_record), units), (module, stat)
            if stat in ("dead", "saturated"):
                assert got.dtype == np.uint8
                np.testing.assert_array_equal(got[r], w, err_msg=f"{module} {stat}")
            elif stat.startswith("frac"):
                np.testing.assert_allclose(got[r], w, atol=1e-6, err_msg=f"{module} {stat}")
            else:
                np.testing.assert_allclose(got[r], w, rtol=1e-5, atol=1e-6, err_msg=f"{module} {stat}")


# ---------------------------------------------------------------- tests
def test_cnn_channels_are_the_units_and_twelve_dead_channels_are_stored(tmp_path):
    m = dead_cnn()
    torch.manual_seed(1)
    batches = [torch.randn(4, 3, 8, 8) for _ in range(RECORDS)]
    mods = ["conv1", "bn1", "act1", "conv2", "bn2", "act2", "pool"]
    seen = run(m, tmp_path / "cnn.zarr", batches, lambda y: y.pow(2).mean(), mods)
    store = open_store(tmp_path / "cnn.zarr")
    for mod in mods:
        check_against_oracle(store, mod, [[o] for o in seen[mod]], axis=1)
    assert store.act_attrs("act1")["units"] == 16 and store.act_attrs("act2")["units"] == 32
    assert store.act_attrs("act2")["unit_axis_from"] == "input from bn2: module kind BatchNorm2d: channel axis"
    dead = store.act("act2", "dead")
    np.testing.assert_array_equal(dead.sum(axis=1), [12] * RECORDS)
    assert dead[:, :12].all() and not dead[:, 12:].any()
    # the same as a direct count of the ReLU's exact zeros on every (sample, row, column)
    for r, o in enumerate(seen["act2"]):
        assert int((o == 0).all(dim=(0, 2, 3)).sum()) == 12 == int(dead[r].sum())
    assert store.act("act1", "dead").sum() == 0


@pytest.mark.parametrize("batch_first", [True, False])
def test_gru_units_are_the_hidden_axis(tmp_path, batch_first):
    torch.manual_seed(2)
    m = GRULM(batch_first)
    with torch.no_grad():                  # gates (r, z, n) of 24 units each
        m.rnn.bias_ih_l0[24:28] = -40.0    # units 0-3: update gate z ~ 0, so h_t = n_t ...
        m.rnn.bias_ih_l0[48:52] = 40.0     # ... = tanh(+40 + ...) = 1: at the top of (-1, 1) from the first step
    batches = [torch.randint(0, 50, (3, 7)) for _ in range(RECORDS)]
    seen = run(m, tmp_path / "gru.zarr", batches, lambda y: y.logsumexp(-1).mean(), ["rnn", "act"],
               act_bounds={"rnn": (-1.0, 1.0)})
    store = open_store(tmp_path / "gru.zarr")
    axis = 2                               # (B, T, H) or (T, B, H): the hidden axis is the last either way
    for mod in ("rnn", "act"):
        check_against_oracle(store, mod, [[o] for o in seen[mod]], axis=axis, bounds=(-1.0, 1.0))
        assert store.act_attrs(mod)["units"] == 24
    assert store.act_attrs("rnn")["unit_axis_from"] == "module kind GRU: last axis"
    assert seen["rnn"][0].shape == ((3, 7, 24) if batch_first else (7, 3, 24))
    sat = store.act("rnn", "saturated")
    np.testing.assert_array_equal(sat.sum(axis=1), [4] * RECORDS)
    assert sat[:, :4].all()


def test_linear_mlp_is_unchanged_last_axis(tmp_path):
    from gradforensics.recording.actstats import act_stats

    torch.manual_seed(3)
    m = MLP()
    batches = [torch.randn(5, 6, 12) for _ in range(RECORDS)]
    seen = run(m, tmp_path / "mlp.zarr", batches, lambda y: y.pow(2).mean(), ["fc1", "act"])
    store = open_store(tmp_path / "mlp.zarr")
    for mod in ("fc1", "act"):
        check_against_oracle(store, mod, [[o] for o in seen[mod]], axis=2)
        rng = store.act_attrs(mod)
        # as before this change: the last axis, numpy's act_stats on (tokens, units)
        from gradforensics.recording.actstats import ActRange
        ar = ActRange(rng["scale"], rng["low"], rng["high"], tuple(rng["edges"]), None)
        for r, o in enumerate(seen[mod]):
            ref = act_stats(o.reshape(-1, 40).numpy(), ar)
            for stat in ("hist", "frac_low", "frac_high", "dead", "saturated"):
                np.testing.assert_array_equal(store.act(mod, stat)[r], ref[stat])
            np.testing.assert_allclose(store.act(mod, "mean")[r], ref["mean"], rtol=1e-5, atol=1e-6)
    assert store.act_attrs("act")["unit_axis_from"] == "input from fc1: module kind Linear: last axis"


def test_conv1d_activation_after_a_function_warns_and_unit_axes_overrides(tmp_path):
    torch.manual_seed(4)
    m = Conv1dNet()
    x = [torch.randn(2, 4, 10)]
    with pytest.warns(RuntimeWarning, match=r"unit_axes=\{'act2': 1\}"):
        run(m, tmp_path / "a.zarr", x, lambda y: y, ["act", "act2"])
    s = open_store(tmp_path / "a.zarr")
    assert (s.act_attrs("act")["unit_axis"], s.act_attrs("act")["units"]) == (1, 8)      # from the Conv1d
    assert (s.act_attrs("act2")["unit_axis"], s.act_attrs("act2")["units"]) == (2, 4)    # the rank's guess
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        seen = run(m, tmp_path / "b.zarr", x, lambda y: y, ["act", "act2"], unit_axes={"act2": 1})
    s = open_store(tmp_path / "b.zarr")
    assert s.act_attrs("act2")["unit_axis_from"] == "unit_axes option"
    check_against_oracle(s, "act2", [[seen["act2"][0]]], axis=1)
    with pytest.raises(SpecError, match="unit_axes: glob 'nope' matches none"):
        gf.Recorder(tmp_path / "c.zarr", model=m, sources=["s"], activations=["act"], unit_axes={"nope": 1})


def test_kind_rules():
    assert kind_axis(nn.Conv2d(1, 2, 1), 4)[0] == 1 and kind_axis(nn.Conv2d(1, 2, 1), 3)[0] == 0   # unbatched
    assert kind_axis(nn.BatchNorm1d(3), 2)[0] == 1 and kind_axis(nn.BatchNorm1d(3), 3)[0] == 1
    assert kind_axis(nn.MaxPool3d(2), 5)[0] == 1 and kind_axis(nn.LSTM(2, 3), 3)[0] == 2
    assert kind_axis(nn.Linear(2, 3), 4)[0] == 3 and kind_axis(nn.ReLU(), 4) is None


# ---------------------------------------------------------------- --model-factory, called as model(input_ids)
@dataclasses.dataclass
class GPTConfig:
    vocab: int = 40
    block: int = 32
    d: int = 32
    heads: int = 4
    layers: int = 2


class Block(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.ln1, self.ln2, self.heads = nn.LayerNorm(c.d), nn.LayerNorm(c.d), c.heads
        self.c_attn, self.c_proj = nn.Linear(c.d, 3 * c.d), nn.Linear(c.d, c.d)
        self.fc, self.act, self.proj = nn.Linear(c.d, 4 * c.d), nn.GELU(), nn.Linear(4 * c.d, c.d)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.c_attn(self.ln1(x)).split(D, dim=2)
        q, k, v = (t.view(B, T, self.heads, D // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D)
        x = x + self.c_proj(y)
        return x + self.proj(self.act(self.fc(self.ln2(x))))


class NanoGPT(nn.Module):
    """nanoGPT's shape: ``self.config`` of its own, ``forward(idx, targets=None) -> (logits, loss)``."""

    def __init__(self, config: GPTConfig, last_only: bool = False) -> None:
        super().__init__()
        self.config, self.last_only = config, last_only
        self.wte, self.wpe = nn.Embedding(config.vocab, config.d), nn.Embedding(config.block, config.d)
        self.h = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.ln_f, self.lm_head = nn.LayerNorm(config.d), nn.Linear(config.d, config.vocab, bias=False)
        self.lm_head.weight = self.wte.weight            # tied

    def forward(self, idx, targets=None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in self.h:
            x = b(x)
        x = self.ln_f(x)
        if targets is None and self.last_only:           # nanoGPT's inference path
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, y):
        return self.lin(x) + y


def nanogpt_factory():
    return NanoGPT(GPTConfig())


def last_only_factory():
    return NanoGPT(GPTConfig(), last_only=True)


def two_inputs_factory():
    return TwoInputs()


WORDS = ["the", "model", "loss", "grad", "layer", "head", "unit", "norm", "step", "rate", "data", "batch"]


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    d = tmp_path_factory.mktemp("tok")
    vocab = {w: i for i, w in enumerate(["<pad>", "<unk>", "</s>", *WORDS])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>",
                                                unk_token="<unk>")
    fast.save_pretrained(d)
    rng = random.Random(0)
    data = d / "a.jsonl"
    data.write_text("".join(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(30))}) + "\n"
                            for _ in range(20)), encoding="utf-8")
    return d, data


def capture(*argv, capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rc = cli.main(["capture", *map(str, argv), "--quiet"])
    return rc, capsys.readouterr().err


@pytest.mark.slow
def test_model_factory_causal_lm_calls_model_input_ids(tmp_path, word_tokenizer, capsys):
    tok, data = word_tokenizer
    torch.manual_seed(0)
    torch.save(nanogpt_factory().state_dict(), tmp_path / "ckpt.pt")
    args = (tmp_path / "ckpt.pt", "--data", f"a={data}", "--model-factory", "test_capture_units:nanogpt_factory",
            "--tokenizer", tok, "--loss", "causal-lm", "--batches-per-source", "2", "--batch-size", "2",
            "--seq-len", "16", "--heads", "none", "--activations", "h.*.act")
    rc, err = capture(*args, "--out", tmp_path / "ok.zarr", capsys=capsys)
    assert rc == 0, err
    assert "Traceback" not in err
    s = open_store(tmp_path / "ok.zarr")
    assert s.n_records == 2 and np.isfinite(s.batches()["loss"]).all()
    assert s.act_attrs("h.0.act")["units"] == 128 and s.act_attrs("h.0.act")["unit_axis"] == 2

    rc, err = capture(*args[:4], "test_capture_units:last_only_factory", *args[5:], "--out", tmp_path / "l.zarr",
                      capsys=capsys)
    assert rc != 0 and "Traceback" not in err
    assert "logits at every position (B, T, V)" in err and len(err.strip().splitlines()) == 1

    torch.save(two_inputs_factory().state_dict(), tmp_path / "two.pt")
    rc, err = capture(tmp_path / "two.pt", *args[1:4], "test_capture_units:two_inputs_factory", *args[5:-2],
                      "--out", tmp_path / "t.zarr", capsys=capsys)
    assert rc != 0 and "Traceback" not in err
    assert "TwoInputs.forward cannot be called as model(input_ids)" in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_saturation_analysis_flags_the_cnn_with_twelve_dead_channels(tmp_path):
    """Before the channel axis, the units were the image's 8 columns and nothing was flagged."""
    m = dead_cnn()
    torch.manual_seed(1)
    batches = [torch.randn(4, 3, 8, 8) for _ in range(40)]
    run(m, tmp_path / "c.zarr", batches, lambda y: y.pow(2).mean(), ["act1", "act2"])
    flags = gf.analyze(tmp_path / "c.zarr", only="saturation", progress=False).flags
    assert [f.tensor for f in flags] == ["act2"]
    assert flags[0].evidence["dead_share"] == pytest.approx(12 / 32)


@pytest.mark.slow
def test_gpt2_conv1d_mlp_activation_is_the_feature_axis_without_a_warning(tmp_path):
    """GPT-2's ``Conv1D`` is no torch kind: its weights (D, 4D) tell the last axis; the act follows it."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=50,
                                                                 n_positions=16, bos_token_id=0, eos_token_id=0))
    ids = [torch.randint(0, 50, (2, 8))]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        seen = run(m, tmp_path / "g.zarr", ids, lambda y: y.logits.logsumexp(-1).mean(),
                   ["transformer.h.0.mlp.act", "transformer.h.0.mlp.c_fc"])
    s = open_store(tmp_path / "g.zarr")
    assert s.act_attrs("transformer.h.0.mlp.act")["unit_axis_from"] == \
        "input from transformer.h.0.mlp.c_fc: Conv1D's weights have 128: last axis"
    check_against_oracle(s, "transformer.h.0.mlp.act", [[seen["transformer.h.0.mlp.act"][0]]], axis=2)
