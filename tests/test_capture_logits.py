"""``capture --logits``: the output logits' log Z and logit statistics of a replayed HF checkpoint (tiny LLaMA)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from test_capture_cli import base_args, capture, files, llama_dir  # noqa: E402, F401  (fixtures)

from gradforensics.replay import data  # noqa: E402
from gradforensics.store.reader import open_store  # noqa: E402

pytestmark = pytest.mark.slow       # the tiny LLaMA and its tokenizer are built first (4 s)


def test_capture_logits_auto_equals_logsumexp_of_the_lm_head(tmp_path, llama_dir, files, capsys):  # noqa: F811
    out = tmp_path / "l.zarr"
    rc, err = capture(*base_args(llama_dir, files, out, "--tensors", "*.layers.1.mlp.down_proj.weight",
                                 "--logits"), capsys=capsys)
    assert rc == 0, err
    s = open_store(out)
    model = transformers.LlamaForCausalLM.from_pretrained(llama_dir, local_files_only=True).eval()
    tok = transformers.AutoTokenizer.from_pretrained(llama_dir, local_files_only=True)
    srcs = data.parse_sources([f"en={files['en']}", f"zh={files['zh']}"])
    batches = data.load_batches(srcs, tok, seq_len=32, batch_size=2, n_batches=3, seed=0)
    want = {k: [] for k in ("logz_mean", "logz_max", "logit_max", "logit_mean")}
    for j in range(3):
        for src in ("en", "zh"):
            with torch.no_grad():
                z = model(input_ids=batches[src][j]["input_ids"]).logits.double()
            lz = torch.logsumexp(z, -1)
            for k, v in (("logz_mean", lz.mean()), ("logz_max", lz.max()), ("logit_max", z.max()),
                         ("logit_mean", z.mean())):
                want[k].append(float(v))
    for k, v in want.items():
        np.testing.assert_allclose(s.read(f"logits/lm_head/{k}"), v, rtol=1e-5, atol=1e-5, err_msg=k)
    norms = model.lm_head.weight.detach().double().norm(dim=1).numpy()
    np.testing.assert_allclose(s.read("logits/lm_head/row_norm_ratio"), norms.mean() / np.median(norms), rtol=1e-5)


def test_capture_logits_glob_that_matches_nothing_is_one_line(tmp_path, llama_dir, files, capsys):  # noqa: F811
    rc, err = capture(*base_args(llama_dir, files, tmp_path / "x.zarr", "--logits", "nope*"), capsys=capsys)
    assert rc == 2 and "logits: glob 'nope*' matches no module" in err and err.count("\n") == 1
