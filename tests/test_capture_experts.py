"""``experts=``: per-expert gradient units and router statistics against the model's own ``.grad`` and torch.

Oracles: the stored ``(N, E, ...)`` unit equals the expert weights' own ``.grad`` (exact, float32);
the load equals the top-k token counts of router logits recomputed here from the router's input
(exact); entropy and logit_z against direct torch formulas (1e-6).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import gradforensics as gf  # noqa: E402
from gradforensics.errors import CorruptStoreError, SpecError  # noqa: E402
from gradforensics.store.reader import open_store  # noqa: E402

nn = torch.nn
E, K, D, V = 4, 2, 16, 40


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _mixtral() -> nn.Module:
    cfg = transformers.MixtralConfig(vocab_size=V, hidden_size=D, intermediate_size=8, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=1, num_local_experts=E,
                                     num_experts_per_tok=K, max_position_embeddings=32)
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(cfg)


def _qwen2_moe() -> nn.Module:
    cfg = transformers.Qwen2MoeConfig(vocab_size=V, hidden_size=D, intermediate_size=8, moe_intermediate_size=8,
                                      shared_expert_intermediate_size=12, num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, num_experts=E, num_experts_per_tok=K,
                                      max_position_embeddings=32, decoder_sparse_step=1)
    torch.manual_seed(0)
    return transformers.Qwen2MoeForCausalLM(cfg)


class _Expert(nn.Module):
    """Mixtral's original per-expert MLP (w1, w2, w3)."""

    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(D, 8, bias=False), nn.Linear(8, D, bias=False), nn.Linear(D, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))


class _ListedMoe(nn.Module):
    """Mixtral-style block: ``gate`` an nn.Linear returning logits, ``experts`` a ModuleList, ``top_k`` on it."""

    def __init__(self) -> None:
        super().__init__()
        self.top_k = K
        self.gate = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList(_Expert() for _ in range(E))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, D)
        w, idx = torch.topk(torch.softmax(self.gate(flat), -1), self.top_k, dim=-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(idx == e)
            if tok.numel():
                out.index_add_(0, tok, expert(flat[tok]) * w[tok, slot, None])
        return (flat + out).reshape(x.shape)


class _ListedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.layers = nn.ModuleList(nn.ModuleDict({"block_sparse_moe": _ListedMoe()}) for _ in range(2))
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer["block_sparse_moe"](x)
        return self.head(x)


def _router_inputs(model: nn.Module, names: list[str]) -> tuple[dict[str, list[torch.Tensor]], list]:
    """Our own hooks: every input each router saw (the oracle recomputes the logits from it)."""
    seen: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    mods = dict(model.named_modules())
    handles = [mods[n].register_forward_hook(lambda m, a, o, n=n: seen[n].append(a[0].detach().reshape(-1, D)))
               for n in names]
    return seen, handles


def _want(weight: torch.Tensor, xs: list[torch.Tensor]) -> dict[str, np.ndarray]:
    """load, max_share, entropy of the mean softmax, mean logsumexp² - directly, in float64."""
    z = torch.cat(xs).double() @ weight.detach().double().T
    counts = torch.bincount(torch.topk(z, K, dim=-1).indices.reshape(-1), minlength=E).double()
    load = (counts / counts.sum()).numpy()
    p = torch.softmax(z, -1).mean(0)
    return {"load": load, "max_share": load.max(), "entropy": float(-(p * p.log()).sum()),
            "logit_z": float((torch.logsumexp(z, -1) ** 2).mean())}


def _run(model: nn.Module, path, loss_of, routers: list[str], n: int = 2, micro: int = 1, **kw):
    seen, handles = _router_inputs(model, routers)
    grads, wants = [], []
    torch.manual_seed(1)
    with gf.Recorder(path, model=model, sources=["a", "b"], heads=None, **kw) as rec:
        for i in range(n):
            for r in routers:
                seen[r].clear()
            model.zero_grad()
            for _ in range(micro):
                loss = loss_of(model, torch.randint(0, V, (2, 6)))
                loss.backward()
            grads.append({k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})
            mods = dict(model.named_modules())
            wants.append({r: _want(mods[r].weight, seen[r]) for r in routers})
            rec.record(loss=loss, source="ab"[i % 2])
    for h in handles:
        h.remove()
    return open_store(path), grads, wants


def _hf_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def _check_router(s, wants, routers: list[str]) -> None:
    assert s.router_modules == sorted(routers)
    for r in routers:
        load = s.router(r, "load")
        assert load.shape == (len(wants), E) and s.arrays[f"router/{r}/load"].attrs["experts"] == E
        for i, w in enumerate(wants):
            np.testing.assert_array_equal(load[i], w[r]["load"].astype(np.float32))       # exact token counts
            assert s.router(r, "max_share")[i] == np.float32(w[r]["max_share"])
            assert s.arrays[f"router/{r}/load"].attrs["top_k"] == K
            assert s.router(r, "entropy")[i] == pytest.approx(w[r]["entropy"], rel=1e-6)
            assert s.router(r, "logit_z")[i] == pytest.approx(w[r]["logit_z"], rel=1e-6)


def test_mixtral_fused_experts_equal_their_own_grad_and_loads_their_token_counts(tmp_path):
    model = _mixtral()
    routers = [f"model.layers.{i}.mlp.gate" for i in range(2)]
    s, grads, wants = _run(model, tmp_path / "m.zarr", _hf_loss, routers, micro=2, experts="auto")
    for i in range(2):
        for w in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{i}.mlp.experts.{w}"
            assert s.experts_of(name) == E
            g = s.read(f"grads/{name}")
            assert g.shape[:2] == (2, E)
            for r in range(2):
                np.testing.assert_array_equal(g[r], grads[r][name].numpy())
        gate = f"model.layers.{i}.mlp.gate.weight"           # the router's weight is recorded (its grad norm)
        np.testing.assert_array_equal(s.read(f"grads/{gate}")[1], grads[1][gate].numpy())
        assert s.experts_of(gate) is None
    _check_router(s, wants, routers)
    # per source: the records name their source, so every router row is a (record, source) row
    np.testing.assert_array_equal(s.read("batches/mixture")[:, 0], [1.0, 0.0])


def test_qwen2_moe_shared_expert_stays_whole(tmp_path):
    model = _qwen2_moe()
    routers = [f"model.layers.{i}.mlp.gate" for i in range(2)]
    s, grads, wants = _run(model, tmp_path / "q.zarr", _hf_loss, routers, experts="auto")
    units = [t for t in s.tensors if s.experts_of(t)]
    assert units == [f"model.layers.{i}.mlp.experts.{w}" for i in range(2) for w in ("down_proj", "gate_up_proj")]
    shared = "model.layers.0.mlp.shared_expert.down_proj.weight"
    assert shared in s.tensors and s.experts_of(shared) is None
    np.testing.assert_array_equal(s.read(f"grads/{shared}")[0], grads[0][shared].numpy())
    for u in units:
        np.testing.assert_array_equal(s.read(f"grads/{u}")[1], grads[1][u].numpy())
    _check_router(s, wants, routers)


def _other(kind: str) -> tuple[nn.Module, list[str]]:
    common = {"vocab_size": V, "hidden_size": D, "num_hidden_layers": 2, "num_attention_heads": 2,
              "max_position_embeddings": 32, "num_experts_per_tok": K, "intermediate_size": 8}
    torch.manual_seed(0)
    if kind == "olmoe":
        m = transformers.OlmoeForCausalLM(transformers.OlmoeConfig(**common, num_experts=E, num_key_value_heads=1))
    elif kind == "qwen3_moe":
        m = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **common, num_experts=E, num_key_value_heads=1, moe_intermediate_size=8, head_dim=8))
    else:     # DeepSeek-V3: layer 0 dense, layer 1 routed experts + a shared expert (shared_experts, kept whole)
        m = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
            **common, num_key_value_heads=2, moe_intermediate_size=8, n_routed_experts=E, n_shared_experts=1,
            first_k_dense_replace=1, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
            v_head_dim=4, n_group=1, topk_group=1))
        return m, ["model.layers.1.mlp.gate"]
    return m, [f"model.layers.{i}.mlp.gate" for i in range(2)]


@pytest.mark.parametrize("kind", ["olmoe", "qwen3_moe", "deepseek_v3"])
def test_other_hf_moe_families(tmp_path, kind):
    model, routers = _other(kind)
    s, grads, wants = _run(model, tmp_path / "o.zarr", _hf_loss, routers, experts="auto")
    units = [t for t in s.tensors if s.experts_of(t)]
    assert units == [r.replace(".gate", f".experts.{w}") for r in routers for w in ("down_proj", "gate_up_proj")]
    for u in units:
        np.testing.assert_array_equal(s.read(f"grads/{u}")[1], grads[1][u].numpy())
    if kind == "deepseek_v3":
        assert "model.layers.1.mlp.shared_experts.down_proj.weight" in s.tensors
    _check_router(s, wants, routers)


def test_listed_experts_stack_into_one_unit_per_weight_name(tmp_path):
    model = _ListedModel()

    def loss_of(m: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(m(ids).reshape(-1, V), ids.reshape(-1))

    routers = [f"layers.{i}.block_sparse_moe.gate" for i in range(2)]
    s, grads, wants = _run(model, tmp_path / "l.zarr", loss_of, routers, experts={"*.block_sparse_moe.experts": E},
                           weights_every=1)
    for i in range(2):
        for w in ("w1", "w2", "w3"):
            unit = f"layers.{i}.block_sparse_moe.experts.{w}.weight"
            assert s.experts_of(unit) == E
            want = np.stack([grads[1][f"layers.{i}.block_sparse_moe.experts.{e}.{w}.weight"].numpy()
                             for e in range(E)])
            np.testing.assert_array_equal(s.read(f"grads/{unit}")[1], want)
            assert s.arrays[f"weights/{unit}"].shape[1:] == want.shape
    assert not [t for t in s.tensors if ".experts.0." in t]       # no member is stored on its own
    _check_router(s, wants, routers)
    import zarr

    zarr.open_array(str(tmp_path / "l.zarr" / "router" / routers[0] / "load"), mode="r+").attrs["experts"] = E + 1
    with pytest.raises(CorruptStoreError, match="attribute experts = E"):
        open_store(tmp_path / "l.zarr")


def test_experts_refusals(tmp_path):
    plain = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(SpecError, match="no module named 'experts'"):
        gf.Recorder(tmp_path / "a.zarr", model=plain, sources=["a"], experts="auto")
    with pytest.raises(SpecError, match="holds 4 experts, not 3"):
        gf.Recorder(tmp_path / "b.zarr", model=_ListedModel(), sources=["a"], experts={"*.experts": 3})
    with pytest.raises(SpecError, match="does not hold 3 experts"), \
            gf.Recorder(tmp_path / "c.zarr", sources=["a"], experts={"w": 3}) as rec:
        rec.record(source="a", grads={"w": np.ones((4, 2), np.float32)})


def test_array_recorder_marks_units_and_the_validator_checks_them(tmp_path):
    path = tmp_path / "a.zarr"
    with gf.Recorder(path, sources=["a"], experts={"moe.*": 3}) as rec:
        rec.record(source="a", grads={"moe.w": np.arange(12, dtype=np.float32).reshape(3, 4), "x": np.ones((2, 2), np.float32)})
    s = open_store(path)
    assert s.experts_of("moe.w") == 3 and s.experts_of("x") is None
    np.testing.assert_array_equal(s.read("grads/moe.w")[0], np.arange(12).reshape(3, 4))
    import zarr

    from gradforensics.store.layout import dimension_names

    assert dimension_names("grads/moe.w", 3, {"experts": 3}) == ("record", "moe.w.expert", "moe.w.ax2")
    assert dimension_names("router/g/load", 2, {"experts": 3})[0] == "record"
    zarr.open_array(str(path / "grads" / "moe.w"), mode="r+").attrs["experts"] = 5
    with pytest.raises(CorruptStoreError, match="experts=5"):
        open_store(path)


@pytest.mark.slow       # a tokenizer is trained and a checkpoint replayed (the test_capture_cli fixtures)
def test_capture_cli_experts_records_units_and_router_loads(tmp_path, capsys):
    pytest.importorskip("tokenizers")
    from test_capture_cli import capture, corpus

    from gradforensics.replay import data

    llama = _tiny_tokenizer()
    model_dir = tmp_path / "mixtral"
    cfg = transformers.MixtralConfig(vocab_size=len(llama), hidden_size=D, intermediate_size=8, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, num_local_experts=E,
                                     num_experts_per_tok=K, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(cfg).save_pretrained(model_dir)
    llama.save_pretrained(model_dir)
    text = tmp_path / "en.txt"
    text.write_text("".join(t + "\n" for t in corpus("en", 40, 3)), encoding="utf-8")
    out = tmp_path / "c.zarr"
    rc, err = capture(model_dir, "--data", f"en={text}", "--out", out, "--batches-per-source", "2", "--batch-size",
                      "2", "--seq-len", "16", "--experts", capsys=capsys)
    assert rc == 0, err
    s = open_store(out)
    assert s.experts_of("model.layers.0.mlp.experts.down_proj") == E
    assert "model.layers.0.mlp.gate.weight" in s.tensors
    model = transformers.MixtralForCausalLM.from_pretrained(model_dir, local_files_only=True)
    batches = data.load_batches(data.parse_sources([f"en={text}"]), llama, seq_len=16, batch_size=2, n_batches=2,
                                seed=0)
    seen, handles = _router_inputs(model, ["model.layers.0.mlp.gate"])
    for j in range(2):
        seen["model.layers.0.mlp.gate"].clear()
        with torch.enable_grad():
            model(input_ids=batches["en"][j]["input_ids"])
        want = _want(model.model.layers[0].mlp.gate.weight, seen["model.layers.0.mlp.gate"])
        np.testing.assert_array_equal(s.router("model.layers.0.mlp.gate", "load")[j], want["load"].astype(np.float32))
    for h in handles:
        h.remove()


def _tiny_tokenizer() -> transformers.PreTrainedTokenizerFast:
    from test_capture_cli import corpus
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus("en", 60, 0), trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                pad_token="<pad>")


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_aux_loss_is_the_models_own_and_each_layers_is_transformers_loss_on_its_logits(tmp_path, family):
    """Oracles: ``router/aux_loss`` = the mean of the model's ``output.aux_loss`` over the record's two
    micro-batches (1e-6); ``router/<gate>/aux_loss`` = transformers' ``load_balancing_loss_func`` on that
    layer's router logits of the record alone (1e-5)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    model = _mixtral() if family == "mixtral" else _qwen2_moe()
    model.config.output_router_logits = True
    routers = [f"model.layers.{i}.mlp.gate" for i in range(2)]
    reported, logits = [], []
    torch.manual_seed(1)
    with gf.Recorder(tmp_path / "a.zarr", model=model, sources=["a", "b"], heads=None, experts="auto") as rec:
        for i in range(3):
            model.zero_grad()
            outs = []
            for _ in range(2):
                ids = torch.randint(0, V, (2, 6))
                out = model(input_ids=ids, labels=ids)
                out.loss.backward()
                outs.append(out)
            reported.append(np.mean([float(o.aux_loss.detach()) for o in outs]))
            logits.append([torch.cat([o.router_logits[layer].detach() for o in outs]) for layer in range(2)])
            rec.record(loss=out.loss, source="ab"[i % 2])
        with torch.no_grad():      # an evaluation forward reports aux_loss too; it is not counted
            model(input_ids=torch.randint(0, V, (2, 6)))
    s = open_store(tmp_path / "a.zarr")
    np.testing.assert_allclose(s.model_aux_loss(), reported, rtol=1e-6)
    assert s.router_modules == routers
    for layer, r in enumerate(routers):
        want = [float(load_balancing_loss_func((lg[layer],), E, K)) for lg in logits]
        np.testing.assert_allclose(s.router(r, "aux_loss"), want, rtol=1e-5)


def test_aux_loss_absent_when_the_model_does_not_report_it(tmp_path):
    model = _mixtral()      # output_router_logits False: aux_loss None
    s, _, _ = _run(model, tmp_path / "m.zarr", _hf_loss, ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"],
                       experts="auto")
    assert s.model_aux_loss() is None and "router/aux_loss" not in s.arrays
    assert s.router("model.layers.0.mlp.gate", "aux_loss").shape == (2,)      # each layer's is always recorded


@pytest.mark.parametrize("sketch_on", ["device", "host"])
@pytest.mark.parametrize("family", ["mixtral", "listed"])
def test_experts_units_are_sketched_per_expert(tmp_path, sketch_on, family):
    """Oracle: ``sketch/<unit>[n, e]`` = the countsketch (same seed, same k) of expert e's own gradient
    (the model's ``.grad``), as a head's is of its block (1e-5); the unit's sketch is (N, E, k)."""
    from gradforensics.recording.sketch import Sketcher

    k = 16
    if family == "mixtral":
        model, loss_of, kw = _mixtral(), _hf_loss, {"experts": "auto"}
        units = {f"model.layers.0.mlp.experts.{w}": None for w in ("gate_up_proj", "down_proj")}
    else:
        model, kw = _ListedModel(), {"experts": {"*.block_sparse_moe.experts": E}}

        def loss_of(m: nn.Module, ids: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(m(ids).reshape(-1, V), ids.reshape(-1))

        units = {f"layers.0.block_sparse_moe.experts.{w}.weight": [f"layers.0.block_sparse_moe.experts.{e}.{w}.weight"
                                                                  for e in range(E)] for w in ("w1", "w2")}
    routers = ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"] if family == "mixtral" else \
        ["layers.0.block_sparse_moe.gate", "layers.1.block_sparse_moe.gate"]
    s, grads, _ = _run(model, tmp_path / "s.zarr", loss_of, routers, sketch=k, sketch_on=sketch_on, **kw)
    sk = Sketcher(k=k)
    for unit, members in units.items():
        assert s.sketches[unit].shape == (2, E, k) and s.sketches[unit].attrs["experts"] == E
        assert unit not in s.grads                  # sketched only
        for r in range(2):
            g = grads[r][unit].numpy() if members is None else np.stack([grads[r][m].numpy() for m in members])
            want = np.stack([sk.project(g[e]) for e in range(E)])
            np.testing.assert_allclose(s.read(f"sketch/{unit}")[r], want, rtol=1e-5, atol=1e-7)
    findings = gf.analyze(s.path, progress=False, only=["drift"])      # the Gram pass takes them per expert
    t = findings.table("drift")
    assert sorted(t.loc[t["tensor"] == next(iter(units)), "head"].dropna().astype(int)) == list(range(E))
