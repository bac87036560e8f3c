"""``gradforensics inspect STORE``: what the store holds.

Names in a store are someone else's strings: every line is printed through
:func:`gradforensics._text.terminal`, so a name holding an escape sequence is
shown (``\\x1b[31m``) instead of acting on the reader's terminal.
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from gradforensics._format import fmt_bytes
from gradforensics._text import terminal

if TYPE_CHECKING:
    from gradforensics.store.reader import Store

__all__ = ["add_arguments", "megatron_lines", "run", "summarize", "summary_lines"]



def add_arguments(p: argparse.ArgumentParser) -> None:
    from gradforensics.commands import storage as storage_flags

    p.add_argument("store", help="a *.zarr directory or *.h5 file written by gradforensics, or a Zarr store at an "
                                 "fsspec URL (s3://bucket/dump.zarr)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    storage_flags.add_argument(p)


def summarize(store: Store) -> dict:
    def entry(info):
        return {"shape": list(info.shape), "dtype": info.attrs.get("source_dtype", info.dtype),
                "encoding": info.encoding, "heads": info.heads, "role": info.attrs.get("role") or None,
                "experts": int(info.attrs["experts"]) if info.attrs.get("experts") else None,
                "bytes_on_disk": info.nbytes_stored, "bytes_of_data": info.nbytes,
                "compression_ratio": round(info.compression_ratio, 3) if info.nbytes_stored else None}

    mix = store.batches()["mixture"] if store.n_records else None
    shares = {s: float(mix[:, i].mean()) for i, s in enumerate(store.sources)} if mix is not None else {}
    writer = store.writer
    return {
        "writer": None if writer is None else {"host": writer.host, "pid": writer.pid, "since": writer.started,
                                               "describe": writer.describe()},
        "path": store.path, "backend": store.kind, "schema": store.meta.schema, "mode": store.mode,
        "framework": store.meta.framework, "model": store.meta.model, "created": store.meta.created,
        "records": store.n_records, "records_per_chunk": store.meta.records_per_chunk,
        "sources": shares, "weight_snapshots": store.meta.n_weights,
        "tensors": {k: entry(v) for k, v in store.grads.items()},
        "sketches": {k: {**entry(v), "k": v.attrs.get("k"), "method": v.attrs.get("method"),
                         "seed": v.attrs.get("seed")} for k, v in store.sketches.items()},
        "activations": store.act_modules,
        "attention": {m: store.arrays[f"attn/{m}/max_logit"].shape[1] for m in store.attn_modules
                      if f"attn/{m}/max_logit" in store.arrays},
        "analysis": sorted({n.split("/")[1] for n in store.arrays if n.startswith("analysis/")}),
        "analysis_note": store.analysis_note,
        "curvature_rows": store.arrays["curvature/eigenvalues"].shape[0] if store.has("curvature/eigenvalues") else 0,
        "optim_tensors": store.arrays["optim/summary"].shape[0] if store.has("optim/summary") else 0,
        "run_logs": _run_logs(store.meta.extra.get("import")),
        "megatron": _megatron(store.meta.extra.get("import")),
    }


def _megatron(imported: object) -> dict | None:
    """What a Megatron-LM import used: the layout and where it came from, the run's arguments, the vocabulary."""
    if not isinstance(imported, dict) or imported.get("format") != "megatron":
        return None
    return {k: imported.get(k) for k in ("layout", "layout_from", "run_args", "vocab", "dense")}


def megatron_lines(m: dict) -> list[str]:
    """The ``megatron`` lines of :func:`summary_lines`."""
    args = m.get("run_args")
    where = args.get("source") if isinstance(args, dict) else args
    out = [f"megatron layout: {m.get('layout')} (from {m.get('layout_from') or 'the file names'}); "
           f"the run's saved arguments: {where or '-'}"]
    v = m.get("vocab")
    if isinstance(v, dict):
        out.append(f"  vocabulary: {v.get('size')} tokens, {v.get('rows_dropped')} padded rows dropped "
                   f"(padded to {v.get('padded')}; size from {v.get('from')})" if v.get("size") is not None else
                   f"  vocabulary: padded to {v.get('padded')} rows, kept (true size {v.get('from')})")
    if m.get("dense"):
        out.append(f"  dense layers: {m['dense']}")
    return out


def _run_logs(imported: object) -> dict | None:
    """What an import given ``--logs`` recorded of the join (:mod:`gradforensics.importing.logjoin`)."""
    if not isinstance(imported, dict) or not isinstance(imported.get("logs"), dict):
        return None
    return {k: imported.get(k) for k in ("logs", "n_skipped", "skipped_steps", "grad_norm_check")}


def run_log_lines(r: dict) -> list[str]:
    """The ``run logs`` lines of :func:`summary_lines`."""
    out = ["run logs: " + ", ".join(f"{k} <- {v!r}" for k, v in (r.get("logs") or {}).items())]
    n = r.get("n_skipped") or 0
    if n:
        steps = r.get("skipped_steps") or []
        out.append(f"  {n} iterations skipped by the loss scaler (batches/skipped; not findings): steps "
                   f"{steps[:10]}{' ...' if n > 10 else ''}")
    c = r.get("grad_norm_check")
    if isinstance(c, dict):
        verdict = ("agrees" if c.get("agree") else
                   "DISAGREES: a shard, a pipeline stage or the loss scale is missing or doubled in the dump")
        out.append(f"  grad norm: dump / logged, median {c.get('median_ratio'):.6f}, worst {c.get('worst_ratio'):.6f} "
                   f"over {c.get('records')} records: {verdict} (tolerance {c.get('tolerance')})")
    return out


def run(args: argparse.Namespace) -> int:
    from gradforensics.commands import storage as storage_flags
    from gradforensics.store.reader import Store

    s = summarize(Store(storage_flags.location(args, args.store)))
    if args.json:
        print(json.dumps(s, indent=2))        # JSON escapes control characters itself
        return 0
    for line in summary_lines(s):
        print(terminal(line))                 # names come from the store: escape sequences are shown, not sent
    return 0


def summary_lines(s: dict) -> list[str]:
    """The human-readable summary, one string per line (not yet made safe for a terminal)."""
    out = []
    if s.get("writer"):
        out.append(f"being written by {s['writer']['describe']}; {s['records']} records committed so far")
    out += [f"{s['path']}  ({s['backend']}, schema {s['schema']}, mode {s['mode']}, framework {s['framework']})"]
    if s["model"]:
        out.append("model:   " + ", ".join(f"{k}={v}" for k, v in s["model"].items()))
    out.append(f"records: {s['records']}  (chunks of {s['records_per_chunk']}), "
               f"weight snapshots: {s['weight_snapshots']}")
    out.append("sources: " + (", ".join(f"{k} {v:.0%}" for k, v in s["sources"].items()) or "-"))
    for title, group in (("tensors", s["tensors"]), ("sketches", s["sketches"])):
        if not group:
            continue
        out.append(f"{title} ({len(group)}): shape dtype, bytes on disk for the bytes of data they hold "
                   f"(x: data / disk; above 1 compressed, below 1 partly filled chunks)")
        width = max(len(terminal(k)) for k in group)
        for name, e in group.items():
            heads = f" heads={e['heads']}" + (f" role={e['role']}" if e["role"] else "") if e["heads"] else ""
            heads += f" experts={e['experts']}" if e.get("experts") else ""
            extra = f" k={e['k']} {e['method']}" if "k" in e else ""
            ratio = "-" if e["compression_ratio"] is None else f"{e['compression_ratio']:.2f}x"
            out.append(f"  {terminal(name):<{width}}  {tuple(e['shape'])} {e['dtype']}{heads}{extra}  "
                       f"{fmt_bytes(e['bytes_on_disk'])} on disk for {fmt_bytes(e['bytes_of_data'])}, {ratio}")
    if s.get("megatron"):
        out += megatron_lines(s["megatron"])
    if s.get("run_logs"):
        out += run_log_lines(s["run_logs"])
    if s["activations"]:
        out.append(f"activations ({len(s['activations'])}): " + ", ".join(s["activations"]))
    if s.get("curvature_rows") or s.get("optim_tensors"):
        out.append(f"curvature: {s['curvature_rows']} Lanczos rows; optimizer state: {s['optim_tensors']} tensors "
                   "(capture --curvature)")
    if s.get("attention"):
        out.append(f"attention statistics ({len(s['attention'])} modules): "
                   + ", ".join(f"{terminal(m)} ({h} heads)" for m, h in s["attention"].items()))
    if s["analysis"]:
        out.append("analysis results: " + ", ".join(s["analysis"]))
    if s.get("analysis_note"):
        out.append(terminal(s["analysis_note"]))
    return out
