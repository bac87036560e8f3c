"""Named points where a writer can be held still, so that a test can kill it exactly there.

Inert unless the environment says otherwise: with ``GRADFORENSICS_PAUSE_AT=<point>`` (or
``<point>:<n>``, the *n*-th time the process passes that point; the first by default) the
process, on reaching it, writes its pid to the file named by ``GRADFORENSICS_PAUSE_FILE``
(when set) and sleeps until it is killed.  The tests of crash safety (``tests/test_store_kills.py``)
use it to SIGKILL a real writer process inside a window that would otherwise last a few
microseconds.  The points:

``store-creating``
    A new local store exists under its temporary name, identity written, not yet renamed into place.
``store-created``
    The store is at its path, before the writer's first commit.
``import-record``
    An import has written (and committed) its *n*-th record.
"""

from __future__ import annotations

import os
import time
from collections import Counter

__all__ = ["ENV_AT", "ENV_FILE", "pause_point"]

ENV_AT = "GRADFORENSICS_PAUSE_AT"
ENV_FILE = "GRADFORENSICS_PAUSE_FILE"
_passed: Counter[str] = Counter()


def pause_point(name: str) -> None:
    """Hold the process still at point *name* when ``GRADFORENSICS_PAUSE_AT`` names it (a no-op otherwise)."""
    want = os.environ.get(ENV_AT)
    if not want:
        return
    point, _, nth = want.partition(":")
    if point != name:
        return
    _passed[name] += 1
    if _passed[name] != (int(nth) if nth else 1):
        return
    where = os.environ.get(ENV_FILE)
    if where:
        with open(where + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(where + ".tmp", where)
    while True:            # until killed
        time.sleep(3600)
