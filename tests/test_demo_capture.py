"""``capture`` of the demo's own checkpoint replays the demo's training (issue 45, items 4 and 10).

The demo trains without scoring the first token after ``<s>``; a capture that scored it
set all three sources against each other (``code``, the healthy control, in conflict) and
``--seq-len``'s default 512 was refused by the checkpoint's 128 positions.  The checkpoint's
``config.json`` now names its loss (``causal-lm-skip-first``, read by ``--loss auto``) and its
tokenizer the length it trained at (``model_max_length`` 32, the default ``--seq-len``).
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from gradforensics import demo  # noqa: E402
from gradforensics.replay.losses import CausalLMSkipFirst, causal_lm  # noqa: E402
from gradforensics.replay.plan import DEFAULT_SEQ_LEN, fit_seq_len  # noqa: E402


def _cross_entropy_at(logits: torch.Tensor, ids: torch.Tensor, pairs: list[tuple[int, int]]) -> torch.Tensor:
    """Oracle: the mean of -log softmax(logits[b, t])[ids[b, t + 1]] over the listed (b, t), one at a time."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    return torch.stack([-logp[b, t, ids[b, t + 1]] for b, t in pairs]).mean()


@torch.no_grad()
def test_skip_first_loss_leaves_out_each_documents_first_target_and_bos():
    cfg = demo.DemoConfig()
    model = demo.make_model(cfg)
    rows = demo.make_sources(cfg)["code"].sample(np.random.default_rng(0), 2, 8)
    ids = torch.from_numpy(np.concatenate([rows[0], rows[1], [0, 0]]))[None]    # <s> a... <s> b... pad pad
    mask = torch.ones_like(ids)
    mask[0, -2:] = 0
    logits = model(input_ids=ids, attention_mask=mask).logits.detach()
    bos = [0, 8]
    keep = [(0, t) for t in range(ids.shape[1] - 1)
            if mask[0, t + 1] and t not in bos and t + 1 not in bos]
    assert len(keep) == 2 * 6                                       # 7 targets a document, less its first one
    got = CausalLMSkipFirst(demo.BOS)(model, {"input_ids": ids, "attention_mask": mask})
    assert float(got) == pytest.approx(float(_cross_entropy_at(logits, ids, keep)), rel=1e-5)
    every = [(0, t) for t in range(ids.shape[1] - 1) if mask[0, t + 1]]
    assert float(causal_lm(model, {"input_ids": ids, "attention_mask": mask})) == pytest.approx(
        float(_cross_entropy_at(logits, ids, every)), rel=1e-5)
    # the demo trains with this loss: one BOS a row, its first target left out (what labels[:, :2] = -100 did)
    x = torch.from_numpy(rows)
    out = model(input_ids=x).logits.detach()
    want = _cross_entropy_at(out, x, [(b, t) for b in range(2) for t in range(1, 7)])
    assert float(demo.lm_loss(model, x)) == pytest.approx(float(want), rel=1e-5)


def test_seq_len_defaults_to_the_models_own_limit_when_lower_and_says_so():
    assert fit_seq_len(None, [(4096, "config max_position_embeddings")]) == (DEFAULT_SEQ_LEN, None)
    assert fit_seq_len(None, [(None, ""), (10**30, "the tokenizer's model_max_length")]) == (DEFAULT_SEQ_LEN, None)
    n, line = fit_seq_len(None, [(128, "config max_position_embeddings"), (32, "the tokenizer's model_max_length")])
    assert n == 32 and line is not None and "the tokenizer's model_max_length" in line and "512" in line
    assert fit_seq_len(100, [(32, "the tokenizer's model_max_length")]) == (100, None)   # asked for: kept


@pytest.mark.slow
def test_capture_of_the_demo_checkpoint_spares_code_as_the_demo_does(tmp_path, capsys):
    from gradforensics.cli import main

    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--quiet"]) == 0
    cfg = demo.DemoConfig()
    assert json.loads((out / "checkpoint" / "config.json").read_text())["gradforensics_loss"] == "causal-lm-skip-first"
    capsys.readouterr()
    store = tmp_path / "capture.zarr"
    data = [a for s in demo.SOURCES for a in ("--data", f"{s}={out / 'data' / f'{s}.txt'}")]
    # no --seq-len, no --loss: the checkpoint's own length and loss
    assert main(["capture", str(out / "checkpoint"), *data, "--out", str(store), "--batches-per-source",
                 str(cfg.n_per_source), "--batch-size", str(cfg.batch)]) == 0
    err = capsys.readouterr().err
    assert "--seq-len 32: the model's own limit (the tokenizer's model_max_length)" in err
    assert "loss causal-lm-skip-first" in err
    assert main(["analyze", str(store), "--out", str(tmp_path / "report"), "--only", "conflict", "--quiet"]) in (0, 1)
    flags = [f for f in json.loads((tmp_path / "report" / "flags.json").read_text())["flags"]
             if f["kind"] == "conflict"]
    assert not [f for f in flags if "code" in f["sources"]], "the healthy control was flagged"
    assert max(f["severity"] for f in flags if set(f["sources"]) == {"zh", "en"}) >= 0.75
    # the same checkpoint and data as the demo's own store: nothing new (18 new findings before)
    capsys.readouterr()
    main(["compare", str(out / "dump.zarr"), str(store), "--out", str(tmp_path / "cmp"), "--quiet"])
    said = capsys.readouterr()
    assert re.search(r"\b0 new, 0 worse, \d+ persisting", said.out + said.err), said
