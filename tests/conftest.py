"""Collection order for the parallel run (``-n 2 --dist loadfile``).

The store-metadata fuzz is one long test file (~9 min on two cores): it goes first,
so one worker runs it while the other works through every other file, instead of
one worker finishing the fuzz alone at the end.
"""

from __future__ import annotations

import pytest

FIRST = ("test_store_fuzz.py",)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.path.name not in FIRST)      # stable: the rest keep their order
