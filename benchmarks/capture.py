"""Capture overhead on CPU: plain fwd+bwd vs fwd+bwd+record (full dump, sketch), and store write speed.

Run::

    OMP_NUM_THREADS=1 python benchmarks/capture.py            # prints the table
    python benchmarks/capture.py --json capture.json          # and writes the figures

A GPT-2-style model (4 layers, hidden 256, 4 heads, vocab 8192, context 128,
random init) trains with SGD on random tokens.  Three modes run in blocks of
``--steps`` steps, the cycle repeated ``--repeats`` times (A B C A B C), so
that slow drifts of a shared machine hit every mode alike:

* ``plain``:  forward + backward + optimizer step;
* ``full``:   the same + ``rec.record()`` of every 2-D weight, heads auto;
* ``sketch``: the same + ``rec.record()`` with ``sketch=1024`` (sketches only).

``--sketch-paths`` measures instead where a countsketch is computed: on the
gradient's device (``sketch_on="device"``, the default: only ``k`` floats per head
cross to the host) or on the host (``sketch_on="host"``: the whole gradient is
copied, then sketched by the writer thread): records/s and bytes copied to the
host per record, side by side, on CUDA when there is one (the same script runs
unchanged on the CPU).

Per mode we report the median step time and the *amortised* time (the block's
wall time including the final flush and close, per step).  Then the store's
write throughput (StoreWriter, Zarr and HDF5, no compression) is measured
against ``numpy.save`` of the same arrays to the same disk, side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np


def build(args: argparse.Namespace) -> Any:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=args.vocab, n_embd=args.hidden, n_layer=args.layers, n_head=args.heads,
                     n_positions=args.seq, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def run_block(model: Any, opt: Any, mode: str, args: argparse.Namespace, path: Path) -> dict[str, float]:
    import torch

    import gradforensics as gf

    rec = None
    if mode == "full":
        rec = gf.Recorder(path, model=model, sources=["a", "b"], heads="auto", overwrite=True)
    elif mode == "sketch":
        rec = gf.Recorder(path, model=model, sources=["a", "b"], heads="auto", sketch=args.k, overwrite=True)
    gen = torch.Generator().manual_seed(1)
    times = []
    t_block, cpu_block = time.perf_counter(), time.process_time()
    for i in range(args.steps):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if rec is not None:
            rec.record(step=i, loss=loss, source="ab"[i % 2], n_samples=args.batch)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    if rec is not None:
        rec.close()
    total = time.perf_counter() - t_block
    cpu = time.process_time() - cpu_block       # all threads of the process, writer included
    return {"median_s": statistics.median(times[1:]), "amortised_s": total / args.steps,
            "cpu_s": cpu / args.steps}


def write_throughput(grads: dict[str, np.ndarray], n: int, root: Path, repeats: int = 3) -> dict[str, float]:
    """MB/s of StoreWriter (zarr, hdf5; chunk checksums on and off) and of numpy.save.

    Same arrays, same disk; the variants run interleaved *repeats* times and the
    median is reported, so a slow spell of the shared machine hits all alike.
    """
    from gradforensics.store.layout import LayoutPolicy
    from gradforensics.store.schema import new_meta
    from gradforensics.store.writer import Row, StoreWriter

    nbytes = sum(g.nbytes for g in grads.values()) * n
    speeds: dict[str, list[float]] = {}
    npy = root / "npy"
    npy.mkdir(exist_ok=True)
    for _ in range(repeats):
        for kind, suffix in (("zarr", ".zarr"), ("hdf5", ".h5")):
            for checks in (True, False):
                key = f"{kind}_MBps" if checks else f"{kind}_nochecksum_MBps"
                _remove(root / f"tp{suffix}")     # deleting the last run's store is not writing: untimed
                t0 = time.perf_counter()
                w = StoreWriter(root / f"tp{suffix}", new_meta(["a"], "training"), overwrite=True,
                                policy=LayoutPolicy(checksums=checks))
                for i in range(n):
                    rows = {f"grads/{k}": Row(v) for k, v in grads.items()}
                    rows["batches/step"] = Row(np.asarray(i, np.int64))
                    w.append(rows)
                w.close()
                speeds.setdefault(key, []).append(nbytes / (time.perf_counter() - t0) / 1e6)
        t0 = time.perf_counter()
        for i in range(n):
            for j, v in enumerate(grads.values()):
                np.save(npy / f"{i}_{j}.npy", v)
        speeds.setdefault("numpy_save_MBps", []).append(nbytes / (time.perf_counter() - t0) / 1e6)
    out = {"bytes": float(nbytes), **{k: statistics.median(v) for k, v in speeds.items()}}
    for kind in ("zarr", "hdf5"):
        out[f"{kind}_checksum_cost"] = out[f"{kind}_nochecksum_MBps"] / out[f"{kind}_MBps"]
    return out


def _remove(p: Path) -> None:
    import shutil

    if p.is_dir():
        shutil.rmtree(p)
    elif p.exists():
        p.unlink()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--k", type=int, default=1024)
    p.add_argument("--dir", default=None, help="where stores go (default: a temporary directory)")
    p.add_argument("--json", default=None, help="also write the figures here")
    p.add_argument("--write-only", action="store_true", help="only the store write throughput (no training blocks)")
    p.add_argument("--sketch-paths", action="store_true",
                   help="only host vs device sketching: records/s and bytes to the host per record")
    args = p.parse_args(argv)
    if args.write_only:
        return write_only(args)
    if args.sketch_paths:
        return sketch_paths(args)

    import torch

    model = build(args)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    n_params = sum(q.numel() for q in model.parameters())
    grad_bytes = sum(q.numel() * 4 for q in model.parameters() if q.ndim == 2)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        res: dict[str, list[dict[str, float]]] = {"plain": [], "full": [], "sketch": []}
        run_block(model, opt, "plain", argparse.Namespace(**{**vars(args), "steps": 3}), root / "w.zarr")  # warm-up
        for r in range(args.repeats):
            for mode in res:
                res[mode].append(run_block(model, opt, mode, args, root / f"{mode}{r}.zarr"))
        ids = torch.randint(0, args.vocab, (args.batch, args.seq))
        model(input_ids=ids, labels=ids).loss.backward()
        grads = {n: q.grad.detach().numpy().copy() for n, q in model.named_parameters() if q.ndim == 2}
        tp = write_throughput(grads, max(8, args.steps // 2), root, args.repeats)
    med = {m: statistics.median(x["median_s"] for x in v) for m, v in res.items()}
    amo = {m: statistics.median(x["amortised_s"] for x in v) for m, v in res.items()}
    cpu = {m: statistics.median(x["cpu_s"] for x in v) for m, v in res.items()}
    figures = {
        "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores (shared)", "torch": torch.__version__, "n_params": n_params,
        "grad_bytes_per_record": grad_bytes, "config": {k: v for k, v in vars(args).items() if k not in ("json", "dir")},
        "load_average": os.getloadavg(), "median_step_s": med, "amortised_step_s": amo, "cpu_step_s": cpu,
        "ratio_median": {m: med[m] / med["plain"] for m in ("full", "sketch")},
        "ratio_amortised": {m: amo[m] / amo["plain"] for m in ("full", "sketch")},
        "ratio_cpu": {m: cpu[m] / cpu["plain"] for m in ("full", "sketch")},
        "write": tp, "write_ratio_vs_numpy_save": {k: tp[f"{k}_MBps"] / tp["numpy_save_MBps"] for k in ("zarr", "hdf5")},
        "checksum_cost": {k: tp[f"{k}_checksum_cost"] for k in ("zarr", "hdf5")},
    }
    print(f"model: GPT-2-style, {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, batch "
          f"{args.batch}x{args.seq}; {n_params / 1e6:.1f} M params, {grad_bytes / 1e6:.1f} MB of 2-D grads a record")
    print(f"{'mode':8s} {'median step':>12s} {'x plain':>8s} {'amortised':>10s} {'x plain':>8s} "
          f"{'CPU/step':>9s} {'x plain':>8s}")
    for m in res:
        print(f"{m:8s} {med[m] * 1e3:10.0f}ms {med[m] / med['plain']:8.2f} {amo[m] * 1e3:8.0f}ms "
              f"{amo[m] / amo['plain']:8.2f} {cpu[m] * 1e3:7.0f}ms {cpu[m] / cpu['plain']:8.2f}")
    print(f"load average during the run: {os.getloadavg()[1]:.1f} (1 = one busy core)")
    print_write(tp)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return figures


def print_write(tp: dict[str, float]) -> None:
    print(f"write ({tp['bytes'] / 1e6:.0f} MB each, median of interleaved repeats): "
          f"numpy.save {tp['numpy_save_MBps']:.0f} MB/s")
    for kind in ("zarr", "hdf5"):
        print(f"  {kind:5s} checksummed {tp[f'{kind}_MBps']:6.0f} MB/s ({tp[f'{kind}_MBps'] / tp['numpy_save_MBps']:.2f}x "
              f"numpy.save), without checksums {tp[f'{kind}_nochecksum_MBps']:6.0f} MB/s: checksums cost "
              f"{tp[f'{kind}_checksum_cost']:.2f}x")


def write_only(args: argparse.Namespace) -> dict[str, Any]:
    """The write benchmark alone, on GPT-2-style gradient shapes (random values)."""
    import torch

    model = build(args)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    model(input_ids=ids, labels=ids).loss.backward()
    grads = {n: q.grad.detach().numpy().copy() for n, q in model.named_parameters() if q.ndim == 2}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        tp = write_throughput(grads, max(8, args.steps // 2), Path(tmp), args.repeats)
    print_write(tp)
    if args.json:
        Path(args.json).write_text(json.dumps({"write": tp}, indent=2))
    return {"write": tp}


def sketch_paths(args: argparse.Namespace) -> dict[str, Any]:
    """Sketch-only capture, sketched on the device vs on the host: records/s and bytes to the host a record."""
    import torch

    import gradforensics as gf

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build(args).to(device)
    gen = torch.Generator(device="cpu").manual_seed(1)
    ids = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(device) for _ in range(4)]
    rates: dict[str, list[float]] = {"host": [], "device": []}
    per_record: dict[str, float] = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for r in range(args.repeats + 1):          # the first cycle warms up (allocator, hashes) and is dropped
            for where in rates:
                rec = gf.Recorder(Path(tmp) / f"{where}{r}.zarr", model=model, sources=["a"], sketch=args.k,
                                  sketch_on=where, overwrite=True)
                t0 = time.perf_counter()
                for i in range(args.steps):
                    model(input_ids=ids[i % 4], labels=ids[i % 4]).loss.backward()
                    rec.record(step=i, loss=0.0, source="a", n_samples=args.batch)
                    model.zero_grad(set_to_none=True)
                rec.close()
                if device == "cuda":
                    torch.cuda.synchronize()
                if r:
                    rates[where].append(args.steps / (time.perf_counter() - t0))
                per_record[where] = rec.host_bytes / args.steps
    out = {"device": device, "records_per_s": {w: statistics.median(v) for w, v in rates.items()},
           "host_bytes_per_record": per_record}
    print(f"sketch k={args.k}, {device}, {args.steps} records x {args.repeats} interleaved repeats:")
    for w in rates:
        print(f"  sketched on the {w:6s}: {out['records_per_s'][w]:7.2f} records/s, "
              f"{per_record[w] / 1e6:9.3f} MB to the host per record")
    print(f"  device / host: {out['records_per_s']['device'] / out['records_per_s']['host']:.2f}x the records/s, "
          f"{per_record['device'] / per_record['host']:.4f}x the bytes")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
