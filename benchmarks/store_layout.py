"""Choose the store's codecs and chunk size by measurement, on real gradients.

Real gradients come from a small GPT-2-style model (transformers, random init,
trained for a few steps on random tokens so the gradients are not those of step
0), one record per batch.  Every layout writes the same records through
:class:`gradforensics.store.StoreWriter` and reads them back with the Gram-pass
access pattern (all records x a slab of features); timings are side by side in
one run.  Output: a table of write MB/s, read MB/s, size ratio, per layout.

    python benchmarks/store_layout.py --records 32 --json out.json
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

from gradforensics.recording.recorder import encode
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
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
