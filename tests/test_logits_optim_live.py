"""Output-logit statistics and live optimizer summaries on a real nanoGPT-style model (issue 39, items 4-5)."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import gradforensics as gf  # noqa: E402
from gradforensics.errors import SpecError  # noqa: E402
from gradforensics.recording.logits import logit_modules  # noqa: E402
from gradforensics.recording.optimlive import STALE  # noqa: E402
from gradforensics.replay.optimstate import RatioHistogram, map_state, optim_data, read_optimizer_state  # noqa: E402
from gradforensics.store.reader import open_store  # noqa: E402

nn = torch.nn
F = torch.nn.functional
V, D, H, T = 64, 32, 4, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.c_attn = nn.Linear(D, 3 * D)       # fused q|k|v
        self.c_proj = nn.Linear(D, D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.c_attn(self.ln1(x)).split(D, dim=2)
        q, k, v = (z.view(b, t, H, D // H).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, D)
        x = x + self.c_proj(y)
        return x + self.mlp(self.ln2(x))


class NanoGPT(nn.Module):
    def __init__(self, vocab: int = V) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, D), nn.Embedding(T, D)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.ln_f = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, vocab, bias=False)
        self.lm_head.weight = self.wte.weight        # tied embeddings

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.ln_f(x))


def batches(n: int, seed: int = 0, vocab: int = V) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (4, T + 1), generator=g) for _ in range(n)]


def step(model: nn.Module, xy: torch.Tensor) -> torch.Tensor:
    logits = model(xy[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), xy[:, 1:].reshape(-1))
    loss.backward()
    return loss


def test_auto_finds_the_tied_head_and_refuses_in_one_line() -> None:
    torch.manual_seed(0)
    assert list(logit_modules(NanoGPT(), "auto")) == ["lm_head"]
    with pytest.raises(SpecError, match=r"pass logits='<module name>'"):
        logit_modules(nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2)), "auto")
    with pytest.raises(SpecError, match="matches no module"):
        logit_modules(NanoGPT(), "nope*")


def test_logit_stats_and_row_norm_ratio_equal_torch(tmp_path) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = NanoGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    want: list[dict[str, float]] = []
    with gf.Recorder(tmp_path / "r.zarr", model=model, sources=["a"], logits="auto", weights_every=2,
                     sketch=8, heads=None) as rec:
        for i, xy in enumerate(batches(5)):
            micro = [xy[:2], xy[2:]]             # two micro-batches per record
            lz, lg = [], []
            for mb in micro:
                logits = model(mb[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, V), mb[:, 1:].reshape(-1))
                loss.backward()
                out = logits.detach().double()
                lz.append(torch.logsumexp(out, -1).ravel())
                lg.append(out.ravel())
            z, g = torch.cat(lz), torch.cat(lg)
            norms = model.lm_head.weight.detach().double().norm(dim=1).numpy()
            want.append({"logz_mean": float(z.mean()), "logz_max": float(z.max()), "logit_max": float(g.max()),
                         "logit_mean": float(g.mean()),
                         "row_norm_ratio": float(norms.mean() / np.median(norms)) if i % 2 == 0 else math.nan})
            rec.record(step=i, loss=loss, source="a")
            opt.step()
            opt.zero_grad()
    s = open_store(tmp_path / "r.zarr")
    for k in want[0]:
        got = s.read(f"logits/lm_head/{k}")
        assert got.dtype == np.float32 and got.shape == (5,)
        np.testing.assert_allclose(got, [w[k] for w in want], rtol=1e-5, atol=1e-5, err_msg=k)
