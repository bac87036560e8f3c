"""Heads by module type, on real small torch models (issue 39, item 2; item 6's no-attention default).

Oracle: the stored per-head gradient equals the slice of the full gradient that
the model uses for that head, computed here in torch (exact: a split is a copy).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import gradforensics as gf  # noqa: E402
from gradforensics.errors import HeadSplitError, SpecError  # noqa: E402
from gradforensics.recording.autoheads import check_split, resolve_heads  # noqa: E402
from gradforensics.recording.heads import parse_cli_heads  # noqa: E402
from gradforensics.store.heads import HeadSpec  # noqa: E402

torch.set_num_threads(1)
V, T = 64, 8


# ------------------------------------------------------------------ models
class CausalSelfAttention(nn.Module):
    """nanoGPT: fused q|k|v nn.Linear (D, (H + 2 KV) d), SDPA, output projection c_proj."""

    def __init__(self, d_model: int, n_head: int, n_kv_head: int | None = None) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.n_embd = n_head, n_kv_head or n_head, d_model
        d = d_model // n_head
        self.c_attn = nn.Linear(d_model, (n_head + 2 * self.n_kv_head) * d)
        self.c_proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        b, t, dm = x.shape
        h, kv, d = self.n_head, self.n_kv_head, dm // self.n_head
        q, k, v = self.c_attn(x).split([h * d, kv * d, kv * d], dim=-1)
        q = q.view(b, t, h, d).transpose(1, 2)
        k = k.view(b, t, kv, d).transpose(1, 2).repeat_interleave(h // kv, 1)
        v = v.view(b, t, kv, d).transpose(1, 2).repeat_interleave(h // kv, 1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, dm))


class MLP(nn.Module):
    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(d_model, 4 * d_model), nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int, n_kv_head: int | None) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn, self.mlp = CausalSelfAttention(d_model, n_head, n_kv_head), MLP(d_model)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """Tied embeddings, two blocks."""

    def __init__(self, d_model: int = 192, n_head: int = 4, n_kv_head: int | None = None, layers: int = 2) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, d_model), nn.Embedding(T, d_model)
        self.h = nn.ModuleList([Block(d_model, n_head, n_kv_head) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, V, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.h:
            x = b(x)
        return self.lm_head(self.ln_f(x))


class MambaBlock(nn.Module):
    """A selective-scan block (Gu & Dao 2023, simplified): in_proj, causal depthwise conv, scan, out_proj."""

    def __init__(self, d_model: int, expand: int = 2, state: int = 4) -> None:
        super().__init__()
        e = expand * d_model
        self.in_proj = nn.Linear(d_model, 2 * e)
        self.conv1d = nn.Conv1d(e, e, 4, groups=e, padding=3)
        self.x_proj = nn.Linear(e, 1 + 2 * state)
        self.A_log = nn.Parameter(torch.zeros(e, state))
        self.out_proj = nn.Linear(e, d_model)

    def forward(self, x):
        t = x.shape[1]
        u, z = self.in_proj(x).chunk(2, dim=-1)
        u = F.silu(self.conv1d(u.transpose(1, 2))[..., :t].transpose(1, 2))
        n = self.A_log.shape[1]
        dt, bm, cm = self.x_proj(u).split([1, n, n], dim=-1)
        a = -torch.exp(self.A_log)
        h = torch.zeros(x.shape[0], u.shape[-1], n)
        ys = []
        for i in range(t):
            h = torch.exp(F.softplus(dt[:, i, :, None]) * a) * h + u[:, i, :, None] * bm[:, i, None, :]
            ys.append((h * cm[:, i, None, :]).sum(-1))
        return self.out_proj(torch.stack(ys, 1) * F.silu(z))


class MambaLM(nn.Module):
    def __init__(self, d_model: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.embedding = nn.Embedding(V, d_model)
        self.layers = nn.ModuleList([MambaBlock(d_model) for _ in range(layers)])
        self.lm_head = nn.Linear(d_model, V)

    def forward(self, idx):
        x = self.embedding(idx)
        for layer in self.layers:
            x = x + layer(x)
        return self.lm_head(x)


def _step(model, seed: int = 0):
    torch.manual_seed(seed)
    idx = torch.randint(0, V, (2, T))
    logits = model(idx) if not hasattr(model, "config") else model(idx).logits
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, V), idx[:, 1:].reshape(-1))
    model.zero_grad()
    loss.backward()
    return loss


def _record(tmp_path, model, **kw):
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "s.zarr"
    with gf.Recorder(path, model=model, sources=["a"], **kw) as rec:
        loss = _step(model)
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        rec.record(source="a", loss=float(loss.detach()))
    return gf.open_store(path), grads


def _heads_of_rows(g, parts, d):
    """Oracle: head blocks of a (out, in) gradient whose rows are runs of d rows per head, in *parts* order."""
    return [g[i * d:(i + 1) * d] for i in range(sum(parts))]


# ------------------------------------------------------------------ nanoGPT, the case
def test_nanogpt_fused_linear_d192_4_heads_splits_rows_and_c_proj_columns(tmp_path):
    torch.manual_seed(0)
    model = NanoGPT(192, 4, layers=1)
    store, grads = _record(tmp_path, model)
    d = 48
    name = "h.0.attn.c_attn.weight"
    info = store.grads[name]
    assert store.grad(name).shape == (1, 12, d, 192)                    # not (1, 12, 576, 16)
    assert (info.attrs["heads"], info.attrs["role"], info.attrs["split_axis"]) == (12, "qkv", 0)
    assert info.attrs["head_labels"] == [f"{r}{h}" for r in "qkv" for h in range(4)]
    got = store.grad(name)[0].compute()
    want = np.stack([b.numpy() for b in _heads_of_rows(grads[name], [4, 4, 4], d)])
    np.testing.assert_array_equal(got, want)
    # the output projection: split on its INPUT axis (columns of Linear (out, in))
    o = "h.0.attn.c_proj.weight"
    assert (store.grads[o].attrs["role"], store.grads[o].attrs["split_axis"]) == ("o", 1)
    got = store.grad(o)[0].compute()
    assert got.shape == (4, 192, d)
    np.testing.assert_array_equal(got, np.stack([grads[o][:, h * d:(h + 1) * d].numpy() for h in range(4)]))
    # the MLP's c_proj is not attention: whole
    assert store.grads["h.0.mlp.c_proj.weight"].heads is None
    assert store.grad("h.0.mlp.c_proj.weight").shape == (1, 192, 768)


def test_nanogpt_gqa_fused_widths_split_into_roles_with_their_own_counts(tmp_path):
    torch.manual_seed(1)
    model = NanoGPT(64, 4, n_kv_head=2)            # c_attn: (4 + 2*2) * 16 = 128 rows
    store, grads = _record(tmp_path, model)
    name = "h.1.attn.c_attn.weight"
    a = store.grads[name].attrs
    assert a["heads"] == 8 and a["parts"] == "q4k2v2" and a["role"] == "qkv"
    assert a["head_labels"] == ["q0", "q1", "q2", "q3", "k0", "k1", "v0", "v1"]
    got = store.grad(name)[0].compute()
    np.testing.assert_array_equal(got, np.stack([b.numpy() for b in _heads_of_rows(grads[name], [4, 2, 2], 16)]))
    spec = HeadSpec.from_attrs(a)
    assert spec is not None and spec.labels() == a["head_labels"]
    # the bias splits like the rows
    b = "h.1.attn.c_attn.bias"
    store_b, grads_b = _record(tmp_path / "b", model, tensors=["*.c_attn.*"])
    np.testing.assert_array_equal(store_b.grad(b)[0].compute(), grads_b[b].reshape(8, 16).numpy())


def test_a_query_head_is_what_the_model_computes_for_that_head():
    """The probe check: q of head h from the split weight = the module's output slice (fp32, 1e-5 relative)."""
    torch.manual_seed(2)
    attn = NanoGPT(192, 4).h[0].attn
    spec = resolve_heads(attn, {"c_attn.weight": (576, 192)}, "auto")["c_attn.weight"]
    x = torch.randn(5, 192)
    with torch.no_grad():
        out = attn.c_attn(x)
        blocks = torch.as_tensor(spec.split(attn.c_attn.weight.numpy()))
        bias = torch.as_tensor(spec.split(attn.c_attn.bias.numpy()))
        for h, lab in enumerate(spec.labels()):
            q_h = x @ blocks[h].T + bias[h]
            part = "qkv".index(lab[0])
            sl = out[:, part * 192 + int(lab[1:]) * 48: part * 192 + (int(lab[1:]) + 1) * 48]
            assert float((q_h - sl).abs().max() / sl.abs().max()) < 1e-5
    # the wrong axis (what heads='auto' did before) is refused by the check, naming the axis
    wrong = HeadSpec(4, 1, "qkv", fused=3)
    problem = check_split("c_attn.weight", attn.c_attn, wrong)
    assert problem is not None and "output axis, which is axis 0" in problem


# ------------------------------------------------------------------ Hugging Face GPT-2 (Conv1D) and LLaMA (GQA)
@pytest.mark.slow
def test_hf_gpt2_conv1d_splits_columns_and_c_proj_rows(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(3)
    cfg = transformers.GPT2Config(n_embd=64, n_head=4, n_layer=2, vocab_size=V, n_positions=T,
                                  bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    store, grads = _record(tmp_path, model, tensors=["*.attn.*"])
    name = "transformer.h.0.attn.c_attn.weight"          # Conv1D (in, 3 D)
    assert store.grads[name].attrs["split_axis"] == 1 and store.grad(name).shape == (1, 12, 64, 16)
    g = grads[name]
    np.testing.assert_array_equal(store.grad(name)[0].compute(),
                                  np.stack([g[:, j * 16:(j + 1) * 16].numpy() for j in range(12)]))
    o = "transformer.h.1.attn.c_proj.weight"               # Conv1D (D, out): heads on the input rows
    assert (store.grads[o].attrs["split_axis"], store.grads[o].attrs["role"]) == (0, "o")
    np.testing.assert_array_equal(store.grad(o)[0].compute(),
                                  np.stack([grads[o][h * 16:(h + 1) * 16].numpy() for h in range(4)]))


@pytest.mark.slow
def test_hf_llama_gqa_q_k_v_o(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(4)
    cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
                                   intermediate_size=96, vocab_size=V, max_position_embeddings=T)
    model = transformers.LlamaForCausalLM(cfg).eval()
    store, grads = _record(tmp_path, model, tensors=["*.self_attn.*"])
    pre = "model.layers.0.self_attn."
    for leaf, heads, axis in (("q_proj", 4, 0), ("k_proj", 2, 0), ("v_proj", 2, 0), ("o_proj", 4, 1)):
        name = pre + leaf + ".weight"
        a = store.grads[name].attrs
        assert (a["heads"], a["split_axis"], a["role"]) == (heads, axis, leaf[0]), name
        g = grads[name]
        want = [g.narrow(axis, h * 16, 16).numpy() for h in range(heads)]
        np.testing.assert_array_equal(store.grad(name)[0].compute(), np.stack(want))


# ------------------------------------------------------------------ no attention: stored whole, no refusal
def test_mamba_like_model_captures_by_default_whole_tensors(tmp_path):
    torch.manual_seed(5)
    model = MambaLM()
    store, grads = _record(tmp_path, model)           # heads="auto", every 2-D weight
    for name in ("layers.0.in_proj.weight", "layers.1.out_proj.weight", "layers.0.x_proj.weight"):
        assert store.grads[name].heads is None
        np.testing.assert_array_equal(store.grad(name)[0].compute(), grads[name].numpy())
    assert resolve_heads(model, {n: tuple(p.shape) for n, p in model.named_parameters()}, "auto") == {}


# ------------------------------------------------------------------ explicit specs: checked too, one-line refusals
def test_explicit_wrong_axis_is_refused_with_the_fix_in_python_and_cli_form():
    torch.manual_seed(6)
    model = NanoGPT(192, 4, layers=1)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if p.ndim == 2}
    bad = {"*.c_attn.weight": {"heads": 4, "axis": 1, "fused": "qkv"}, "auto": True}
    with pytest.raises(HeadSplitError) as err:
        resolve_heads(model, shapes, bad)
    msg, cli = str(err.value), err.value.cli
    assert "\n" not in msg and "(Linear)" in msg and "axis 0" in msg
    assert "heads={'*.c_attn.weight': {'heads': 4, 'axis': 0, 'fused': 'qkv'}, 'auto': True}" in msg   # the user's glob
    assert "--heads auto '*.c_attn.weight=4:axis=0,fused=qkv'" in cli and "heads={" not in cli
    # the CLI form, parsed back, is accepted and gives the right split
    fixed = parse_cli_heads(["auto", "*.attn.c_attn.weight=4:axis=0,fused=qkv", "*.attn.c_proj.weight=none"])
    specs = resolve_heads(model, shapes, fixed)
    assert specs["h.0.attn.c_attn.weight"] == HeadSpec(4, 0, "qkv", fused=3)
    assert "h.0.attn.c_proj.weight" not in specs
    # an output projection split on its output axis is refused too
    with pytest.raises(HeadSplitError, match=r"role o splits the input axis, which is axis 1"):
        resolve_heads(model, shapes, {"*.attn.c_proj.weight": {"heads": 4, "axis": 0, "role": "o"}})


def test_cli_syntax_and_json_file(tmp_path):
    got = parse_cli_heads(["*.c_attn.weight=4:fused=q4k2v2", "*.o.weight=4:axis=1,role=o", "auto"])
    assert got == {"*.c_attn.weight": {"heads": 4, "fused": "q4k2v2"},
                   "*.o.weight": {"heads": 4, "axis": 1, "role": "o"}, "auto": True}
    f = tmp_path / "heads.json"
    f.write_text(json.dumps({"*.c_attn.weight": {"heads": 4, "fused": {"q": 4, "k": 2, "v": 2}}, "auto": True}))
    assert parse_cli_heads([str(f)])["*.c_attn.weight"]["fused"] == {"q": 4, "k": 2, "v": 2}
    for bad, want in ((["x=4:axs=1"], "unknown option 'axs=1'"), (["x=4:fused=qq"], "fused 'qq'"),
                      (["x=4:role=z"], "role must be one of"), ([str(tmp_path / "no.json")], "cannot read it")):
        with pytest.raises(SpecError, match=want) as err:
            parse_cli_heads(bad)
        assert "\n" not in str(err.value)


def test_gqa_width_that_contradicts_the_counts_is_refused():
    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.n_head, self.n_kv_head, self.n_embd = 4, 2, 64
            self.c_attn = nn.Linear(64, 192)        # 3 D: not (4 + 2*2) * 16 = 128
            self.c_proj = nn.Linear(64, 64)

    with pytest.raises(HeadSplitError, match=r"output width 192 is not \(H \+ 2 KV\) d = \(4 \+ 2\*2\)\*16"):
        resolve_heads(Attn(), {"c_attn.weight": (192, 64)}, "auto")


class XW(nn.Module):
    """A projection of its own type whose weight is (in, out), used as x @ W (like Conv1D, not nn.Linear)."""

    def __init__(self, n_in: int, n_out: int, squash: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) / n_in ** 0.5)
        self.squash = squash

    def forward(self, x):
        y = x @ self.weight
        return torch.tanh(y) if self.squash else y


class OwnAttention(nn.Module):
    def __init__(self, squash: bool = False) -> None:
        super().__init__()
        self.num_heads, self.hidden_size = 4, 32
        self.q_proj, self.o_proj = XW(32, 32, squash), XW(32, 32)

    def forward(self, x):
        return self.o_proj(self.q_proj(x))


def test_a_module_of_its_own_type_is_split_on_the_axis_the_probe_shows(tmp_path):
    torch.manual_seed(7)
    model = OwnAttention()
    path = tmp_path / "own.zarr"
    with gf.Recorder(path, model=model, sources=["a"]) as rec:
        model(torch.randn(3, 32)).pow(2).sum().backward()
        rec.record(source="a")
    store = gf.open_store(path)
    assert store.grads["q_proj.weight"].attrs["split_axis"] == 1          # its output axis: x @ W
    assert store.grads["o_proj.weight"].attrs["split_axis"] == 0          # its input axis
    gq, go = model.q_proj.weight.grad, model.o_proj.weight.grad
    np.testing.assert_array_equal(store.grad("q_proj.weight")[0].compute(),
                                  np.stack([gq[:, h * 8:(h + 1) * 8].numpy() for h in range(4)]))
    np.testing.assert_array_equal(store.grad("o_proj.weight")[0].compute(),
                                  np.stack([go[h * 8:(h + 1) * 8].numpy() for h in range(4)]))


def test_a_module_no_probe_can_read_is_refused_by_auto_and_taken_explicitly():
    model = OwnAttention(squash=True)                 # tanh(x @ W): neither x @ W.T nor x @ W
    with pytest.raises(HeadSplitError, match=r"cannot split q_proj\.weight \(XW\): .*probe") as err:
        resolve_heads(model, {"q_proj.weight": (32, 32)}, "auto")
    assert "--heads auto 'q_proj.weight=H:axis=A,role=R'" in err.value.cli
    specs = resolve_heads(model, {"q_proj.weight": (32, 32)}, {"q_proj.weight": {"heads": 4, "axis": 1, "role": "q"}})
    assert specs["q_proj.weight"] == HeadSpec(4, 1, "q")
