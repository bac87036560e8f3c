"""The command line starts without the analysis: ``--help`` and the parser import no pandas, scipy, dask or numpy.

Each check runs in a fresh interpreter (``sys.modules`` of the test process already
holds everything), so what is imported is what building the parser imports.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gradforensics.cli import main

HEAVY = ("pandas", "scipy", "dask", "numpy", "zarr", "h5py", "torch", "matplotlib", "gradforensics.analysis")


def _imported_after(code: str) -> list[str]:
    probe = f"import sys, json\n{code}\nprint(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, timeout=60)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_building_the_parser_imports_no_analysis() -> None:
    assert _imported_after("import gradforensics.cli as c\nc.build_parser()") == []


def test_help_imports_no_analysis() -> None:
    code = "import gradforensics.cli as c\ntry:\n    c.main(['--help'])\nexcept SystemExit as e:\n    assert e.code == 0"
    assert _imported_after(code) == []


def test_store_package_names_load_on_first_use() -> None:
    assert _imported_after("import gradforensics.store.names") == []
    import gradforensics.store as store
    from gradforensics.store.reader import Store
    from gradforensics.store.writer import StoreWriter

    assert store.Store is Store and store.StoreWriter is StoreWriter
    assert {"Store", "StoreWriter", "LayoutPolicy", "open_store"} <= set(dir(store))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = store.nope


def test_loss_choices_still_checked_and_listed(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["loss", "x.csv", "--out", "o", "--detrend", "foo"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'foo' (choose from 'savgol', 'diff')" in err, err
    with pytest.raises(SystemExit):
        main(["loss", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "savgol, diff" in out and "bh, bonferroni" in out, out
