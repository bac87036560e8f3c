"""``gradforensics demo --out DIR``: train a tiny transformer with planted trouble, capture, analyze, report."""

from __future__ import annotations

import argparse

__all__ = ["add_arguments", "run"]



def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="gradforensics-demo", metavar="DIR",
                   help="directory for the checkpoint, the store and the report (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the data, the model and the replay (default: 0)")
    from gradforensics.commands import threads

    threads.add_argument(p)


def run(args: argparse.Namespace) -> int:
    from gradforensics._extras import require_extra

    require_extra("torch", "the demo")
    require_extra("transformers", "the demo")
    from gradforensics import demo
    from gradforensics.commands.report import print_top

    res = demo.run(args.out, seed=args.seed, threads=args.threads)
    t = res.timings
    print(f"done in {t['total_s']:.0f} s (train {t['train_s']:.0f} s, capture {t['capture_s']:.0f} s, "
          f"analyze {t['analyze_s']:.0f} s, report {t['report_s']:.0f} s); store: {res.store}")
    print_top(res.findings, res.paths)
    print(f"open {res.paths['html']} in a browser.")
    return 0
