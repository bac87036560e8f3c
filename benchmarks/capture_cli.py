"""``gradforensics capture`` end to end on a tiny LLaMA: records per second and bytes per record.

Run::

    OMP_NUM_THREADS=1 python benchmarks/capture_cli.py                 # prints the table
    python benchmarks/capture_cli.py --json capture_cli.json           # and writes the figures

A random-init LLaMA-style model (``--layers`` layers, hidden ``--hidden``,
``--heads`` query heads and half as many key/value heads, a BPE tokenizer with
``--vocab`` tokens trained here) is saved with ``save_pretrained``; synthetic
text sources are written as ``.txt`` / ``.jsonl``.  Then the CLI path runs in
this process (``gradforensics.cli.main(["capture", ...])``) once per mode:

* ``full``     every 2-D weight, float32, heads auto;
* ``full-bf16`` the same, ``--dtype bf16``;
* ``sketch``   ``--sketch K`` only (per head for attention weights);
* ``plain``    the same batches through forward + backward, nothing recorded
  (the floor).

Records per second come from the store's own ``batches/time`` stamps (first
to last record, so model loading and tokenising are excluded), median over
``--repeats`` cycles of all modes; the CLI's whole wall time is reported too.  Bytes per record: the CLI's estimate (uncompressed)
and the store's size on disk divided by the records (the writer writes whole
chunks of ``R`` records, so with ``N`` not a multiple of ``R`` the last chunk is
padded on disk).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

WORDS = ["the", "of", "and", "model", "gradient", "layer", "head", "loss", "batch", "source", "data", "training",
         "step", "weight", "tensor", "norm", "update", "learning", "rate", "optimizer"]


def corpus(kind: str, n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    if kind == "en":
        return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 120))) for _ in range(n)]
    if kind == "zh":
        return ["".join(chr(0x4E00 + rng.randrange(400)) for _ in range(rng.randint(20, 160))) for _ in range(n)]
    return [" ".join(f"def f{rng.randrange(100)}(x): return x * {rng.randrange(100)} + y" for _ in range(8))
            for _ in range(n)]


def build(root: Path, args: argparse.Namespace) -> tuple[Path, dict[str, Path]]:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    ckpt = root / "llama"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=args.vocab, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus("en", 400, 0) + corpus("zh", 400, 1) + corpus("code", 200, 2), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(fast), hidden_size=args.hidden, intermediate_size=int(args.hidden * 8 / 3),
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=max(1, args.heads // 2), max_position_embeddings=args.seq_len,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(ckpt)
    fast.save_pretrained(ckpt)
    files = {"en": root / "en.txt", "zh": root / "zh.jsonl", "code": root / "code.jsonl"}
    files["en"].write_text("\n".join(corpus("en", 2000, 10)) + "\n", encoding="utf-8")
    for k in ("zh", "code"):
        files[k].write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in corpus(k, 2000, 11)),
                            encoding="utf-8")
    return ckpt, files


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size


def run_cli(ckpt: Path, files: dict[str, Path], out: Path, args: argparse.Namespace, extra: list[str]) -> dict[str, float]:
    import contextlib
    import io

    from gradforensics import cli
    from gradforensics.store.reader import open_store

    data_args = [a for k, v in files.items() for a in ("--data", f"{k}={v}")]
    argv = ["capture", str(ckpt), *data_args, "--out", str(out),
            "--batches-per-source", str(args.batches), "--batch-size", str(args.batch_size),
            "--seq-len", str(args.seq_len), *extra]
    err = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stderr(err):
        rc = cli.main(argv)
    wall = time.perf_counter() - t0
    if rc != 0:
        raise SystemExit(f"capture failed ({rc}): {err.getvalue()}")
    est = next(line for line in err.getvalue().splitlines() if line.startswith("estimate:"))
    store = open_store(out)
    t = store.batches()["time"]
    n = store.n_records
    per_record = sum(int(np.prod(a.shape[1:])) * np.dtype(a.dtype).itemsize for name, a in store.arrays.items()
                     if name.split("/")[0] in ("grads", "sketch", "batches"))
    return {"records": n, "records_per_s": (n - 1) / float(t[-1] - t[0]), "cli_wall_s": wall,
            "bytes_per_record": per_record, "disk_bytes_per_record": du(out) / n, "estimate_line": est}


def plain(ckpt: Path, files: dict[str, Path], args: argparse.Namespace) -> dict[str, float]:
    """The same batches through forward + backward, nothing recorded."""
    from gradforensics.replay import data
    from gradforensics.replay.checkpoint import load_checkpoint

    c = load_checkpoint(ckpt)
    srcs = data.parse_sources([f"{k}={v}" for k, v in files.items()])
    batches = data.load_batches(srcs, c.tokenizer, seq_len=args.seq_len, batch_size=args.batch_size,
                                n_batches=args.batches, seed=0)
    flat = [b for j in range(args.batches) for b in (batches[s][j] for s in batches)]
    t0 = time.perf_counter()
    for b in flat:
        c.model.zero_grad(set_to_none=True)
        c.loss_fn(c.model, b).backward()
    return {"records": len(flat), "records_per_s": len(flat) / (time.perf_counter() - t0),
            "n_params": sum(q.numel() for q in c.model.parameters())}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--batches", type=int, default=8, help="batches per source (3 sources)")
    p.add_argument("--k", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=2, help="cycles over the modes; records/s is the median")
    p.add_argument("--dir", default=None, help="where stores go (default: a temporary directory)")
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args(argv)

    import torch

    modes = {"full": [], "full-bf16": ["--dtype", "bf16"], "sketch": ["--sketch", str(args.k)]}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        ckpt, files = build(root, args)
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in ("plain", *modes)}
        for r in range(args.repeats):          # A B C D A B C D: slow drifts of a shared machine hit all modes
            runs["plain"].append(plain(ckpt, files, args))
            for mode, extra in modes.items():
                out = root / f"{mode}{r}.zarr"
                runs[mode].append(run_cli(ckpt, files, out, args, extra))
                shutil.rmtree(out)
        n_params = runs["plain"][0]["n_params"]
        res = {m: {**v[0], "records_per_s": statistics.median(x["records_per_s"] for x in v),
                   "records_per_s_runs": [x["records_per_s"] for x in v]} for m, v in runs.items()}
    figures = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.processor() or platform.machine()}, "
               f"{os.cpu_count()} cores (shared)", "torch": torch.__version__, "n_params": n_params,
               "load_average": os.getloadavg(),
               "config": {k: v for k, v in vars(args).items() if k not in ("json", "dir")}, "results": res}
    print(f"tiny LLaMA: {n_params / 1e6:.2f} M params, {args.layers} layers, hidden {args.hidden}, "
          f"{args.heads}/{max(1, args.heads // 2)} heads, vocab {args.vocab}; {len(files)} sources x {args.batches} batches of {args.batch_size}x{args.seq_len}")
    print(f"{'mode':10s} {'records/s':>10s} {'x plain':>8s} {'bytes/record':>14s} {'on disk/record':>15s} "
          f"{'CLI wall':>9s}")
    base = res["plain"]["records_per_s"]
    for mode, r in res.items():
        b = f"{r['bytes_per_record'] / 1e6:11.2f} MB" if "bytes_per_record" in r else f"{'-':>14s}"
        d = f"{r['disk_bytes_per_record'] / 1e6:12.2f} MB" if "disk_bytes_per_record" in r else f"{'-':>15s}"
        w = f"{r['cli_wall_s']:8.1f}s" if "cli_wall_s" in r else f"{'-':>9s}"
        print(f"{mode:10s} {r['records_per_s']:10.2f} {r['records_per_s'] / base:8.2f} {b} {d} {w}")
    print(f"load average during the run: {os.getloadavg()[1]:.1f} (1 = one busy core)")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return figures


if __name__ == "__main__":
    main()
