"""SIGTERM while a multi-rank recorder is open: the store is closed and rank 0 commits (one process, no torch).

torchrun answers a dead rank by sending SIGTERM to the others; :class:`~gradforensics.store.termguard.TermGuard`
turns it into :class:`~gradforensics.errors.Terminated` in the main thread.  Each case runs in a child
process (a SIGTERM that is not caught must not take the test runner with it); rank 0 of 2 records alone,
with a hand-written marker for rank 1.  The real torchrun cases are in ``tests/test_multirank.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import gradforensics as gf

pytestmark = pytest.mark.slow       # each case runs in a child process that receives SIGTERM

PRELUDE = """
import json, os, signal, socket, sys, time
import numpy as np
import gradforensics.store.ranks as ranks
from gradforensics.errors import Terminated
from gradforensics.recording.recorder import ArrayRecorder
from gradforensics.store.ranks import RankPlan

path = sys.argv[1]

def rank1_marker(pid, records=0, done=False):
    d = os.path.join(path, "ranks", "1")
    os.makedirs(d, exist_ok=True)
    doc = {"zarr_format": 3, "node_type": "group", "attributes": {
        "records": records, "done": done, "host": socket.gethostname(), "pid": pid}}
    with open(os.path.join(d, "zarr.json"), "w") as f:
        json.dump(doc, f)

def record(rec, t):
    rec.record(step=t, loss=float(t), source="a", grads={"w": np.full(4, t, np.float32)})
"""


def run(script: str, path: Path) -> subprocess.CompletedProcess[str]:
    code = PRELUDE + textwrap.dedent(script)
    return subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)


def test_sigterm_in_the_loop_closes_the_store_and_commits_rank_0s_records(tmp_path: Path) -> None:
    p = tmp_path / "term.zarr"
    res = run("""
        ranks.TERM_WAIT_S = 0.5                  # rank 1 below is alive and never closes: the wait after SIGTERM
        rec = ArrayRecorder(path, sources=["a"], ranks=RankPlan(0, 2, wait_s=600))
        rank1_marker(os.getppid())               # a live process on this host that is not done
        t0 = time.monotonic()
        try:
            with rec:
                for t in range(1000):
                    record(rec, t)
                    if t == 4:
                        os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(0.01)
        except Terminated:
            print(json.dumps({"t": t, "s": time.monotonic() - t0,
                              "handler_back": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL}))
    """, p)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout)
    assert out["t"] == 4 and out["handler_back"] and out["s"] < 60      # not the 600 s wait
    store = gf.open_store(p)
    assert store.n_records == 5 and store.meta.ranks == {"world_size": 2, "completed": [0], "records": [5, 0]}
    assert store.batches()["step"].tolist() == [0, 1, 2, 3, 4]


def test_sigterm_while_closing_is_held_then_raised(tmp_path: Path) -> None:
    p = tmp_path / "held.zarr"
    res = run("""
        import threading
        ranks.TERM_WAIT_S = 0.5
        rec = ArrayRecorder(path, sources=["a"], ranks=RankPlan(0, 2, wait_s=600))
        rank1_marker(os.getppid())               # alive, never done: close waits for it
        for t in range(3):
            record(rec, t)
        threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()    # arrives during that wait
        t0 = time.monotonic()
        try:
            rec.close()
        except Terminated:
            print(json.dumps({"raised_after_close": True, "s": time.monotonic() - t0}))
    """, p)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout)
    assert out["raised_after_close"] and 0.9 < out["s"] < 60        # the wait was cut short, the close finished
    store = gf.open_store(p)
    assert store.n_records == 3 and store.meta.ranks == {"world_size": 2, "completed": [0], "records": [3, 0]}


def test_a_programs_own_sigterm_handler_is_left_alone(tmp_path: Path) -> None:
    res = run("""
        seen = []
        signal.signal(signal.SIGTERM, lambda *a: seen.append("mine"))
        with ArrayRecorder(path, sources=["a"], ranks=RankPlan(0, 2, wait_s=0)) as rec:
            record(rec, 0)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)
            record(rec, 1)
        print(seen, signal.getsignal(signal.SIGTERM) != signal.SIG_DFL)
    """, tmp_path / "own.zarr")
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip() == "['mine'] True"
    assert gf.open_store(tmp_path / "own.zarr").n_records == 2


def test_a_single_process_recorder_installs_no_handler(tmp_path: Path) -> None:
    res = run("""
        with ArrayRecorder(path, sources=["a"]) as rec:
            record(rec, 0)
            print(signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)
    """, tmp_path / "one.zarr")
    assert res.returncode == 0 and res.stdout.strip() == "True", res.stderr[-3000:]
