"""Thread counts and collection order for the parallel run (``-n 2 --dist loadfile``).

Every BLAS and torch pool runs one thread per test process unless the caller set
its own (``OMP_NUM_THREADS=...``): the tests' models are tiny, two processes share
two cores, and oversubscribed pools run 10-30x slower on a busy machine.  This runs
before any test module imports numpy or torch, which read the variables once.

The store-metadata fuzz is one long test file (~9 min on two cores): it goes first,
so one worker runs it while the other works through every other file, instead of
one worker finishing the fuzz alone at the end.

The quick lane (``python -m pytest -q -m "not slow"``) leaves out the tests marked ``slow``; the
healthy-store control that every analysis's contract class inherits
(:class:`gradforensics.testing.contracts.AnalysisContract`) builds and analyses several healthy stores
per analysis, so it is marked ``slow`` here, where the suite is collected.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import pytest  # noqa: E402

FIRST = ("test_store_fuzz.py",)
SLOW_CONTRACT_TESTS = ("test_healthy_store_raises_no_flag_above_half",)


@pytest.hookimpl(tryfirst=True)            # before ``-m`` deselects by marker
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    from gradforensics.testing.contracts import AnalysisContract

    for item in items:
        cls = getattr(item, "cls", None)
        if cls is not None and issubclass(cls, AnalysisContract) and \
                getattr(item, "originalname", item.name) in SLOW_CONTRACT_TESTS:
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: item.path.name not in FIRST)      # stable: the rest keep their order
