"""A writer process killed mid-capture leaves a store that opens with its complete records."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from gradforensics.store.reader import Store

CHILD = textwrap.dedent("""
    import sys, numpy as np
    import gradforensics as gf
    path = sys.argv[1]
    rec = gf.Recorder(path, sources=["a", "b"], records_per_chunk=4, heads={"q": 4})
    i = 0
    while True:
        rng = np.random.default_rng(i)
        rec.record(step=i, loss=float(i), source="ab"[i % 2],
                   grads={"q": rng.standard_normal((64, 256)).astype("f4"),
                          "up": rng.standard_normal((512, 64)).astype("f4")})
        print(i, flush=True)
        i += 1
""")


@pytest.mark.slow
@pytest.mark.parametrize("suffix", [".zarr", ".h5"])
@pytest.mark.parametrize("kill_after", [9, 22])
def test_killed_writer_leaves_complete_records(tmp_path: Path, suffix: str, kill_after: int) -> None:
    path = tmp_path / f"dump{suffix}"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(path)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert child.stdout is not None
    for line in child.stdout:
        if int(line) >= kill_after:
            break
    child.send_signal(signal.SIGKILL)
    child.wait()
    store = Store(path)
    n = store.n_records
    # At most one chunk of records is buffered or in flight when the kill lands.
    assert n % 4 == 0 and kill_after - 8 <= n <= kill_after + 4
    up = store.grad("up").compute()
    steps = store.batches()["step"]
    np.testing.assert_array_equal(steps, np.arange(n))
    for i in range(n):
        rng = np.random.default_rng(i)
        want_q = rng.standard_normal((64, 256)).astype("f4")
        np.testing.assert_array_equal(up[i], rng.standard_normal((512, 64)).astype("f4"))
        np.testing.assert_array_equal(store.grad("q", head=i % 4)[i].compute(), want_q.reshape(4, 16, 256)[i % 4])
