"""``gradforensics demo --out DIR``: train a tiny transformer with planted trouble, capture, analyze, report."""

from __future__ import annotations

import argparse

__all__ = ["DEMO_RECORDED", "add_arguments", "run"]

#: What the demo records into ``--out`` that costs a run to redo: replaced only with ``--overwrite``.
DEMO_RECORDED = ("checkpoint", "dump.zarr")



def add_arguments(p: argparse.ArgumentParser) -> None:
    from gradforensics.commands import output, threads

    output.add_out(p, "directory for the checkpoint, the data, the store and the report", default="gradforensics-demo")
    p.add_argument("--seed", type=int, default=0, help="seed of the data, the model and the replay")
    threads.add_argument(p)
    output.add_overwrite(p, "the checkpoint and the store (dump.zarr)")
    output.add_quiet(p)


def run(args: argparse.Namespace) -> int:
    from gradforensics._extras import require_extra

    require_extra("torch", "the demo")
    require_extra("transformers", "the demo")
    import sys

    from gradforensics import demo
    from gradforensics.commands import output
    from gradforensics.commands.report import print_top

    with output.out_dir(args.out, "demo", stores=DEMO_RECORDED, overwrite=args.overwrite):
        res = demo.run(args.out, seed=args.seed, threads=args.threads, log=None if args.quiet else sys.stdout)
    t = res.timings
    print(f"done in {t['total_s']:.0f} s (train {t['train_s']:.0f} s, capture {t['capture_s']:.0f} s, "
          f"analyze {t['analyze_s']:.0f} s, report {t['report_s']:.0f} s); store: {res.store}")
    print_top(res.findings, res.paths)
    print(f"open {res.paths['html']} in a browser.")
    return 0
