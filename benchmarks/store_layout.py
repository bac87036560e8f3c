"""Choose the store's codecs and chunk size by measurement, on real gradients.

Real gradients come from a small GPT-2-style model (transformers, random init,
trained for a few steps on random tokens so the gradients are not those of step
0), one record per batch.  Every layout writes the same records through
:class:`gradforensics.store.StoreWriter` and reads them back with the Gram-pass
access pattern (all records x a slab of features); timings are side by side in
one run.  Output: a table of write MB/s, read MB/s, size ratio, per layout.

    python benchmarks/store_layout.py --records 32 --json out.json

``--short N`` measures instead the bytes on disk of a short capture (N records, fewer
than one chunk of records): a 24-layer LLaMA-shaped block stack (q/k/v/o in 8 heads, d =
128) captured through :class:`gradforensics.Recorder` as per-head sketches (k = 256) and
as full gradients, Zarr and HDF5; with ``--before DIR`` (an older ``gradforensics``
package) the same stores are written by both codes, side by side:

    python benchmarks/store_layout.py --short 32 --before /tmp/old
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np

from gradforensics.recording.encoding import encode
from gradforensics.store import LayoutPolicy, Row, StoreWriter
from gradforensics.store.layout import MiB
from gradforensics.store.reader import Store
from gradforensics.store.schema import new_meta


def real_gradients(n_records: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=4, n_embd=256, n_head=8, vocab_size=4096, n_positions=128)
    model = GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = []
    for i in range(n_records + 20):
        ids = torch.randint(0, cfg.vocab_size // (1 + i % 3), (8, 128))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if i >= 20:
            out.append({n: p.grad.detach().numpy().copy() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad()
    return out


def write(path: Path, recs: list[dict[str, np.ndarray]], dtype: str | None, compression: str,
          policy: LayoutPolicy) -> float:
    w = StoreWriter(path, new_meta(["a"], "replay"), overwrite=True, policy=policy)
    t0 = time.perf_counter()
    for g in recs:
        rows = {"batches/step": Row(np.asarray(0, np.int64)), "batches/loss": Row(np.asarray(0, np.float32)),
                "batches/mixture": Row(np.ones(1, np.float32)), "batches/n_samples": Row(np.asarray(1, np.int32))}
        for name, a in g.items():
            data, enc = encode(a, dtype)
            rows[f"grads/{name}"] = Row(data, {"encoding": enc}, compression=compression)
        w.append(rows)
    w.close()
    return time.perf_counter() - t0


def read_pass(path: Path) -> float:
    import dask

    s = Store(path)
    t0 = time.perf_counter()
    parts = [s.grad(t, slab_bytes=64 * MiB).sum(axis=0) for t in s.grads]
    dask.compute(*parts, scheduler="threads", num_workers=2)
    return time.perf_counter() - t0


def _on_disk(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else p.stat().st_size


def short_sizes(records: int, root: Path) -> dict[str, list[float]]:
    """``{"sketch .zarr": [MB on disk, MB of data], ...}`` of a short capture of *records* records."""
    import gradforensics as gf

    heads = {"*.q_proj.weight": 8, "*.k_proj.weight": 8, "*.v_proj.weight": 8,
             "*.o_proj.weight": {"heads": 8, "axis": 1}}
    d, shapes = 128, {}
    for L in range(24):
        shapes.update({f"model.layers.{L}.self_attn.{p}_proj.weight": (d, d) for p in "qkvo"})
        shapes.update({f"model.layers.{L}.mlp.{p}_proj.weight": (2 * d, d) for p in ("gate", "up")})
        shapes[f"model.layers.{L}.mlp.down_proj.weight"] = (d, 2 * d)
    out = {}
    for kind, kw in (("sketch", {"sketch": 256}), ("full", {})):
        for suffix in (".zarr", ".h5"):
            rng = np.random.default_rng(0)
            p = root / f"{kind}{suffix}"
            with gf.Recorder(p, sources=["a", "b"], heads=heads, overwrite=True, **kw) as rec:
                for i in range(records):
                    rec.record(step=i, loss=2.0, source="ab"[i % 2], n_samples=32,
                               grads={n: rng.standard_normal(s, dtype=np.float32) for n, s in shapes.items()})
            store = Store(p)
            group = "sketch/" if kind == "sketch" else "grads/"
            data = sum(int(np.prod(a.shape)) * 4 for n, a in store.arrays.items() if n.startswith(group))
            out[f"{kind} {suffix}"] = [_on_disk(p) / 1e6, data / 1e6]
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    return out


def short_main(args: argparse.Namespace) -> None:
    import subprocess
    import sys

    root = Path(tempfile.mkdtemp(prefix="gf-short-"))
    try:
        codes = {"after": None, **({"before": args.before} if args.before else {})}
        got = {}
        for code, pkg in codes.items():
            env = dict(os.environ, PYTHONPATH=str(pkg) if pkg else os.environ.get("PYTHONPATH", ""))
            cmd = [sys.executable, __file__, "--short-child", str(args.short), "--dir", str(root / code)]
            got[code] = json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout)
        print(f"{args.short} records: MB on disk (MB of data)")
        for key in got["after"]:
            cells = "   ".join(f"{code} {v[key][0]:7.1f} ({v[key][1]:.1f}, {v[key][0] / v[key][1]:.2f}x)"
                               for code, v in got.items())
            print(f"{key:<14} {cells}")
        if args.json:
            Path(args.json).write_text(json.dumps(got, indent=2))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json")
    ap.add_argument("--short", type=int, default=None, metavar="N", help="bytes on disk of an N-record capture")
    ap.add_argument("--before", type=Path, default=None, help="with --short: an older package's directory")
    ap.add_argument("--short-child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dir", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.short_child is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
        print(json.dumps(short_sizes(args.short_child, args.dir)))
        return
    if args.short is not None:
        short_main(args)
        return
    recs = real_gradients(args.records)
    raw = sum(a.nbytes for g in recs for a in g.values())
    zeros = np.mean([np.mean(a == 0) for g in recs for a in g.values()])
    print(f"{args.records} records of real GPT-2-style gradients, {raw / MiB:.0f} MiB f32, "
          f"{len(recs[0])} tensors, exact zeros {zeros:.1%}")
    layouts = [
        ("zarr f32 none 8MiB", ".zarr", None, "none", LayoutPolicy()),
        ("zarr f32 zstd1+shuffle", ".zarr", None, "zstd", LayoutPolicy()),
        ("zarr f32 zstd1+bitshuffle", ".zarr", None, "bitshuffle", LayoutPolicy()),
        ("zarr bf16-as-uint16 none", ".zarr", "bfloat16", "none", LayoutPolicy()),
        ("zarr bf16-as-uint16 zstd1+shuffle", ".zarr", "bfloat16", "zstd", LayoutPolicy()),
        ("zarr f32 none 2MiB chunks", ".zarr", None, "none", LayoutPolicy(chunk_bytes=2 * MiB)),
        ("zarr f32 none 32MiB chunks", ".zarr", None, "none", LayoutPolicy(chunk_bytes=32 * MiB)),
        ("hdf5 f32 none", ".h5", None, "none", LayoutPolicy()),
        ("hdf5 f32 gzip1+shuffle", ".h5", None, "gzip", LayoutPolicy()),
        ("hdf5 bf16-as-uint16 none", ".h5", "bfloat16", "none", LayoutPolicy()),
    ]
    tmp = Path(tempfile.mkdtemp(prefix="gf-layout-"))
    rows = []
    try:
        # raw numpy.save of the same bytes: the write floor
        t0 = time.perf_counter()
        for i, g in enumerate(recs):
            np.save(tmp / f"r{i}.npy", np.concatenate([a.ravel() for a in g.values()]))
        t_np = time.perf_counter() - t0
        print(f"numpy.save floor: {raw / MiB / t_np:.0f} MB/s")
        for label, suffix, dtype, comp, pol in layouts:
            best_w = best_r = np.inf
            for _ in range(args.repeat):
                p = tmp / f"s{suffix}"
                best_w = min(best_w, write(p, recs, dtype, comp, pol))
                best_r = min(best_r, read_pass(p))
                size = sum(f.stat().st_size for f in p.rglob("*")) if p.is_dir() else p.stat().st_size
                shutil.rmtree(p) if p.is_dir() else p.unlink()
            rows.append({"layout": label, "write_MBps": raw / MiB / best_w, "read_MBps": raw / MiB / best_r,
                         "size_ratio_vs_f32": raw / size, "write_vs_numpy_save": best_w / t_np})
            r = rows[-1]
            print(f"{label:<36} write {r['write_MBps']:7.0f} MB/s ({r['write_vs_numpy_save']:.2f}x np.save)  "
                  f"read {r['read_MBps']:7.0f} MB/s  size {r['size_ratio_vs_f32']:.2f}x smaller")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"raw_MiB": raw / MiB, "numpy_save_MBps": raw / MiB / t_np,
                                               "zero_share": float(zeros), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
