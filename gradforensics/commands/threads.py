"""``--threads``: the option of every verb that runs a model (demo, capture, whatif)."""

from __future__ import annotations

import argparse

__all__ = ["add_argument", "threads_value"]



def threads_value(text: str) -> int | None:
    """argparse type of ``--threads``: ``auto`` -> ``None``, else a positive integer."""
    from gradforensics.errors import SpecError
    from gradforensics.replay.threads import parse_threads

    try:
        return parse_threads(text)
    except SpecError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--threads ")) from None


def add_argument(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument("--threads", type=threads_value, default=None, metavar="N",
                   help="torch intra-op threads: auto (default): 1 for a model under 20M parameters unless "
                        "OMP_NUM_THREADS is set, else torch's own default; or a number")
