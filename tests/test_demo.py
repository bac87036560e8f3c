"""The demo: its synthetic sources carry exactly the planted contradiction, and end to end the
report names the planted pair (zh, en) and does not flag the consistent source (code)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from gradforensics import demo  # noqa: E402


@pytest.fixture(scope="module")
def sources():
    return demo.make_sources(demo.DemoConfig())


def _ranges(cfg: demo.DemoConfig) -> dict[str, range]:
    shared = range(1, 1 + cfg.shared)
    own = {s: range(1 + cfg.shared + i * cfg.own, 1 + cfg.shared + (i + 1) * cfg.own) for i, s in enumerate(demo.SOURCES)}
    return {"shared": shared, **own}


def test_sources_use_their_own_ranges_and_only_zh_en_share_a_context(sources):
    cfg = demo.DemoConfig()
    r = _ranges(cfg)
    rng = np.random.default_rng(0)
    for name, src in sources.items():
        x = src.sample(rng, 64, cfg.seq_len)
        assert x.shape == (64, cfg.seq_len) and (x[:, 0] == 0).all()
        body = set(np.unique(x[:, 1:]).tolist())
        allowed = set(r[name]) | (set(r["shared"]) if name in demo.PLANTED_PAIR else set())
        assert body <= allowed, name
        assert max(body) < demo.vocab_size(cfg)
    assert not set(np.unique(sources["code"].sample(rng, 64, cfg.seq_len))) & set(r["shared"])


def test_zh_and_en_continue_the_same_context_differently(sources):
    cfg = demo.DemoConfig()
    zh, en = sources["zh"], sources["en"]
    assert sorted(zh.perm.tolist()) == sorted(en.perm.tolist()) == list(range(cfg.shared))
    assert (zh.perm != en.perm).all()                       # every shared context: a different continuation
    rng = np.random.default_rng(1)
    for src in (zh, en):
        x = src.sample(rng, 32, cfg.seq_len)
        s, nxt = x[:, 1:2 * cfg.pairs:2] - 1, x[:, 2:2 * cfg.pairs + 1:2] - 1
        assert (nxt == src.perm[s]).all()


def test_sampling_is_seeded(sources):
    a = sources["zh"].sample(np.random.default_rng(5), 4, 32)
    b = sources["zh"].sample(np.random.default_rng(5), 4, 32)
    c = sources["zh"].sample(np.random.default_rng(6), 4, 32)
    assert (a == b).all() and not (a == c).all()
    assert (demo.make_sources(demo.DemoConfig(seed=3))["zh"].perm == demo.make_sources(demo.DemoConfig(seed=3))["zh"].perm).all()


def test_loss_skips_the_first_prediction():
    cfg = demo.DemoConfig()
    model = demo.make_model(cfg)
    x = torch.from_numpy(demo.make_sources(cfg)["zh"].sample(np.random.default_rng(0), 2, cfg.seq_len))
    logits = model(input_ids=x).logits
    want = torch.nn.functional.cross_entropy(logits[:, 1:-1].reshape(-1, logits.shape[-1]), x[:, 2:].reshape(-1))
    assert torch.allclose(demo.lm_loss(model, x), want, atol=1e-6)


def test_model_is_a_tiny_llama_with_gqa():
    cfg = demo.DemoConfig()
    model = demo.make_model(cfg)
    c = model.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == (2, 64, 4, 2)
    assert sum(p.numel() for p in model.parameters()) < 200_000


def test_lr_schedule_warms_up_then_decays():
    cfg = demo.DemoConfig()
    f = [demo.lr_factor(k, cfg) for k in range(cfg.steps)]
    assert f[0] == pytest.approx(1 / cfg.warmup) and f[cfg.warmup - 1] == pytest.approx(1.0)
    assert f[-1] == pytest.approx(0.1, abs=1e-3) and all(a >= b for a, b in zip(f[cfg.warmup:], f[cfg.warmup + 1:]))


def _doc_examples():
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "doc_examples.py"
    spec = importlib.util.spec_from_file_location("doc_examples", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_doc_example_blocks_are_found_and_a_drifted_number_is_caught():
    """The checker itself, on the page as it stands and on a page with one number moved."""
    de = _doc_examples()
    page = (Path(__file__).resolve().parents[1] / "docs" / "demo.md").read_text()
    quoted = de.blocks(page)
    assert {"demo-output", "demo-timing"} <= set(quoted)
    line = de.top_lines(quoted["demo-output"], 1)[0]
    assert de._numbers(line)["kind"] == "conflict"
    printed = "\n".join(x for x in quoted["demo-output"].splitlines() if not x.startswith("```"))
    size = float(re.search(r"(\d+) MiB", quoted["demo-timing"]).group(1))
    assert de.check_demo(printed, size, page) == []
    sev = line.split()[0]
    drifted = printed.replace(f"  {sev} conflict", f"  {float(sev) - 0.2:.2f} conflict", 1)
    assert any("severity" in p for p in de.check_demo(drifted, size, page))
    assert any("store size" in p for p in de.check_demo(printed, size + 5, page))


@pytest.mark.slow
def test_demo_end_to_end_names_the_planted_pair_and_spares_code(tmp_path, capsys):
    from gradforensics.cli import main
    from gradforensics.reporting import flagsjson
    from gradforensics.store.reader import Store

    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--seed", "0"]) == 0
    printed = capsys.readouterr().out
    assert "report:" in printed and "conflict" in printed
    # docs/demo.md quotes this run's output: within the tolerances the page states (issue 27)
    size = sum(p.stat().st_size for p in (out / "dump.zarr").rglob("*") if p.is_file()) / 2**20
    assert _doc_examples().check_demo(printed, size) == []
    # a second demo into the same --out would record again over the first: only with --overwrite
    assert main(["demo", "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "already holds checkpoint, dump.zarr recorded by an earlier run; pass --overwrite" in err

    assert (out / "checkpoint" / "config.json").is_file()
    store = Store(out / "dump.zarr")
    assert store.mode == "replay" and store.sources == ("zh", "en", "code")
    assert store.n_records == 3 * demo.DemoConfig().n_per_source
    assert any(info.heads for info in store.grads.values()) and store.act_modules

    doc = json.loads((out / "flags.json").read_text())
    flagsjson.validate(doc)
    conflicts = [f for f in doc["flags"] if f["kind"] == "conflict"]
    top = conflicts[0]
    assert set(top["sources"]) == {"zh", "en"} and top["severity"] >= 0.75
    assert doc["flags"][0]["kind"] == "conflict"                            # the planted trouble leads the report
    assert not [f for f in conflicts if "code" in f["sources"]], "the consistent source was flagged"
    # nothing at or above 0.5 that is not planted: no per-tensor noise flood on the converged model
    loud = [(f["kind"], f["tensor"], tuple(f["sources"])) for f in doc["flags"] if f["severity"] >= 0.5]
    assert loud and all(k == "conflict" and set(s) == {"zh", "en"} for k, _, s in loud), loud
    noise = [f for f in doc["flags"] if f["kind"] == "noise"]
    assert [f["tensor"] for f in noise] in ([], ["whole model"]) and all(not f["sources"] for f in noise)
    assert all(f["evidence"]["snr"] is None or f["evidence"]["snr"] > 0 for f in noise)

    html = (out / "report.html").read_text()
    summary = html[html.index('id="summary-list"'):html.index("</ol>")]
    first = re.findall(r"<li>(.*?)</li>", summary)[0]
    assert "zh and en gradients point opposite ways" in first and "model.layers." in first
    assert not re.search(r"conflict</a> — [^<]*code", summary)
    verdict = re.search(r'<p class="verdict" id="verdict">(.*?)</p>', html).group(1)
    assert verdict.startswith("What is wrong: data-source conflict") and "zh and en" in verdict
    assert doc["not_judged"] == []                  # 16 records per source, replay: every analysis could judge

    # issue 45: the overview greys what had nothing to read on the demo (no curvature, optimizer state,
    # attention statistics), and a partial pass (the docs' per-analysis snippets) keeps the full results
    import gradforensics as gf
    from gradforensics.reporting import figures

    ov = figures.overview_data(gf.analyze(out / "dump.zarr", progress=False))
    assert {n for n, s in ov.status.items() if s == "nothing to read"} >= {"curvature", "optimizer"}
    gf.analyze(out / "dump.zarr", only="drift", progress=False)
    assert main(["report", str(out / "dump.zarr"), "--out", str(tmp_path / "again")]) == 0
    html = (tmp_path / "again" / "report.html").read_text()
    verdict = re.search(r'<p class="verdict" id="verdict">(.*?)</p>', html).group(1)
    assert verdict.startswith("What is wrong: data-source conflict") and "zh and en" in verdict
