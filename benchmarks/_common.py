"""What the benchmarks that run each measurement in a child process share."""

from __future__ import annotations

import argparse
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["findings_digest", "parse_or_child"]


def findings_digest(f: Any) -> str:
    """SHA-256 of every table (CSV, full precision), every series' bytes and every flag of the findings."""
    h = hashlib.sha256()
    for name in sorted(f.results):
        res = f.results[name]
        h.update(name.encode() + res.table.to_csv(index=False, float_format="%.17g").encode())
        for k in sorted(res.series):
            h.update(k.encode() + np.ascontiguousarray(res.series[k]).tobytes())
    h.update(json.dumps([fl.to_dict() for fl in f.flags], sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


def parse_or_child(ap: argparse.ArgumentParser, child: Callable[[argparse.Namespace], None],
                   verb: bool = False) -> tuple[argparse.Namespace, Path] | None:
    """Parse the command line with the hidden ``--child`` / ``--store`` arguments of a measurement.

    A child (``--child``, a verb when *verb*) runs *child* and returns None; the parent
    gets its arguments and ``--dir``, created.
    """
    if verb:
        ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    else:
        ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--store", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return None
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    return args, root
