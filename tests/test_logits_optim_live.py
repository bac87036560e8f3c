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
    assert list(logit_modules(NanoGPT(), "auto")) == ["lm_head"]          # tied: the same Parameter as wte
    untied = NanoGPT()
    untied.lm_head.weight = nn.Parameter(untied.wte.weight.detach().clone())
    assert list(logit_modules(untied, "auto")) == ["lm_head"]            # untied: shaped like wte
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
        for i, xy in enumerate(batches(3)):
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
        assert got.dtype == np.float32 and got.shape == (3,)
        np.testing.assert_allclose(got, [w[k] for w in want], rtol=1e-5, atol=1e-5, err_msg=k)


def _direct(opt: torch.optim.Optimizer, p: torch.Tensor) -> dict[str, float]:
    """The per-tensor fields straight from ``opt.state`` (AdamW, one param group)."""
    g = opt.param_groups[0]
    (b1, b2), eps, lr = g["betas"], g["eps"], g["lr"]
    st = opt.state[p]
    t = float(st["step"])
    m = st["exp_avg"].double() / (1 - b1 ** t)
    sv = (st["exp_avg_sq"].double() / (1 - b2 ** t)).sqrt()
    upd = lr * (m / (sv + eps)).pow(2).mean().sqrt().item()
    w = p.detach().double().pow(2).mean().sqrt().item()
    return {"update_rms": upd, "weight_rms": w, "update_ratio": upd / w, "eps_share": (sv < eps).double().mean().item(),
            "m_norm": st["exp_avg"].double().norm().item(), "sqrt_v_norm": sv.norm().item(), "step": t,
            "numel": float(p.numel())}


def _ratio(g: torch.Tensor, v_hat: torch.Tensor) -> np.ndarray:
    g2, v = g.double().pow(2).numpy(), v_hat.double().numpy()
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(g2 == 0, 0.0, g2 / v)


def _rows_oracle(g: torch.Tensor, v_hat: torch.Tensor) -> np.ndarray:
    r = _ratio(g, v_hat)
    return np.concatenate([np.quantile(r, [0.5, 0.9, 0.99], axis=1).T, r.max(axis=1)[:, None]], axis=1)


def test_live_optimizer_summaries_equal_opt_state_and_capture(tmp_path) -> None:
    from gradforensics.replay.probe import CheckpointProbe, CurvatureSpec

    torch.manual_seed(1)
    torch.set_num_threads(1)
    model = NanoGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    names = [n for n, _ in model.named_parameters()]
    params = dict(model.named_parameters())
    n_rec = 4
    with gf.Recorder(tmp_path / "r.zarr", model=model, sources=["a"], optimizer=opt, optimizer_every=2,
                     sketch=8, heads=None) as rec:
        for i, xy in enumerate(batches(n_rec)):
            loss = step(model, xy)
            if i == n_rec - 2:      # a record on the grid, after steps: check it against opt.state and capture
                want = {n: _direct(opt, params[n]) for n in names}
                b2 = opt.param_groups[0]["betas"][1]
                rows_want = {n: _rows_oracle(params[n].grad, opt.state[params[n]]["exp_avg_sq"]
                                             / (1 - b2 ** float(opt.state[params[n]]["step"])))
                             for n in names if params[n].ndim == 2}
                ratio_full = {n: _ratio(params[n].grad, opt.state[params[n]]["exp_avg_sq"]
                                        / (1 - b2 ** float(opt.state[params[n]]["step"]))).ravel() for n in names}
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "ckpt.pt")
                probe = CheckpointProbe.from_checkpoint(tmp_path / "ckpt.pt", model, CurvatureSpec())
                probe.observe(model, "a", xy)      # capture's g²/v̂ on the replayed batch: the same gradient
                captured = probe.optim(model)
            rec.record(step=i, loss=loss, source="a")
            opt.step()
            opt.zero_grad()
    s = open_store(tmp_path / "r.zarr")
    summ = s.read("optim_live/summary")
    attrs = s.arrays["optim_live/summary"].attrs
    assert summ.shape == (n_rec, len(names), len(attrs["fields"])) and attrs["tensors"] == names
    assert np.isnan(summ[0]).all() and np.isnan(summ[1]).all() and np.isnan(summ[3]).all()   # no state yet / off grid
    got = summ[n_rec - 2]
    for ti, n in enumerate(names):
        for f, v in want[n].items():
            np.testing.assert_allclose(got[ti, attrs["fields"].index(f)], v, rtol=1e-6, err_msg=f"{n} {f}")
    assert captured is not None and captured.tensors == names and captured.fields == attrs["fields"]
    np.testing.assert_array_equal(got, captured.summary)       # capture's summary of the same state, bit for bit
    for n, q in rows_want.items():
        rr = s.read(f"optim_live/{n}/row_ratio")
        assert rr.shape == (n_rec, params[n].shape[0], 4) and np.isnan(rr[1]).all()
        np.testing.assert_allclose(rr[n_rec - 2], q, rtol=1e-5, err_msg=n)   # float32 ratios and sorts
    for ti, n in enumerate(names):      # the summary's binned quantiles (1/8 decade, upper edge) hold the exact ones
        exact = np.clip(np.quantile(ratio_full[n], [0.5, 0.9, 0.99], method="inverted_cdf"), 1e-12, 1e12)
        binned = got[ti, [attrs["fields"].index(f"ratio_q{q}") for q in (50, 90, 99)]]
        assert np.all(exact <= binned * (1 + 1e-9)) and np.all(exact >= binned / 10 ** 0.125 * (1 - 1e-9)), n


def test_rows_first_seen_late_are_stale(tmp_path) -> None:
    torch.manual_seed(2)
    torch.set_num_threads(1)
    model = NanoGPT()
    model.lm_head.weight = nn.Parameter(model.wte.weight.detach().clone())      # untied: wte sees only inputs
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    early = [xy % 48 for xy in batches(6, seed=3)]          # tokens 48..63 never seen in the first steps
    late = batches(1, seed=4)[0]
    with gf.Recorder(tmp_path / "r.zarr", model=model, sources=["a"], optimizer=opt, optimizer_every=1,
                     sketch=8, heads=None) as rec:
        for i, xy in enumerate([*early, late]):
            loss = step(model, xy)
            rec.record(step=i, loss=loss, source="a")
            opt.step()
            opt.zero_grad()
    s = open_store(tmp_path / "r.zarr")
    stale = s.read("optim_live/wte.weight/stale")
    seen_late = sorted({int(t) for t in late[:, :-1].ravel() if t >= 48})
    assert seen_late and np.flatnonzero(stale[-1]).tolist() == seen_late
    assert int(stale[-1].sum()) == len(seen_late)
    seen: set[int] = set()
    for i, xy in enumerate([*early, late]):      # stale exactly where a row's first gradient arrives (after step 1)
        now = {int(t) for t in xy[:, :-1].ravel()}
        assert np.flatnonzero(stale[i]).tolist() == (sorted(now - seen) if i else []), i
        seen |= now
    rr = s.read("optim_live/wte.weight/row_ratio")[-1]
    assert np.isinf(rr[seen_late, 3]).all() and np.isfinite(rr[:48, 3]).all()
    # the per-tensor median hides them: what the run showed
    summ = s.read("optim_live/summary")[-1]
    fields = s.arrays["optim_live/summary"].attrs["fields"]
    tensors = s.arrays["optim_live/summary"].attrs["tensors"]
    assert summ[tensors.index("wte.weight"), fields.index("ratio_q50")] < STALE


def test_bad_optimizer_is_one_line(tmp_path) -> None:
    model = NanoGPT()
    with pytest.raises(SpecError, match="not Adam-family"):
        gf.Recorder(tmp_path / "a.zarr", model=model, sources=["a"], heads=None,
                    optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(SpecError, match="optimizer_every must be a positive int"):
        gf.Recorder(tmp_path / "b.zarr", model=model, sources=["a"], heads=None,
                    optimizer=torch.optim.AdamW(model.parameters()), optimizer_every=0)
    with pytest.raises(SpecError, match="not the recorded model's"):
        gf.Recorder(tmp_path / "c.zarr", model=model, sources=["a"], heads=None,
                    optimizer=torch.optim.AdamW(NanoGPT().parameters()))


def test_logits_and_optim_live_arrays_are_checked_at_open(tmp_path) -> None:
    zarr = pytest.importorskip("zarr")
    from gradforensics.errors import CorruptStoreError

    torch.manual_seed(0)
    model = NanoGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    path = tmp_path / "r.zarr"
    with gf.Recorder(path, model=model, sources=["a"], logits="lm_head", optimizer=opt, sketch=8, heads=None) as rec:
        for i, xy in enumerate(batches(2)):
            rec.record(step=i, loss=step(model, xy), source="a")
            opt.step()
            opt.zero_grad()
    s = open_store(path)
    assert s.read("optim_live/summary").shape[:2] == (2, len(list(model.parameters())))
    root = zarr.open_group(path, mode="r+")
    for bad, shape, dtype, match in (("logits/lm_head/bogus", (2,), "float32", "logits/<module>/<stat>"),
                                     ("logits/x/logz_max", (2, 3), "float32", r"float32 of shape \(N,\)"),
                                     ("optim_live/wte.weight/stale", (2, 4), "float32", "uint8"),
                                     ("optim_live/x/row_ratio", (2, 4, 3), "float32", r"\(N, R, 4\)")):
        if bad in root:
            del root[bad]
        root.create_array(bad, shape=shape, dtype=dtype)
        with pytest.raises(CorruptStoreError, match=match):
            open_store(path)
        del root[bad]
    root["optim_live/summary"].attrs["tensors"] = ["only.one"]
    with pytest.raises(CorruptStoreError, match="optim_live/summary"):
        open_store(path)


def test_rows_back_after_a_long_absence_are_stale_with_a_finite_ratio(tmp_path) -> None:
    """The issue's case: rows seen once, then absent while v decays (β₂ = 0.8, 70 steps: g²/v̂ ≈ 0.8–3.7e5 on those rows, ≤ 5 on the rest), then back."""
    torch.manual_seed(5)
    torch.set_num_threads(1)
    model = NanoGPT()
    model.lm_head.weight = nn.Parameter(model.wte.weight.detach().clone())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.8))
    first = batches(1, seed=6)[0]
    middle = [xy % 48 for xy in batches(69, seed=7)]
    last = first.clone()                       # the same tokens again: every row >= 48 was seen at step 0
    n = 71
    with gf.Recorder(tmp_path / "r.zarr", model=model, sources=["a"], optimizer=opt, optimizer_every=n - 1,
                     sketch=8, heads=None) as rec:
        for i, xy in enumerate([first, *middle, last]):
            rec.record(step=i, loss=step(model, xy), source="a")
            opt.step()
            opt.zero_grad()
    s = open_store(tmp_path / "r.zarr")
    stale = s.read("optim_live/wte.weight/stale")[-1]
    back = sorted({int(t) for t in last[:, :-1].ravel() if t >= 48})
    assert back and np.flatnonzero(stale).tolist() == back
    mx = s.read("optim_live/wte.weight/row_ratio")[-1][back, 3]
    assert np.isfinite(mx).all() and (mx > STALE).all()      # v decayed by 0.8^70, not zero: a finite, huge g²/v̂
