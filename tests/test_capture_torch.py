"""The PyTorch recorder: head-split oracles on real HF layouts, accumulation, activations, hooks."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import gradforensics as gf  # noqa: E402
from gradforensics.errors import SpecError  # noqa: E402
from gradforensics.recording import actstats, hostcopy  # noqa: E402
from gradforensics.recording.sketch import Sketcher  # noqa: E402
from gradforensics.recording.torch import TorchRecorder  # noqa: E402
from gradforensics.store.schema import decode_bf16  # noqa: E402

nn = torch.nn
H, KV, HIDDEN, VOCAB = 4, 2, 32, 64
D = HIDDEN // H


# ---------------------------------------------------------------- tiny models
def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=H, num_key_value_heads=KV, max_position_embeddings=64)
    return LlamaForCausalLM(cfg)


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=H, n_positions=64,
                     bos_token_id=0, eos_token_id=0, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def neox():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    cfg = GPTNeoXConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=H, max_position_embeddings=64, bos_token_id=0, eos_token_id=0)
    return GPTNeoXForCausalLM(cfg)


MODELS = {"llama": llama, "gpt2": gpt2, "neox": neox}


def make(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return MODELS[kind]().eval()


def batch(seed: int, n: int = 2, t: int = 8):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n, t), generator=g)


def backward(model, ids) -> float:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return float(loss.detach())


def grads_of(model) -> dict[str, np.ndarray]:
    return {n: p.grad.detach().clone().numpy() for n, p in model.named_parameters() if p.grad is not None}


# ----------------------------------------------------- expected head slices
# Written from each family's modelling code, independently of HeadSpec.
def expected_heads(kind: str, leaf: str, g: np.ndarray) -> tuple[np.ndarray, str, int]:
    """(blocks (n_heads, ...), role, split_axis) for the gradient *g* of an attention weight."""
    if kind == "llama":
        if leaf in ("q_proj", "k_proj", "v_proj"):
            n = H if leaf == "q_proj" else KV
            return np.stack([g[h * D:(h + 1) * D] for h in range(n)]), leaf[0], 0
        if leaf == "o_proj":
            return np.stack([g[:, h * D:(h + 1) * D] for h in range(H)]), "o", 1
    if kind == "gpt2":
        if leaf == "c_attn":        # Conv1D (in, 3*hidden): columns q | k | v, each H heads of D
            return np.stack([g[:, p * HIDDEN + h * D:p * HIDDEN + (h + 1) * D]
                             for p in range(3) for h in range(H)]), "qkv", 1
        if leaf == "c_proj":        # Conv1D (hidden_in, hidden_out): heads on the input rows
            return np.stack([g[h * D:(h + 1) * D] for h in range(H)]), "o", 0
    if kind == "neox":
        if leaf == "query_key_value":   # rows [h][q|k|v][d]
            return np.stack([g[h * 3 * D + p * D:h * 3 * D + (p + 1) * D]
                             for p in range(3) for h in range(H)]), "qkv", 0
        if leaf == "dense":
            return np.stack([g[:, h * D:(h + 1) * D] for h in range(H)]), "o", 1
    raise AssertionError((kind, leaf))


ATTN_LEAVES = {"llama": ("q_proj", "k_proj", "v_proj", "o_proj"), "gpt2": ("c_attn", "c_proj"),
               "neox": ("query_key_value", "dense")}


def attention_tensors(kind: str, names) -> dict[str, str]:
    out = {}
    for n in names:
        parts = n.split(".")
        if len(parts) < 3:
            continue
        leaf, parent = parts[-2], parts[-3]
        if leaf in ATTN_LEAVES[kind] and parent in ("self_attn", "attn", "attention") and n.endswith("weight"):
            out[n] = leaf
    return out


@pytest.mark.parametrize(("kind", "suffix"), [("llama", ".zarr"), pytest.param("llama", ".h5", marks=pytest.mark.slow),
                                              ("gpt2", ".zarr"), pytest.param("gpt2", ".h5", marks=pytest.mark.slow),
                                              ("neox", ".zarr")])
def test_head_split_matches_the_model_layout(tmp_path, kind, suffix):
    model = make(kind)
    path = tmp_path / f"d{suffix}"
    seen = []
    with gf.Recorder(path, model=model, sources=["a", "b"], heads="auto") as rec:
        assert isinstance(rec, TorchRecorder)
        for i in range(3):
            backward(model, batch(i))
            seen.append(grads_of(model))
            rec.record(step=i, source="ab"[i % 2])
            model.zero_grad()
    store = gf.open_store(path)
    assert store.meta.framework == "torch" and store.n_records == 3
    tensors = attention_tensors(kind, store.grads)
    assert len(tensors) == 2 * len(ATTN_LEAVES[kind])
    for name, leaf in tensors.items():
        got = store.grad(name).compute()
        for i in range(3):
            blocks, role, axis = expected_heads(kind, leaf, seen[i][name])
            np.testing.assert_array_equal(got[i], blocks)
        info = store.grads[name]
        assert (info.heads, info.attrs["role"], info.attrs["split_axis"]) == (len(blocks), role, axis)
    for name in set(store.grads) - set(tensors):      # everything else whole
        np.testing.assert_array_equal(store.grad(name)[1].compute(), seen[1][name])
        assert store.grads[name].heads is None


def _silence_head(kind: str, model, h: int) -> None:
    """Zero the output-projection weights that read head *h* in every layer."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "attention.dense.weight")):
                p[:, h * D:(h + 1) * D] = 0
            elif name.endswith("attn.c_proj.weight"):
                p[h * D:(h + 1) * D] = 0


@pytest.mark.parametrize("kind", ["llama", "gpt2", "neox"])
def test_silenced_head_has_zero_q_k_v_gradient_in_its_own_block(tmp_path, kind):
    # A semantic oracle, independent of any slicing: when the output projection
    # ignores head h, the loss does not depend on head h's q/k/v, so exactly the
    # stored blocks of head h are zero.  For GQA, k/v head g serves query heads
    # g*H/KV ... so silencing both query heads of group 0 zeroes k/v head 0.
    model = make(kind, seed=1)
    silenced = [0, 1] if kind == "llama" else [2]
    for h in silenced:
        _silence_head(kind, model, h)
    path = tmp_path / "d.zarr"
    glob = {"llama": "*.self_attn.*", "gpt2": "*.attn.*", "neox": "*.attention.*"}[kind]   # biases too
    with gf.Recorder(path, model=model, sources=["a"], tensors=[glob]) as rec:
        backward(model, batch(3))
        rec.record(source="a")
    store = gf.open_store(path)
    layers = (0, 1)
    expected = {
        "llama": {f"model.layers.{i}.self_attn.{r}_proj.weight": r for i in layers for r in "qkv"},
        "gpt2": {f"transformer.h.{i}.attn.c_attn.{p}": "qkv" for i in layers for p in ("weight", "bias")},
        "neox": {f"gpt_neox.layers.{i}.attention.query_key_value.{p}": "qkv" for i in layers for p in ("weight", "bias")},
    }[kind]
    roles = {name: info.attrs.get("role") for name, info in store.grads.items()
             if info.attrs.get("role") in ("q", "k", "v", "qkv")}
    assert roles == expected                                   # the oracle below is never vacuous
    for name, info in store.grads.items():
        role = info.attrs.get("role")
        if role not in ("q", "k", "v", "qkv"):
            continue
        g = store.grad(name)[0].compute()
        norms = np.abs(g).reshape(g.shape[0], -1).max(axis=1)
        labels = info.attrs["head_labels"]
        assert len(labels) == {"q": H, "k": KV, "v": KV, "qkv": 3 * H}[role], (name, labels)
        for j, lab in enumerate(labels):
            head = int(lab.lstrip("qkv"))
            dead = head in ({0} if role in ("k", "v") else set(silenced))
            assert (norms[j] == 0) == dead, (name, lab, norms[j])


def test_gradient_accumulation_sums_micro_batches_and_keeps_all_activations(tmp_path):
    model = make("llama")
    mb = [batch(10), batch(11)]
    separate = []
    for ids in mb:
        model.zero_grad()
        backward(model, ids)
        separate.append(grads_of(model))
    model.zero_grad()
    path = tmp_path / "acc.zarr"
    with gf.Recorder(path, model=model, sources=["a"], heads=None, tensors=["*.mlp.up_proj.weight"],
                     activations=["model.layers.0.mlp.act_fn"]) as rec:
        for ids in mb:
            backward(model, ids)
        rec.record(source="a", n_samples=4)
    store = gf.open_store(path)
    name = "model.layers.0.mlp.up_proj.weight"
    np.testing.assert_allclose(store.grad(name)[0].compute(), separate[0][name] + separate[1][name],
                               rtol=1e-5, atol=1e-7)
    # values of both micro-batches: 2 x (2 sequences x 8 tokens) x 64 units
    assert store.act("model.layers.0.mlp.act_fn", "hist")[0].sum() == 2 * 2 * 8 * 64
    assert store.batches()["n_samples"][0] == 4


class TinyMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.act = nn.Tanh()
        self.fc2 = nn.Linear(16, 12)
        self.relu = nn.ReLU()
        self.head = nn.Linear(12, 1)

    def forward(self, x):
        return self.head(self.relu(self.fc2(self.act(self.fc1(x)))))


def _numpy_stats(a: np.ndarray, scale: float, bounds, edges) -> dict[str, np.ndarray]:
    """Direct per-unit statistics of (tokens, units) *a*, from actstats' documented definitions."""
    high = np.abs(a) >= 0.9 * scale if bounds is None else (a >= 0.9 * bounds[1]) | (a <= 0.9 * bounds[0])
    return {"frac_low": (np.abs(a) <= 0.05 * scale).mean(0), "frac_high": high.mean(0),
            "mean": a.astype(np.float64).mean(0), "std": a.astype(np.float64).std(0),
            "hist": np.histogram(a, bins=np.asarray(edges))[0]}


def test_activation_statistics_match_numpy_on_the_captured_outputs(tmp_path):
    torch.manual_seed(0)
    model = TinyMLP()
    captured = {"act": [], "relu": []}
    side = [model.act.register_forward_hook(lambda m, i, o: captured["act"].append(o.detach().numpy().copy())),
            model.relu.register_forward_hook(lambda m, i, o: captured["relu"].append(o.detach().numpy().copy()))]
    path = tmp_path / "acts.h5"
    with gf.Recorder(path, model=model, sources=["a"], activations=["act", "relu"]) as rec:
        for i in range(3):
            x = torch.randn(40, 6, generator=torch.Generator().manual_seed(i)) * (1 + i)
            model(x).pow(2).mean().backward()
            rec.record(source="a")
            model.zero_grad()
    for h in side:
        h.remove()
    store = gf.open_store(path)
    scale_relu = float(np.percentile(np.abs(captured["relu"][0]), actstats.REFERENCE_QUANTILE))
    for module, scale, bounds in (("act", 1.0, (-1.0, 1.0)), ("relu", scale_relu, None)):
        attrs = store.act_attrs(module)
        assert attrs["bounds"] == (list(bounds) if bounds else None)     # nn.Tanh known as bounded
        np.testing.assert_allclose(attrs["scale"], scale, rtol=1e-6)
        for i in range(3):
            want = _numpy_stats(captured[module][i], scale, bounds, attrs["edges"])
            for stat, value in want.items():
                np.testing.assert_allclose(store.act(module, stat)[i], value, rtol=1e-5, atol=1e-6,
                                           err_msg=f"{module} {stat} record {i}")


def test_weights_every_snapshots_records_0_k_2k(tmp_path):
    torch.manual_seed(0)
    model = TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "w.zarr"
    snaps = []
    with gf.Recorder(path, model=model, sources=["a"], weights_every=2) as rec:
        for i in range(5):
            snaps.append(model.fc2.weight.detach().clone().numpy())
            model(torch.randn(8, 6)).pow(2).mean().backward()
            rec.record(step=i, source="a")
            opt.step()
            opt.zero_grad()
    store = gf.open_store(path)
    np.testing.assert_array_equal(store.weight_records(), [0, 2, 4])
    np.testing.assert_array_equal(store.weight("fc2.weight").compute(), np.stack([snaps[0], snaps[2], snaps[4]]))
    assert set(store.weights) == {"fc1.weight", "fc2.weight", "head.weight"}   # default: 2-D weights


def test_hooks_removed_on_exit_and_store_readable_after_an_exception(tmp_path):
    torch.manual_seed(0)
    model = TinyMLP()
    path = tmp_path / "crash.h5"
    with pytest.raises(RuntimeError, match="boom"), \
            gf.Recorder(path, model=model, sources=["a"], activations=["act", "relu"]) as rec:
        assert rec.n_hooks == 2 and len(model.act._forward_hooks) == 1
        for i in range(3):
            model(torch.randn(4, 6)).sum().backward()
            rec.record(step=i, source="a")
            model.zero_grad()
        raise RuntimeError("boom")
    assert rec.n_hooks == 0
    assert not model.act._forward_hooks and not model.relu._forward_hooks
    assert not model._forward_pre_hooks                 # the batch-size counter (n_samples) goes too
    store = gf.open_store(path)
    assert store.n_records == 3 and set(store.act_modules) == {"act", "relu"}
    assert store.batches()["n_samples"].tolist() == [4, 4, 4]


def test_sketch_mode_stores_per_head_sketches_only(tmp_path):
    model = make("gpt2")
    path = tmp_path / "sk.zarr"
    backward(model, batch(5))
    g = grads_of(model)
    with gf.Recorder(path, model=model, sources=["a"], sketch={"k": 64, "seed": 3}) as rec:
        rec.record(source="a")
    store = gf.open_store(path)
    assert not store.grads and store.sketches
    sk = Sketcher(k=64, seed=3)
    name = "transformer.h.1.attn.c_attn.weight"
    blocks, _, _ = expected_heads("gpt2", "c_attn", g[name])
    got = store.sketch(name).compute()
    assert got.shape == (1, 3 * H, 64)
    np.testing.assert_allclose(got[0], np.stack([sk.project(b) for b in blocks]), rtol=1e-5, atol=1e-7)
    whole = "transformer.h.0.mlp.c_fc.weight"
    np.testing.assert_allclose(store.sketch(whole)[0].compute(), sk.project(g[whole]), rtol=1e-5, atol=1e-7)


def test_bfloat16_model_is_stored_losslessly(tmp_path):
    model = make("llama").to(torch.bfloat16)
    path = tmp_path / "bf.zarr"
    backward(model, batch(7))
    want = {n: p.grad.float().numpy() for n, p in model.named_parameters() if p.ndim == 2}
    with gf.Recorder(path, model=model, sources=["a"], heads=None, weights_every=1) as rec:
        rec.record(source="a")
    store = gf.open_store(path)
    name = "model.layers.1.self_attn.k_proj.weight"
    info = store.grads[name]
    assert info.encoding == "bfloat16-as-uint16" and info.attrs["source_dtype"] == "bfloat16"
    assert store.meta.model["dtype"] == "bfloat16"
    for n, w in want.items():
        np.testing.assert_array_equal(store.grad(n)[0].compute(), w)
    w = model.get_parameter(name).detach().float().numpy()
    np.testing.assert_array_equal(store.weight(name)[0].compute(), w)
    raw = store.read(f"grads/{name}")
    np.testing.assert_array_equal(decode_bf16(raw[0]), want[name])


def test_param_without_grad_is_recorded_as_zeros_with_one_warning(tmp_path):
    torch.manual_seed(0)
    model = TinyMLP()
    model.unused = nn.Linear(3, 3)
    path = tmp_path / "z.zarr"
    with gf.Recorder(path, model=model, sources=["a"]) as rec:
        for _ in range(2):
            model(torch.randn(4, 6)).sum().backward()
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                rec.record(source="a")
            model.zero_grad()
            if rec.n_records == 1:
                assert len(w) == 1 and "unused.weight" in str(w[0].message)
            else:
                assert not w
    store = gf.open_store(path)
    assert np.all(store.grad("unused.weight").compute() == 0)
    assert np.any(store.grad("fc1.weight").compute() != 0)


def test_model_info_and_mode(tmp_path):
    model = make("llama")
    with gf.Recorder(tmp_path / "m.zarr", model=model, sources=["a"], tensors=["lm_head.weight"]) as rec:
        backward(model, batch(0))
        rec.record(source="a")
    meta = gf.open_store(tmp_path / "m.zarr").meta
    assert meta.model["class"] == "LlamaForCausalLM"
    assert meta.model["n_params"] == sum(p.numel() for p in model.parameters())
    assert meta.model["config"]["num_key_value_heads"] == KV and meta.model["config"]["model_type"] == "llama"


# ------------------------------------------------------------------ errors
def test_glob_matching_nothing_is_named(tmp_path):
    model = TinyMLP()
    with pytest.raises(SpecError, match=r"tensors: glob '\*.q_proj.weight' matches no parameter"):
        gf.Recorder(tmp_path / "e.zarr", model=model, sources=["a"], tensors=["*.q_proj.weight"])
    with pytest.raises(SpecError, match=r"activations: glob '\*.act_fn' matches no module"):
        gf.Recorder(tmp_path / "e.zarr", model=model, sources=["a"], activations=["*.act_fn"])
    with pytest.raises(SpecError, match=r"heads: glob '\*.qkv' matches none"):
        gf.Recorder(tmp_path / "e.zarr", model=model, sources=["a"], heads={"*.qkv": 2})


class MyAttention(nn.Module):
    def __init__(self, heads: int | None = None) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.proj = nn.Linear(16, 16)
        if heads:
            self.num_heads = heads


class Block(nn.Module):
    def __init__(self, heads: int | None = None) -> None:
        super().__init__()
        self.attn = MyAttention(heads)

    def forward(self, x):
        q, k, v = self.attn.qkv(x).chunk(3, dim=-1)
        return self.attn.proj(q * k + v)


def test_auto_cannot_decide_names_the_tensor_and_the_spec(tmp_path):
    with pytest.raises(SpecError, match=r"cannot split attn\.qkv\.weight \(Linear\).*heads=\{'\*\.qkv\.weight': \{'heads': H"):
        gf.Recorder(tmp_path / "e.zarr", model=Block(), sources=["a"])


def test_explicit_spec_combines_with_auto(tmp_path):
    model = Block(heads=4)          # module attribute num_heads: auto splits attn.qkv (fused q|k|v)
    with gf.Recorder(tmp_path / "a.zarr", model=model, sources=["a"]) as rec:
        assert rec.head_specs["attn.qkv.weight"].fused == 3
    model = Block()
    spec = {"auto": True, "attn.qkv.weight": {"heads": 2, "fused": 3, "role": "qkv"}, "attn.proj.weight": None}
    path = tmp_path / "b.zarr"
    with gf.Recorder(path, model=model, sources=["a"], heads=spec) as rec:
        model(torch.randn(5, 16)).sum().backward()
        rec.record(source="a")
    store = gf.open_store(path)
    g = model.attn.qkv.weight.grad.numpy()
    got = store.grad("attn.qkv.weight")[0].compute()
    np.testing.assert_array_equal(got, np.stack([g[j * 8:(j + 1) * 8] for j in range(6)]))
    assert store.grads["attn.proj.weight"].heads is None


def test_multihead_attention_is_split_automatically(tmp_path):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=True)
    x = torch.randn(2, 5, 16)
    path = tmp_path / "mha.zarr"
    with gf.Recorder(path, model=mha, sources=["a"], tensors=["in_proj_weight", "out_proj.weight"]) as rec:
        mha(x, x, x)[0].sum().backward()
        rec.record(source="a")
    store = gf.open_store(path)
    w = mha.in_proj_weight.grad.numpy()
    np.testing.assert_array_equal(store.grad("in_proj_weight")[0].compute(),
                                  np.stack([w[j * 4:(j + 1) * 4] for j in range(12)]))
    o = mha.out_proj.weight.grad.numpy()
    np.testing.assert_array_equal(store.grad("out_proj.weight")[0].compute(),
                                  np.stack([o[:, h * 4:(h + 1) * 4] for h in range(4)]))


def test_llama_without_config_cannot_be_split_automatically(tmp_path):
    model = make("llama")
    for layer in model.model.layers:    # strip every source of head counts
        del layer.self_attn.config
        del layer.self_attn.head_dim
    del model.config
    with pytest.raises(SpecError, match=r"cannot split model\.layers\.0\.self_attn\.q_proj\.weight.*no num_attention_heads"):
        gf.Recorder(tmp_path / "e.zarr", model=model, sources=["a"])


# ------------------------------------------------------- asynchronous copy
class FakeEvent:
    def __init__(self) -> None:
        self.waited = 0

    def synchronize(self) -> None:
        self.waited += 1


def test_device_path_reuses_buffers_without_corrupting_records(tmp_path, monkeypatch):
    # Exercise the CUDA code path on the CPU: gradients "on the device" are copied
    # into a pool of two reused host buffer sets; the writer must wait on each
    # record's event and copy the buffers out before handing them back.
    events = []

    def fake_copy(grads, bufs):
        for n, g in grads.items():
            bufs[n].copy_(g)
        events.append(FakeEvent())
        return [events[-1]]

    monkeypatch.setattr(hostcopy, "is_device", lambda t: True)
    monkeypatch.setattr(hostcopy, "copy_async", fake_copy)
    torch.manual_seed(0)
    model = TinyMLP()
    path = tmp_path / "dev.zarr"
    seen = []
    with gf.Recorder(path, model=model, sources=["a"], queue_size=1) as rec:
        for i in range(6):
            model(torch.randn(4, 6) * (i + 1)).sum().backward()
            seen.append(model.fc1.weight.grad.clone().numpy())
            rec.record(source="a")
            model.zero_grad()
    assert rec._copies.pool is not None and rec._copies.pool.qsize() == hostcopy.N_BUFFER_SETS
    assert [e.waited for e in events] == [1] * 6
    np.testing.assert_array_equal(gf.open_store(path).grad("fc1.weight").compute(), np.stack(seen))


def test_extra_arrays_recorded_next_to_the_model(tmp_path):
    torch.manual_seed(0)
    model = TinyMLP()
    path = tmp_path / "x.zarr"
    with gf.Recorder(path, model=model, sources=["a"], tensors=["fc1.weight"]) as rec:
        model(torch.randn(4, 6)).sum().backward()
        rec.record(source="a", grads={"extra.g": np.arange(6, dtype=np.float32)})
        with pytest.raises(SpecError, match=r"grads\['fc1.weight'\] is already recorded"):
            rec.record(source="a", grads={"fc1.weight": np.zeros((16, 6), np.float32)})
    np.testing.assert_array_equal(gf.open_store(path).grad("extra.g")[0].compute(), np.arange(6))


def test_example_script_runs(tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "examples" / "instrument_training_loop.py"
    spec = importlib.util.spec_from_file_location("gf_example_loop", src)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    path = mod.main(["--out", str(tmp_path), "--steps", "4"])
    store = gf.open_store(path)
    assert store.n_records == 4 and store.grads["model.layers.0.self_attn.k_proj.weight"].heads == 2
    np.testing.assert_array_equal(store.weight_records(), [0])
    assert "4 records" in capsys.readouterr().out
