"""Attention statistics of any model through scaled_dot_product_attention: a nanoGPT-style model, oracles from an
explicit softmax(q kᵀ·scale + mask) per head, gradient checkpointing, the Hugging Face entry left alone."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import gradforensics as gf  # noqa: E402
from gradforensics.errors import SpecError  # noqa: E402
from gradforensics.recording.sdpa import open_taps  # noqa: E402
from gradforensics.store.reader import open_store  # noqa: E402

TOL = 1e-5
V, D, H, T = 48, 32, 4, 12


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention: one fused q|k|v nn.Linear, SDPA; optional GQA, qk-layernorm, explicit masks."""

    def __init__(self, kv_heads: int = H, qk_norm: bool = False, mask: str = "causal") -> None:
        super().__init__()
        self.kv, self.hd, self.mask = kv_heads, D // H, mask
        self.c_attn = nn.Linear(D, D + 2 * kv_heads * (D // H))
        self.c_proj = nn.Linear(D, D)
        self.q_norm = nn.LayerNorm(self.hd) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(self.hd) if qk_norm else nn.Identity()
        self.seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.c_attn(x).split([D, self.kv * self.hd, self.kv * self.hd], dim=2)
        q = self.q_norm(q.view(b, t, H, self.hd)).transpose(1, 2)
        k = self.k_norm(k.view(b, t, self.kv, self.hd)).transpose(1, 2)
        v = v.view(b, t, self.kv, self.hd).transpose(1, 2)
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        if self.mask == "causal":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv != H)
            allowed, bias = causal.expand(b, 1, t, t), torch.zeros(b, 1, t, t, dtype=torch.float64)
        elif self.mask == "bool":           # causal and right padding of the second row: (B, 1, T, T) booleans
            keep = torch.ones(b, t, dtype=torch.bool)
            keep[1, t - 4:] = False
            allowed = causal & keep[:, None, None, :]
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=0.3, enable_gqa=self.kv != H)
            bias = torch.zeros(b, 1, t, t, dtype=torch.float64)
        else:                               # additive: an ALiBi-like bias per head, -inf on the future (1, H, T, T)
            slopes = torch.tensor([0.5 ** (i + 1) for i in range(H)])
            dist = (torch.arange(t)[None, :] - torch.arange(t)[:, None]).float()
            add = (slopes[:, None, None] * dist).masked_fill(~causal, float("-inf"))[None]
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=add, enable_gqa=self.kv != H)
            allowed, bias = causal.expand(1, H, t, t), torch.where(causal, add, 0.0).double()
        if self.seen is not None:
            scale = 0.3 if self.mask == "bool" else 1 / math.sqrt(self.hd)
            self.seen.append((q.detach().double() * scale, k.detach().double(), allowed, bias))
        return self.c_proj(y.transpose(1, 2).reshape(b, t, D))


class Block(nn.Module):
    def __init__(self, **kw: object) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(D), CausalSelfAttention(**kw)  # type: ignore[arg-type]
        self.ln_2, self.mlp = nn.LayerNorm(D), nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT-style: token + position embeddings, blocks, final LayerNorm, lm_head tied to wte."""

    def __init__(self, n_layer: int = 2, checkpoint: str | None = None, **kw: object) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, D), nn.Embedding(T, D)
        self.blocks = nn.ModuleList(Block(**kw) for _ in range(n_layer))
        self.ln_f, self.lm_head = nn.LayerNorm(D), nn.Linear(D, V, bias=False)
        self.lm_head.weight = self.wte.weight
        self.checkpoint = checkpoint

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        for blk in self.blocks:
            if self.checkpoint is None:
                x = blk(x)
            else:
                x = torch.utils.checkpoint.checkpoint(blk, x, use_reentrant=self.checkpoint == "reentrant")
        return self.lm_head(self.ln_f(x))


def make(seed: int = 0, **kw: object) -> GPT:
    torch.manual_seed(seed)
    return GPT(**kw)  # type: ignore[arg-type]


def batches(n: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (3, T), generator=g) for _ in range(n)]


def step(model: GPT, ids: torch.Tensor, opt: torch.optim.Optimizer | None = None) -> torch.Tensor:
    logits = model(ids)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))
    loss.backward()
    if opt is not None:
        opt.step()
    return loss


def oracle(seen: list[tuple[torch.Tensor, ...]]) -> dict[str, np.ndarray]:
    """Per head, over every call of the record: explicit p = softmax(q kᵀ·scale + bias) on the allowed keys."""
    maxes, ents, onehots = [], [], []
    for q, k, allowed, bias in seen:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        s = (q @ k.transpose(-1, -2) + bias).masked_fill(~allowed, float("-inf"))
        p = torch.softmax(s, dim=-1)
        n = allowed.expand_as(s).sum(-1)
        ent = -torch.where(p > 0, p * torch.log(p), 0.0).sum(-1) / torch.log(n.clamp(min=2).double())
        choice = n >= 2
        maxes.append([s[:, h][choice[:, h]].max().item() for h in range(H)])
        ents.append([ent[:, h][choice[:, h]] for h in range(H)])
        onehots.append([p[:, h].amax(-1)[choice[:, h]] for h in range(H)])
    ent_h = [torch.cat([e[h] for e in ents]) for h in range(H)]
    one_h = [torch.cat([o[h] for o in onehots]) for h in range(H)]
    return {"max_logit": np.max(maxes, axis=0),
            "entropy_mean": np.array([float(e.mean()) for e in ent_h]),
            "entropy_min": np.array([float(e.min()) for e in ent_h]),
            "onehot_frac": np.array([float((o > 0.99).double().mean()) for o in one_h])}


def sharpen(model: GPT) -> None:
    """Layer 1 very sharp (one head; every head through the q LayerNorm), so that the one-hot share is not zero."""
    attn = model.blocks[1].attn
    with torch.no_grad():
        if isinstance(attn.q_norm, nn.LayerNorm):
            attn.q_norm.weight *= 30
        else:
            attn.c_attn.weight[:D // H] *= 30


CASES = {"causal": {}, "bool": {"mask": "bool"}, "additive": {"mask": "additive"}, "gqa": {"kv_heads": 2},
         "gqa_bool_qknorm": {"kv_heads": 1, "mask": "bool", "qk_norm": True}, "qknorm": {"qk_norm": True}}


@pytest.mark.parametrize("case", sorted(CASES))
def test_recorded_stats_equal_an_explicit_softmax_over_a_few_training_steps(tmp_path, case) -> None:
    model = make(**CASES[case])
    sharpen(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    want = []
    with gf.Recorder(tmp_path / "s.zarr", model=model, sources=["a"], attention="auto", sketch=8, heads=None) as rec:
        for i, ids in enumerate(batches(3)):
            for blk in model.blocks:
                blk.attn.seen = []
            loss = step(model, ids)
            want.append({f"blocks.{j}.attn": oracle(b.attn.seen) for j, b in enumerate(model.blocks)})
            rec.record(step=i, loss=loss, source="a")
            opt.step()
            opt.zero_grad()
    store = open_store(tmp_path / "s.zarr")
    assert store.attn_modules == ["blocks.0.attn", "blocks.1.attn"]
    for i, per in enumerate(want):
        for name, stats in per.items():
            for stat, v in stats.items():
                np.testing.assert_allclose(store.attn(name, stat)[i], v, atol=TOL, rtol=TOL, err_msg=f"{name} {stat}")
    assert np.nanmax(store.attn("blocks.1.attn", "onehot_frac")) > 0    # the sharp head is seen


def test_query_blocks_and_micro_batches_combine_to_the_whole() -> None:
    model = make(kv_heads=2, mask="bool")
    sharpen(model)
    ids = batches(2)
    for blk in model.blocks:
        blk.attn.seen = []
    taps = open_taps(model, ["blocks.*.attn"], block=5)        # 12 queries in blocks of 5, 5, 2
    try:
        for x in ids:                                           # two micro-batches in one record
            model(x)
        got = taps.take()
    finally:
        taps.remove()
    for j, blk in enumerate(model.blocks):
        for stat, v in oracle(blk.attn.seen).items():
            np.testing.assert_allclose(got[f"blocks.{j}.attn"][stat], v, atol=TOL, rtol=TOL)


def test_globs_attribute_calls_to_the_innermost_selected_module(tmp_path) -> None:
    model, ids = make(), batches(1)[0]
    got = {}
    for spec in ("auto", ["blocks.1"], ["blocks.1", "blocks.1.attn"]):
        taps = open_taps(model, spec)
        try:
            model(ids)
            if spec == ["blocks.1", "blocks.1.attn"]:   # blocks.1's only call is its attn's: blocks.1 has none
                with pytest.raises(SpecError, match=r"module blocks\.1 made no scaled_dot_product_attention call"):
                    taps.take()
            else:
                got[str(spec)] = taps.take()
        finally:
            taps.remove()
    assert set(got["auto"]) == {"blocks.0.attn", "blocks.1.attn"} and set(got["['blocks.1']"]) == {"blocks.1"}
    for stat, v in got["auto"]["blocks.1.attn"].items():
        np.testing.assert_array_equal(got["['blocks.1']"]["blocks.1"][stat], v)
    with pytest.raises(SpecError, match=r"glob 'nope\.\*' matches no module of GPT"):
        gf.Recorder(tmp_path / "s.zarr", model=model, sources=["a"], attention=["nope.*"], heads=None)
    assert not (tmp_path / "s.zarr").exists()


@pytest.mark.parametrize("how", ["reentrant", "non_reentrant"])
def test_gradient_checkpointing_recompute_is_not_counted_twice(how) -> None:
    plain, ckpt = make(), make(checkpoint=how)
    ids = batches(1)[0]
    out = {}
    for key, model in (("plain", plain), ("ckpt", ckpt)):
        taps = open_taps(model, "auto")
        try:
            model.train()
            model.blocks[0].attn.seen = []
            step(model, ids)                                     # forward, then backward (recompute under ckpt)
            assert len(model.blocks[0].attn.seen) == (2 if key == "ckpt" else 1)   # the recompute did call SDPA
            name = "blocks.0.attn"
            out[key] = taps.sdpa.taps[name].part["n"].clone(), taps.take()   # type: ignore[union-attr]
        finally:
            taps.remove()
    assert out["ckpt"][0].tolist() == [3 * (T - 1)] * H == out["plain"][0].tolist()
    for stat, v in out["plain"][1]["blocks.0.attn"].items():
        np.testing.assert_allclose(out["ckpt"][1]["blocks.0.attn"][stat], v, atol=1e-6)
    for p, q in zip(plain.parameters(), ckpt.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)               # the tap changes nothing in the training


def test_two_recorders_on_two_models_do_not_clash_and_one_model_takes_one(tmp_path) -> None:
    a, b = make(0), make(5, kv_heads=2)
    ids = batches(1)[0]
    alone = {}
    for key, model in (("a", a), ("b", b)):
        taps = open_taps(model, "auto")
        model(ids)
        alone[key] = taps.take()
        taps.remove()
    with gf.Recorder(tmp_path / "a.zarr", model=a, sources=["s"], attention="auto", sketch=4, heads=None) as ra, \
            gf.Recorder(tmp_path / "b.zarr", model=b, sources=["s"], attention="auto", sketch=4, heads=None) as rb:
        with pytest.raises(SpecError, match="GPT is already recorded by another open recorder"):
            gf.Recorder(tmp_path / "c.zarr", model=a, sources=["s"], attention="auto", heads=None)
        step(a, ids)
        step(b, ids)
        ra.record(step=0, source="s")
        rb.record(step=0, source="s")
    for key in ("a", "b"):
        store = open_store(tmp_path / f"{key}.zarr")
        for name, stats in alone[key].items():
            for stat, v in stats.items():
                np.testing.assert_allclose(store.attn(name, stat)[0], v, atol=1e-6)
    taps = open_taps(a, "auto")      # released at close
    taps.remove()


def test_the_tap_leaves_outputs_unchanged_and_runs_only_in_the_recorded_forward() -> None:
    model = make(kv_heads=2, mask="additive")
    ids = batches(1)[0]
    with torch.no_grad():
        want = model(ids)
    taps = open_taps(model, "auto")
    try:
        with torch.no_grad():
            torch.testing.assert_close(model(ids), want, rtol=0, atol=0)
        taps.take()
        q = torch.randn(1, H, 4, D // H)
        F.scaled_dot_product_attention(q, q, q)                    # outside the recorded forward: not seen
        with torch.no_grad():
            model.blocks[0](model.wte(ids))                        # a sub-module called alone: not seen
        with pytest.raises(SpecError, match="made no scaled_dot_product_attention call"):
            taps.take()
    finally:
        taps.remove()


@pytest.mark.slow
def test_hf_eager_entry_is_untouched_and_two_hf_recorders_do_not_clash(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama import modeling_llama

    from gradforensics.recording.attention import IMPLEMENTATION

    def theirs() -> tuple[dict, object, object]:
        """transformers' own entries (all but ours), its "eager" entry (None where eager is no entry), LLaMA's eager."""
        entries = {k: v for k, v in ALL_ATTENTION_FUNCTIONS.items() if k != IMPLEMENTATION}
        return entries, transformers.AttentionInterface().get("eager"), modeling_llama.eager_attention_forward

    def llama(seed: int) -> transformers.LlamaForCausalLM:
        torch.manual_seed(seed)
        cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager")
        return transformers.LlamaForCausalLM(cfg)

    before = theirs()
    a, b = llama(0), llama(1)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    alone = {}
    for key, model in (("a", a), ("b", b)):
        taps = open_taps(model, "auto")
        with torch.no_grad():
            model(input_ids=ids)
        alone[key] = taps.take()
        taps.remove()
    during = []
    hook = a.model.layers[0].register_forward_hook(
        lambda m, i, o: during.append(theirs()))
    with gf.Recorder(tmp_path / "a.zarr", model=a, sources=["s"], attention="auto", sketch=4, heads=None) as ra, \
            gf.Recorder(tmp_path / "b.zarr", model=b, sources=["s"], attention="auto", sketch=4, heads=None) as rb:
        for model in (a, b):
            model(input_ids=ids, labels=ids).loss.backward()
        ra.record(step=0, source="s")
        rb.record(step=0, source="s")
    hook.remove()
    assert during == [before] and theirs() == before
    assert transformers.AttentionInterface().get(IMPLEMENTATION) is not None    # ours, registered beside them
    for key in ("a", "b"):
        store = open_store(tmp_path / f"{key}.zarr")
        for name, stats in alone[key].items():
            for stat, v in stats.items():
                np.testing.assert_allclose(store.attn(name, stat)[0], v, atol=1e-6)


@pytest.mark.slow
def test_hf_gradient_checkpointing_is_not_counted_twice() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager")
    model = transformers.LlamaForCausalLM(cfg).train()
    model.gradient_checkpointing_enable()
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    taps = open_taps(model, "auto")
    try:
        model(input_ids=ids, labels=ids).loss.backward()
        assert taps.hf is not None
        assert taps.hf.taps["model.layers.0.self_attn"].part["n"].tolist() == [2 * 8] * 4   # type: ignore[index]
    finally:
        taps.remove()


def test_replay_of_a_non_hf_model_records_sdpa_attention(tmp_path) -> None:
    """The replay behind ``capture --attention`` uses the same recorder: an SDPA model is tapped there too."""
    from gradforensics.replay import replay

    model = make(kv_heads=2, qk_norm=True)
    sharpen(model)
    for blk in model.blocks:
        blk.attn.seen = []

    def loss_fn(m: GPT, ids: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(m(ids)[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))

    store = replay(model, {"a": batches(2), "b": batches(2, seed=7)}, loss_fn, tmp_path / "r.zarr", n_per_source=2,
                   progress=False, attention="auto", heads=None, sketch=8)
    assert store.attn_modules == ["blocks.0.attn", "blocks.1.attn"]
    for j, blk in enumerate(model.blocks):
        assert len(blk.attn.seen) == 4                     # one forward per record, in record order
        for i, call in enumerate(blk.attn.seen):
            for stat, v in oracle([call]).items():
                np.testing.assert_allclose(store.attn(f"blocks.{j}.attn", stat)[i], v, atol=TOL, rtol=TOL)
