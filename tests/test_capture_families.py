"""Issue 39 "done when": ``heads``, ``attention``, ``activations``, ``logits`` and ``optimizer`` together on each
model family, a few AdamW steps each, in one Recorder.

Families (real small torch models, defined here): nanoGPT-style (SDPA, fused q|k|v ``nn.Linear``, tied
embeddings) with and without a qk-LayerNorm; a CNN with BatchNorm; a GRU LM; a Mamba-like LM without attention;
HF LLaMA with GQA and HF GPT-2 (tiny configs, eager attention).  Per family the store is read back and checked:
per-head split shapes where there are heads, ``attn/<module>`` where there is attention (a one-line refusal
naming the model class where there is none), activation units on the module kind's axis, logits arrays for the
LMs, ``optim_live`` arrays.  One oracle per family, computed here in torch: ``logz_mean`` against
``torch.logsumexp`` of the logits the step produced (rtol 1e-5), the CNN's dead-channel count against a
count of all-zero ReLU channels (exact), the live ``update_rms`` of one tensor against ``opt.state`` (rtol 1e-6).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import gradforensics as gf  # noqa: E402
from gradforensics.errors import SpecError  # noqa: E402

torch.set_num_threads(1)
V, T, B, STEPS = 64, 16, 4, 4


# ------------------------------------------------------------------ models
class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, h: int, qk_norm: bool) -> None:
        super().__init__()
        self.n_head, self.n_embd = h, d
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)      # fused q|k|v
        self.q_norm = nn.LayerNorm(d // h) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(d // h) if qk_norm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2)
                   for z in self.c_attn(x).split(d, dim=2))
        y = F.scaled_dot_product_attention(self.q_norm(q), self.k_norm(k), v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d: int, h: int, qk_norm: bool) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, h, qk_norm)
        self.c_fc, self.act, self.mlp_proj = nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp_proj(self.act(self.c_fc(self.ln_2(x))))


class NanoGPT(nn.Module):
    def __init__(self, d: int = 32, h: int = 4, layers: int = 2, qk_norm: bool = False, t: int = T) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, d), nn.Embedding(t, d)
        self.blocks = nn.ModuleList([Block(d, h, qk_norm) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, V, bias=False)
        self.lm_head.weight = self.wte.weight        # tied embeddings

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.ln_f(x))


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1, self.act1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()
        self.conv2, self.bn2, self.act2 = nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU()
        self.pool, self.head = nn.AdaptiveAvgPool2d(1), nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act1(self.bn1(self.conv1(x)))
        x = self.act2(self.bn2(self.conv2(x)))
        return self.head(self.pool(x).flatten(1))


class GRULM(nn.Module):
    def __init__(self, hidden: int = 24) -> None:
        super().__init__()
        self.emb, self.rnn = nn.Embedding(V, hidden), nn.GRU(hidden, hidden, batch_first=True)
        self.act, self.out = nn.Tanh(), nn.Linear(hidden, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.emb(ids))
        return self.out(self.act(h))


class MambaBlock(nn.Module):
    """A selective-scan block (Gu & Dao 2023, simplified): in_proj, causal depthwise conv, scan, out_proj."""

    def __init__(self, d: int, expand: int = 2, state: int = 4) -> None:
        super().__init__()
        e = expand * d
        self.in_proj = nn.Linear(d, 2 * e)
        self.conv1d = nn.Conv1d(e, e, 4, groups=e, padding=3)
        self.act = nn.SiLU()
        self.x_proj = nn.Linear(e, 1 + 2 * state)
        self.A_log = nn.Parameter(torch.zeros(e, state))
        self.out_proj = nn.Linear(e, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        u, z = self.in_proj(x).chunk(2, dim=-1)
        u = self.act(self.conv1d(u.transpose(1, 2))[..., :t]).transpose(1, 2)
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
    def __init__(self, d: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.embedding = nn.Embedding(V, d)
        self.layers = nn.ModuleList([MambaBlock(d) for _ in range(layers)])
        self.lm_head = nn.Linear(d, V, bias=False)
        self.lm_head.weight = self.embedding.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embedding(idx)
        for layer in self.layers:
            x = x + layer(x)
        return self.lm_head(x)


# ------------------------------------------------------------------ one run
def lm_loss(out: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def train(tmp_path, model: nn.Module, batches: list[torch.Tensor], loss_fn: Callable, **kw):
    """STEPS AdamW steps, one record each; returns the store, the optimizer and each step's logits (float64)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    outs, state = [], {}
    with gf.Recorder(tmp_path / "f.zarr", model=model, sources=["s"], heads="auto", optimizer=opt,
                     optimizer_every=2, **kw) as rec:
        for i, x in enumerate(batches):
            out = model(x)
            loss = loss_fn(out, x)
            loss.backward()
            logits = out.logits if hasattr(out, "logits") else out
            outs.append(logits.detach().double())
            if i == 2:          # on the optimizer grid: the live summary of step 2's state
                state = {n: (p, {k: v.clone() for k, v in opt.state[p].items()})
                         for n, p in model.named_parameters() if p in opt.state}
            rec.record(step=i, loss=loss, source="s")
            opt.step()
            opt.zero_grad()
    return gf.open_store(tmp_path / "f.zarr"), opt, outs, state


def tokens(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (B, T), generator=g) for _ in range(STEPS)]


def check_logits(store, module: str, outs: list[torch.Tensor]) -> None:
    got = store.read(f"logits/{module}/logz_mean")
    want = [float(torch.logsumexp(o, -1).mean()) for o in outs]
    assert got.shape == (STEPS,)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def check_optim(store, opt, state, name: str) -> None:
    summ = store.read("optim_live/summary")
    attrs = store.arrays["optim_live/summary"].attrs
    assert summ.shape == (STEPS, len(attrs["tensors"]), len(attrs["fields"]))
    assert np.isnan(summ[1]).all() and np.isnan(summ[3]).all()          # off the optimizer_every=2 grid
    _, st = state[name]
    g = opt.param_groups[0]
    (b1, b2), eps, lr, t = g["betas"], g["eps"], g["lr"], float(st["step"])
    m = st["exp_avg"].double() / (1 - b1 ** t)
    sv = (st["exp_avg_sq"].double() / (1 - b2 ** t)).sqrt()
    want = lr * (m / (sv + eps)).pow(2).mean().sqrt().item()
    got = summ[2, attrs["tensors"].index(name), attrs["fields"].index("update_rms")]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def refused_attention(path, model: nn.Module, x: torch.Tensor) -> None:
    """attention="auto" on a model without attention: one line naming its class, at the first record."""
    want = rf"attention='auto': {type(model).__name__} ran no scaled_dot_product_attention call"
    with pytest.raises(SpecError, match=want) as err, \
            gf.Recorder(path, model=model, sources=["s"], attention="auto") as rec:
        model(x).float().mean().backward()
        rec.record(step=0, loss=0.0, source="s")
    assert "\n" not in str(err.value)
    model.zero_grad()


def check_acts(store, module: str, axis: int, units: int) -> None:
    a = store.act_attrs(module)
    assert (a["unit_axis"], a["units"]) == (axis, units), a
    assert store.act(module, "dead").shape == (STEPS, units)


# ------------------------------------------------------------------ families
@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qknorm"])
def test_nanogpt_sdpa(tmp_path, qk_norm: bool) -> None:
    torch.manual_seed(0)
    model = NanoGPT(qk_norm=qk_norm)
    store, opt, outs, state = train(tmp_path, model, tokens(), lm_loss, attention="auto",
                                    activations=["blocks.*.act"], logits="auto")
    assert store.grad("blocks.0.attn.c_attn.weight").shape == (STEPS, 12, 8, 32)      # q|k|v x 4 heads, d = 8
    assert store.grad("blocks.0.attn.c_proj.weight").shape == (STEPS, 4, 32, 8)       # heads on the input axis
    assert store.attn_modules == ["blocks.0.attn", "blocks.1.attn"]
    for stat in ("max_logit", "entropy_mean", "entropy_min", "onehot_frac"):
        got = store.attn("blocks.1.attn", stat)
        assert got.shape == (STEPS, 4) and np.isfinite(got).all(), stat
    check_acts(store, "blocks.0.act", 2, 128)
    check_logits(store, "lm_head", outs)
    check_optim(store, opt, state, "blocks.0.attn.c_attn.weight")


def test_cnn_batchnorm(tmp_path) -> None:
    torch.manual_seed(0)
    model = CNN()
    with torch.no_grad():
        model.bn2.bias[:5] = -1e3              # 5 of 16 channels never pass the ReLU
    seen: list[torch.Tensor] = []
    model.act2.register_forward_hook(lambda m, a, o: seen.append(o.detach()))
    g = torch.Generator().manual_seed(0)
    imgs = [torch.randn(B, 3, 8, 8, generator=g) for _ in range(STEPS)]
    labels = torch.arange(B) % 10
    refused_attention(tmp_path / "x.zarr", model, imgs[0])
    seen.clear()
    with pytest.raises(SpecError, match="logits='auto': CNN has no output embedding"):
        gf.Recorder(tmp_path / "y.zarr", model=model, sources=["s"], logits="auto")
    store, opt, _, state = train(tmp_path, model, imgs, lambda out, x: F.cross_entropy(out, labels),
                                 activations=["act1", "act2"])
    check_acts(store, "act1", 1, 8)
    check_acts(store, "act2", 1, 16)
    want = [int((o == 0).all(dim=(0, 2, 3)).sum()) for o in seen]
    assert want == [5] * STEPS
    assert store.act("act2", "dead").sum(axis=1).tolist() == want
    assert store.grad("head.weight").shape[1:] == (10, 16)            # whole: no heads in a CNN
    assert store.attn_modules == [] and not any(k.startswith("logits/") for k in store.arrays)
    check_optim(store, opt, state, "conv2.weight")


def test_gru_lm(tmp_path) -> None:
    torch.manual_seed(0)
    model = GRULM()
    refused_attention(tmp_path / "x.zarr", model, tokens()[0])
    store, opt, outs, state = train(tmp_path, model, tokens(1), lm_loss, activations=["rnn", "act"], logits="auto")
    check_acts(store, "rnn", 2, 24)          # the hidden axis of the output tuple's first element
    check_acts(store, "act", 2, 24)
    assert store.grad("rnn.weight_hh_l0").shape[1:] == (72, 24)       # whole
    check_logits(store, "out", outs)
    check_optim(store, opt, state, "rnn.weight_ih_l0")


def test_mamba_like_without_attention(tmp_path) -> None:
    torch.manual_seed(0)
    model = MambaLM()
    refused_attention(tmp_path / "x.zarr", model, tokens()[0])
    with pytest.warns(RuntimeWarning, match=r"pass unit_axes=\{'layers.0.act': 1\}"), \
            gf.Recorder(tmp_path / "w.zarr", model=model, sources=["s"], activations=["layers.0.act"]) as rec:
        model(tokens()[0]).sum().backward()     # SiLU of a sliced Conv1d output: (N, C, L) or (N, T, D)?
        rec.record(step=0, loss=0.0, source="s")
    model.zero_grad()
    store, opt, outs, state = train(tmp_path, model, tokens(2), lm_loss, activations=["layers.*.act"],
                                    unit_axes={"layers.*.act": 1}, logits="auto")
    assert store.grad("layers.0.in_proj.weight").shape[1:] == (128, 32)     # whole: no heads
    check_acts(store, "layers.0.act", 1, 64)        # SiLU after the depthwise Conv1d: channels, as told
    check_logits(store, "lm_head", outs)
    check_optim(store, opt, state, "layers.0.in_proj.weight")


@pytest.mark.slow
def test_hf_llama_gqa(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                   num_hidden_layers=2, intermediate_size=96, vocab_size=V,
                                   max_position_embeddings=T, attn_implementation="eager")
    model = transformers.LlamaForCausalLM(cfg)
    store, opt, outs, state = train(tmp_path, model, tokens(3), lm_loss, attention="auto",
                                    activations=["model.layers.*.mlp.act_fn"], logits="auto")
    pre = "model.layers.0.self_attn."
    assert store.grad(pre + "q_proj.weight").shape[1:] == (4, 16, 64)
    assert store.grad(pre + "k_proj.weight").shape[1:] == (2, 16, 64)      # GQA: the KV heads
    assert store.grad(pre + "o_proj.weight").shape[1:] == (4, 64, 16)
    assert store.attn_modules == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert store.attn("model.layers.0.self_attn", "entropy_mean").shape == (STEPS, 4)
    check_acts(store, "model.layers.0.mlp.act_fn", 2, 96)
    check_logits(store, "lm_head", outs)
    check_optim(store, opt, state, pre + "k_proj.weight")


@pytest.mark.slow
def test_hf_gpt2(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=64, n_head=4, n_layer=2, vocab_size=V, n_positions=T, bos_token_id=0,
                                  eos_token_id=0, attn_implementation="eager")
    model = transformers.GPT2LMHeadModel(cfg)
    store, opt, outs, state = train(tmp_path, model, tokens(4), lm_loss, attention="auto",
                                    activations=["transformer.h.*.mlp.act"], logits="auto")
    assert store.grad("transformer.h.0.attn.c_attn.weight").shape[1:] == (12, 64, 16)   # Conv1D (in, 3D): heads on columns
    assert store.attn_modules == ["transformer.h.0.attn", "transformer.h.1.attn"]
    assert store.attn("transformer.h.1.attn", "max_logit").shape == (STEPS, 4)
    check_acts(store, "transformer.h.0.mlp.act", 2, 256)
    check_logits(store, "lm_head", outs)
    check_optim(store, opt, state, "transformer.h.0.attn.c_attn.weight")
