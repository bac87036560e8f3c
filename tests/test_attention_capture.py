"""Per-head attention statistics at capture: oracles from eager weights and from q, k with RoPE; store; refusals."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import gradforensics as gf  # noqa: E402
from gradforensics.errors import AttentionUnavailableError, CorruptStoreError, SpecError  # noqa: E402
from gradforensics.recording.attention import AttentionTaps, attention_modules  # noqa: E402
from gradforensics.store.reader import open_store  # noqa: E402

TOL = 1e-5


def tiny_llama(impl: str = "eager", seed: int = 0) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, attn_implementation=impl)
    return transformers.LlamaForCausalLM(cfg).eval()


def oracle_from_weights(w: torch.Tensor, allowed: torch.Tensor) -> dict[str, np.ndarray]:
    """Mean/min normalised entropy and one-hot share per head, straight from eager weights (B, H, Q, K)."""
    w = w.double()
    allowed = allowed.expand_as(w)
    n = allowed.sum(-1)
    choice = n >= 2
    plogp = torch.where(allowed & (w > 0), w * torch.log(w.clamp_min(1e-300)), 0.0)
    ent = -plogp.sum(-1) / torch.log(n.clamp(min=2).double())
    out = {"entropy_mean": [], "entropy_min": [], "onehot_frac": []}
    for h in range(w.shape[1]):
        e, c = ent[:, h][choice[:, h]], choice[:, h]
        out["entropy_mean"].append(float(e.mean()))
        out["entropy_min"].append(float(e.min()))
        out["onehot_frac"].append(float(((w[:, h].amax(-1) > 0.99) & c).sum() / c.sum()))
    return {k: np.array(v) for k, v in out.items()}


def llama_logits_by_hand(model: transformers.LlamaForCausalLM, layer: int, ids: torch.Tensor) -> torch.Tensor:
    """q·k/√d of one layer, from the q_proj/k_proj outputs with RoPE applied here (B, H, Q, K)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    attn = model.model.layers[layer].self_attn
    seen: dict[str, torch.Tensor] = {}
    hooks = [attn.q_proj.register_forward_hook(lambda m, a, o: seen.__setitem__("q", o)),
             attn.k_proj.register_forward_hook(lambda m, a, o: seen.__setitem__("k", o))]
    with torch.no_grad():
        model(input_ids=ids)
        pos = torch.arange(ids.shape[1])[None]
        cos, sin = model.model.rotary_emb(seen["q"], pos)
    for h in hooks:
        h.remove()
    b, t, d = ids.shape[0], ids.shape[1], attn.head_dim
    q = seen["q"].view(b, t, -1, d).transpose(1, 2).double()
    k = seen["k"].view(b, t, -1, d).transpose(1, 2).double()
    q, k = apply_rotary_pos_emb(q, k, cos.double(), sin.double())
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return q @ k.transpose(-1, -2) / math.sqrt(d)


def run_tapped(model: torch.nn.Module, **inputs: torch.Tensor) -> tuple[dict, object]:
    taps = AttentionTaps(model, attention_modules(model, "auto"))
    try:
        with torch.no_grad():
            out = model(**inputs, output_attentions=True)
        return taps.take(), out
    finally:
        taps.remove()


@pytest.mark.slow
def test_llama_gqa_stats_equal_eager_weights_and_rope_logits() -> None:
    model = tiny_llama()
    with torch.no_grad():      # one sharp head, so that the one-hot share is not trivially zero
        model.model.layers[0].self_attn.q_proj.weight[:8] *= 60.0
        model.model.layers[0].self_attn.k_proj.weight[:8] *= 60.0
    ids = torch.randint(0, 64, (3, 12), generator=torch.Generator().manual_seed(1))
    stats, out = run_tapped(model, input_ids=ids)
    causal = torch.tril(torch.ones(12, 12, dtype=torch.bool))[None, None]
    for layer in (0, 1):
        got = stats[f"model.layers.{layer}.self_attn"]
        want = oracle_from_weights(out.attentions[layer], causal)
        for k, v in want.items():
            np.testing.assert_allclose(got[k], v, atol=TOL, err_msg=f"layer {layer} {k}")
        s = llama_logits_by_hand(model, layer, ids)
        s = s.masked_fill(~causal, -math.inf)[:, :, 1:]        # queries with a choice (not position 0)
        np.testing.assert_allclose(got["max_logit"], s.amax(dim=(0, 2, 3)).numpy(), atol=TOL, rtol=TOL)
    assert stats["model.layers.0.self_attn"]["onehot_frac"][0] > 0.2      # the sharpened head
    assert stats["model.layers.0.self_attn"]["max_logit"][0] > 5 * stats["model.layers.0.self_attn"]["max_logit"][3]


def test_padding_mask_excludes_padded_keys_and_queries() -> None:
    model = tiny_llama()
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0                                     # left padding
    stats, out = run_tapped(model, input_ids=ids, attention_mask=mask)
    allowed = torch.tril(torch.ones(10, 10, dtype=torch.bool))[None, None] & mask.bool()[:, None, None, :]
    want = oracle_from_weights(out.attentions[1], allowed)
    for k, v in want.items():
        np.testing.assert_allclose(stats["model.layers.1.self_attn"][k], v, atol=TOL)


def test_taps_leave_the_output_unchanged_and_give_the_model_its_attention_back() -> None:
    from gradforensics.recording.attention import IMPLEMENTATION

    model = tiny_llama()
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    stats, out = run_tapped(model, input_ids=ids)
    # the tapped run computes the model's own eager attention: same operations, same output
    assert torch.equal(out.logits, ref)
    assert set(stats) == {"model.layers.0.self_attn", "model.layers.1.self_attn"}
    # transformers' own entries are untouched: gradforensics adds its own name, "eager" stays unregistered
    assert "eager" not in transformers.AttentionInterface() and IMPLEMENTATION in transformers.AttentionInterface()
    # closed: the model runs eager again (an SDPA model would be refused below), and taps anew alike
    again, _ = run_tapped(model, input_ids=ids)
    for name, v in stats.items():
        for k in v:
            np.testing.assert_array_equal(again[name][k], v[k])
    taps = AttentionTaps(model, attention_modules(model, "auto"))
    with pytest.raises(SpecError, match="already recorded"):
        AttentionTaps(model, attention_modules(model, "auto"))
    taps.remove()
    taps.remove()                                  # idempotent


def test_head_stats_equal_a_direct_torch_computation() -> None:
    """max logit and normalised entropy of masked softmax attention, from random logits and a random mask.

    The oracle is float64 softmax; the statistics run in float32, so rtol 1e-5 (float32's rounding over
    a few dozen keys) with atol 1e-6 for entropies near 0.
    """
    from gradforensics.recording.attention import finish, head_stats

    g = torch.Generator().manual_seed(4)
    s = torch.randn(3, 5, 7, 11, generator=g) * torch.tensor([0.1, 1.0, 3.0, 10.0, 40.0])[None, :, None, None]
    allowed = torch.rand(3, 1, 7, 11, generator=g) > 0.3
    allowed[0, 0, 0] = False                       # a query with no key: no choice, left out
    allowed[1, 0, 1] = False
    allowed[1, 0, 1, 4] = True                     # a query with one key: no choice, left out
    got = finish(head_stats(s, allowed))
    d = s.double().masked_fill(~allowed, -math.inf)
    n = allowed.sum(-1).expand(3, 5, 7)
    chosen = n >= 2
    p = torch.softmax(d, dim=-1).nan_to_num(0.0)
    ent = -torch.where(p > 0, p * p.log(), 0.0).sum(-1) / n.clamp(min=2).double().log()
    for h in range(5):
        c = chosen[:, h]
        np.testing.assert_allclose(got["max_logit"][h], float(d[:, h][c].amax()), rtol=1e-6)
        np.testing.assert_allclose(got["entropy_mean"][h], float(ent[:, h][c].mean()), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got["entropy_min"][h], float(ent[:, h][c].min()), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got["onehot_frac"][h], float((p[:, h].amax(-1)[c] > 0.99).double().mean()))
    assert got["onehot_frac"][4] > 0.3 > got["onehot_frac"][0]       # sharp heads go one-hot, flat ones do not


def test_gpt2_and_bert_families() -> None:
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=32, attn_implementation="eager")).eval()
    ids = torch.randint(0, 64, (2, 8))
    stats, out = run_tapped(gpt2, input_ids=ids)
    causal = torch.tril(torch.ones(8, 8, dtype=torch.bool))[None, None]
    got = stats["transformer.h.0.attn"]
    for k, v in oracle_from_weights(out.attentions[0], causal).items():
        np.testing.assert_allclose(got[k], v, atol=TOL)
    attn = gpt2.transformer.h[0].attn
    with torch.no_grad():
        h = gpt2.transformer.h[0].ln_1(gpt2.transformer.wte(ids) + gpt2.transformer.wpe(torch.arange(8)))
        q, k, _ = attn.c_attn(h).split(32, dim=2)
    q, k = (x.view(2, 8, 4, 8).transpose(1, 2).double() for x in (q, k))
    s = (q @ k.transpose(-1, -2) / math.sqrt(8)).masked_fill(~causal, -math.inf)[:, :, 1:]
    np.testing.assert_allclose(got["max_logit"], s.amax(dim=(0, 2, 3)).numpy(), atol=TOL, rtol=TOL)

    bert = transformers.BertModel(transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
        attn_implementation="eager")).eval()
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 6:] = 0
    stats, out = run_tapped(bert, input_ids=ids, attention_mask=mask)
    assert list(stats) == ["encoder.layer.0.attention.self"]          # the innermost attention module
    allowed = mask.bool()[:, None, None, :].expand(2, 1, 8, 8)
    for k, v in oracle_from_weights(out.attentions[0], allowed).items():
        np.testing.assert_allclose(stats["encoder.layer.0.attention.self"][k], v, atol=TOL)


def test_recorder_writes_attn_group_and_combines_micro_batches(tmp_path) -> None:
    model = tiny_llama()
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 64, (2, 10), generator=g) for _ in range(4)]
    with gf.Recorder(tmp_path / "s.zarr", model=model, sources=["a"], attention="auto", sketch=8) as rec:
        for i in range(2):      # two micro-batches per record
            for x in batches[2 * i: 2 * i + 2]:
                model(input_ids=x, labels=x).loss.backward()
            rec.record(step=i, loss=1.0, source="a")
            model.zero_grad()
    store = open_store(tmp_path / "s.zarr")
    assert store.attn_modules == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    for i in range(2):
        whole, _ = run_tapped(model.train(), input_ids=torch.cat(batches[2 * i: 2 * i + 2]))
        for stat, v in whole["model.layers.1.self_attn"].items():
            a = store.attn("model.layers.1.self_attn", stat)
            assert a.shape == (2, 4) and a.dtype == np.float32
            np.testing.assert_allclose(a[i], v, atol=1e-6, rtol=1e-6)
    import zarr

    arr = zarr.open_array(tmp_path / "s.zarr" / "attn" / "model.layers.0.self_attn" / "max_logit", mode="r")
    assert arr.metadata.dimension_names == ("record", "model.layers.0.self_attn.max_logit.head")


def test_sdpa_and_non_attention_modules_refused_in_one_line(tmp_path) -> None:
    with pytest.raises(AttentionUnavailableError, match=r"'sdpa'.*attn_implementation=\"eager\"") as e:
        gf.Recorder(tmp_path / "s.zarr", model=tiny_llama("sdpa"), sources=["a"], attention="auto")
    assert "\n" not in str(e.value) and not (tmp_path / "s.zarr").exists()
    # a module that is not a Hugging Face attention goes through the SDPA door: refused at the record
    # where it made no scaled_dot_product_attention call (an eager LLaMA's MLP makes none)
    model = tiny_llama()
    with gf.Recorder(tmp_path / "m.zarr", model=model, sources=["a"], attention=["*.mlp"], sketch=4) as rec:
        model(input_ids=torch.zeros((1, 3), dtype=torch.long))
        with pytest.raises(SpecError, match="made no scaled_dot_product_attention call"):
            rec.record(step=0, source="a")
    lin = torch.nn.Sequential(torch.nn.Linear(3, 3))
    with gf.Recorder(tmp_path / "l.zarr", model=lin, sources=["a"], attention="auto", sketch=4) as rec:
        lin(torch.ones(1, 3))
        with pytest.raises(SpecError, match="ran no scaled_dot_product_attention call and has no Hugging Face"):
            rec.record(step=0, source="a")
    # an attention module outside any PreTrainedModel: no public door switches it
    from transformers.models.llama.modeling_llama import LlamaAttention

    bare = torch.nn.ModuleDict({"attn": LlamaAttention(tiny_llama().config, 0), "out": torch.nn.Linear(32, 2)})
    with pytest.raises(SpecError, match="in no Hugging Face model"):
        gf.Recorder(tmp_path / "s.zarr", model=bare, sources=["a"], attention="auto")
    assert not (tmp_path / "s.zarr").exists()


def test_array_recorder_attention_and_validation_at_open(tmp_path) -> None:
    import zarr

    stats = {k: np.arange(3, dtype=np.float32) for k in ("max_logit", "entropy_mean", "entropy_min", "onehot_frac")}
    path = tmp_path / "a.zarr"
    with gf.Recorder(path, sources=["a"]) as rec:
        for i in range(2):
            rec.record(step=i, source="a", grads={"w": np.ones((2, 2), np.float32)}, attention={"l0": stats})
        with pytest.raises(SpecError, match="expected"):
            rec.record(step=2, source="a", grads={"w": np.ones((2, 2), np.float32)},
                       attention={"l0": {"max_logit": stats["max_logit"]}})
    np.testing.assert_array_equal(open_store(path).attn("l0", "entropy_min"), np.tile(np.arange(3), (2, 1)))
    root = zarr.open_group(path, mode="r+")
    root.create_array("attn/l0/bogus", shape=(2, 3), dtype="float32")
    with pytest.raises(CorruptStoreError, match="attn/l0/bogus"):
        open_store(path)
    del root["attn/l0/bogus"]
    root["attn/l0/max_logit"].attrs["heads"] = 5
    with pytest.raises(CorruptStoreError, match="heads"):
        open_store(path)


def test_record_spec_attention_values() -> None:
    from gradforensics.replay.plan import RecordSpec

    assert RecordSpec(attention=[]).attention == "auto"          # `--attention` with no glob
    assert RecordSpec(attention="auto").recorder_options()["attention"] == "auto"
    assert RecordSpec(attention=["model.layers.1*"]).attention == ("model.layers.1*",)
    assert RecordSpec(attention="none").attention is None and RecordSpec().attention is None

