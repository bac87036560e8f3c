"""A rank killed while writing its progress marker (issue 42): its temporary ``ranks/1/.zarr.json.<pid>``.

Real ``torch.distributed`` (gloo) jobs of 2 ranks on CPU (:func:`_multirank_workers.temporaries_worker`):
rank 1 writes the temporary its marker is written through and is killed with SIGKILL before the rename,
once before its first marker and once after 3 committed records.  Readers ignore the temporary (the store
opens with every committed record); the next writer (``analyze`` saving its results) removes it.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from _multirank_workers import temporaries_worker  # noqa: E402
from test_multirank import run_ranks  # noqa: E402

import gradforensics as gf  # noqa: E402
from gradforensics.cli import main  # noqa: E402
from gradforensics.store import ranks  # noqa: E402


@pytest.mark.parametrize("before", [0, 3])
def test_a_dead_ranks_marker_temporary_is_ignored_by_readers_and_removed_by_the_next_writer(
        before: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("GRADFORENSICS_RANK_WAIT_S", "3")     # rank 0's wait for a rank with no marker yet
    assert run_ranks(temporaries_worker, 2, str(tmp_path), before, timeout=180) == [0, -signal.SIGKILL]
    path = tmp_path / "store.zarr"
    temps = list((path / "ranks" / "1").glob(".zarr.json.*"))
    assert len(temps) == 1 and (path / "ranks" / "1" / "zarr.json").exists() == bool(before)

    store = gf.open_store(path)           # before the fix (before=0): "ranks/1/: the directory has no zarr.json"
    assert store.n_records == 4 + before
    assert store.meta.ranks["records"] == [4, before]
    assert sorted(store.batches()["loss"].tolist()) == [0.0] * 4 + [1.0] * before
    assert main(["inspect", str(path)]) == 0

    assert main(["analyze", str(path), "--out", str(tmp_path / "out"), "--only", "nonfinite", "--quiet"]) == 0
    assert not temps[0].exists()          # the next writer removed it ...
    assert (path / "ranks" / "1").exists() == bool(before)     # ... and the directory it alone was in
    assert gf.open_store(path).n_records == 4 + before


def test_a_live_or_foreign_temporary_is_left_alone(tmp_path: Path) -> None:
    import json
    import os
    import socket
    import time

    d = tmp_path / "s.zarr" / "ranks" / "2"
    d.mkdir(parents=True)
    mine = d / f".zarr.json.{os.getpid()}"                       # this process's own, being written
    live = d / ".zarr.json.1"                                    # pid 1 lives on this host
    foreign = d / ".zarr.json.77"                                # another host's, young: may be mid-rename
    for f, host, pid in ((mine, socket.gethostname(), os.getpid()), (live, socket.gethostname(), 1),
                         (foreign, "elsewhere", 77)):
        f.write_text(json.dumps({"attributes": {"host": host, "pid": pid}}))
    assert ranks.clean_marker_temporaries(tmp_path / "s.zarr") == 0
    old = time.time() - 2 * ranks.TEMPORARY_STALE_S
    os.utime(foreign, (old, old))                                # abandoned by age
    assert ranks.clean_marker_temporaries(tmp_path / "s.zarr") == 1 and not foreign.exists()
    assert mine.exists() and live.exists()
