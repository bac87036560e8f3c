"""How many intra-op threads torch uses for the work at hand.

torch starts with one intra-op thread per core.  For the small models that the
demo, the tests and most replays of a what-if train, that is much slower than
one thread as soon as anything else runs on the machine: measured on a shared
2-core machine with two CPU-bound processes beside it, the demo's 2-layer model
trained at 0.4-0.8 steps/s on 2 threads and 7-9 steps/s on 1 (the threads wait
for each other at every tiny matmul).  Large models, whose matmuls are big
enough to split, gain from the default.

So: a model below :data:`SMALL_MODEL_PARAMS` parameters runs on one thread,
unless the user chose a number (``--threads N``, ``threads=N``, or
``OMP_NUM_THREADS`` in the environment); a larger one keeps torch's default.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from gradforensics.errors import SpecError

__all__ = ["SMALL_MODEL_PARAMS", "choose_threads", "for_model", "n_parameters", "parse_threads", "torch_threads"]


#: Below this many parameters a model trains and replays on one intra-op thread by default.
SMALL_MODEL_PARAMS = 20_000_000


def parse_threads(value: str | int | None) -> int | None:
    """``"auto"`` / ``None`` -> ``None`` (decide from the model); a positive integer -> itself."""
    if value is None or value == "auto":
        return None
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise SpecError(f"--threads {value!r}: expected auto or a positive integer.") from None
    if n < 1:
        raise SpecError(f"--threads {value!r}: expected auto or a positive integer.")
    return n


def choose_threads(n_params: int, requested: int | None = None) -> int | None:
    """The intra-op thread count for a model of *n_params* parameters; ``None`` = leave torch as it is."""
    if requested is not None:
        return requested
    if os.environ.get("OMP_NUM_THREADS"):
        return None                      # the user's choice, and torch has already read it
    return 1 if n_params < SMALL_MODEL_PARAMS else None


def n_parameters(model: Any) -> int:
    return sum(int(p.numel()) for p in model.parameters())


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run the block on *n* intra-op threads (``None``: unchanged); the previous count is restored after."""
    if n is None:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def for_model(model: Any, requested: int | None = None) -> contextlib.AbstractContextManager[None]:
    """:func:`torch_threads` with the count :func:`choose_threads` picks for *model*."""
    return torch_threads(choose_threads(n_parameters(model), requested))
