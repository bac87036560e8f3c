"""Multi-rank capture with real ``torch.distributed`` (gloo) processes on CPU: DDP, FSDP2, a killed rank.

Each test starts one group of processes that does several checks' worth of work
and saves what the parent needs (its own oracle gradients, the batches); the
parent then reads the one store they wrote together.  No part of torch.distributed
is mocked.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow

from _multirank_workers import WORLD, K, batch, loss_of, tiny, worker  # noqa: E402
from test_capture_cli import files, llama_dir  # noqa: E402,F401  (fixtures: the tiny LLaMA and its data)

import gradforensics as gf  # noqa: E402
from gradforensics.recording.sketch import Sketcher  # noqa: E402
from gradforensics.store.heads import HeadSpec  # noqa: E402
from gradforensics.store.ranks import compaction_moves  # noqa: E402
from gradforensics.store.schema import committed_prefix  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(fn: Any, world: int, *args: Any, timeout: float = 240.0) -> list[int | None]:
    """Start *world* processes running ``fn(rank, world, port, *args)``; reap them as they end."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=fn, args=(r, world, port, *args)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    while any(p.is_alive() for p in procs):      # is_alive() reaps a dead child at once
        if time.monotonic() > deadline:
            for p in procs:
                p.kill()
            pytest.fail(f"ranks still running after {timeout:.0f} s")
        time.sleep(0.05)
    return [p.exitcode for p in procs]


# ------------------------------------------------------------------ one group of 4 ranks, many checks
@pytest.fixture(scope="module")
def ranks4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ranks4")
    codes = run_ranks(worker, WORLD, str(out))
    assert codes == [0, -signal.SIGKILL, 0, 0]      # rank 1 killed itself last, the others closed
    return out


def test_ddp_records_each_ranks_local_gradient(ranks4: Path) -> None:
    tmp_path = ranks4
    store = gf.open_store(tmp_path / "ddp.zarr")
    assert store.n_records == 12                      # N = ranks x calls
    ranks = store.batches()["rank"]
    steps = store.batches()["step"]
    assert sorted(zip(ranks.tolist(), steps.tolist(), strict=True)) == [(r, s) for r in range(4) for s in range(3)]
    assert store.meta.ranks == {"world_size": 4, "completed": [0, 1, 2, 3], "records": [3, 3, 3, 3]}
    sk = Sketcher(k=K)
    for rank in range(WORLD):
        oracle = np.load(tmp_path / f"oracle{rank}.npz")
        for i in np.flatnonzero(ranks == rank):
            step = int(steps[i])
            for name in ("0.weight", "2.weight"):
                want = oracle[f"{step}|{name}"]
                check_record(store, name, i, want, sk)
    # the local gradients differ between ranks, and none is the all-reduced mean the optimizer saw
    last = [np.load(tmp_path / f"oracle{r}.npz")["2|2.weight"] for r in range(WORLD)]
    reduced = np.load(tmp_path / "reduced0.npz")["2.weight"]
    np.testing.assert_allclose(reduced, np.mean(last, axis=0), rtol=1e-5, atol=1e-6)
    assert not np.allclose(last[0], last[1]) and not np.allclose(last[0], reduced)


def check_record(store: Any, name: str, i: int, want: np.ndarray, sk: Sketcher) -> None:
    """Stored gradient *i* of *name* equals *want*, and its stored sketch equals the sketch of *want*."""
    spec = HeadSpec.from_attrs(store.grads[name].attrs)
    want_rows = spec.split(want) if spec is not None else want
    np.testing.assert_allclose(store.grad(name)[i].compute(), want_rows, rtol=1e-5, atol=1e-6)
    want_sk = sk.project_heads(want_rows) if spec is not None else sk.project(want)
    np.testing.assert_allclose(store.sketch(name)[i].compute(), want_sk, rtol=1e-4, atol=1e-6)


def test_fsdp_records_the_gradient_of_the_union_of_micro_batches(ranks4: Path) -> None:
    """FSDP2 records equal the gradient of the union of the ranks' micro-batches (a plain model's)."""
    store = gf.open_store(ranks4 / "fsdp.zarr")
    assert store.n_records == 3
    b = store.batches()
    assert b["step"].tolist() == [0, 1, 2] and b["rank"].tolist() == [0, 1, 2]    # record t by rank t mod R
    assert b["n_samples"].tolist() == [20, 20, 20]
    np.testing.assert_allclose(b["mixture"], 0.5)
    sk = Sketcher(k=K)
    model = tiny()
    for step in range(3):
        xs, ys = zip(*(batch(r, step) for r in range(WORLD)), strict=True)
        model.zero_grad()
        loss = loss_of(model, (torch.cat(xs), torch.cat(ys)))
        loss.backward()
        assert b["loss"][step] == pytest.approx(float(loss.detach()), rel=1e-5)
        for name in ("0.weight", "2.weight"):   # 0.weight: both heads cross a shard boundary
            check_record(store, name, step, dict(model.named_parameters())[name].grad.numpy(), sk)


def test_many_ranks_refuse_hdf5_and_urls_in_one_line() -> None:
    from gradforensics.errors import SpecError
    from gradforensics.store.ranks import RankPlan, check_backend

    with pytest.raises(SpecError, match="HDF5 file has one writer"):
        check_backend("dump.h5", "hdf5")
    with pytest.raises(SpecError, match="local"):
        check_backend("s3://bucket/dump.zarr", "zarr")
    with pytest.raises(SpecError, match=r"rank 4 is not in 0\.\.3"):
        RankPlan(4, 4)
    assert [RankPlan(q, 4).index(2) for q in range(4)] == [8, 9, 10, 11]


def test_prefix_and_compaction_arithmetic() -> None:
    assert committed_prefix([3, 3]) == 6
    assert committed_prefix([3, 1, 3, 3]) == 5          # rank 1's second record (index 5) is missing
    moves = compaction_moves([3, 1, 3, 3])
    # every written index lands on 0..sum-1, in order
    world = 4
    written = sorted(i * world + q for q, c in enumerate([3, 1, 3, 3]) for i in range(c))
    final = dict(moves)
    assert sorted(final.get(w, w) for w in written) == list(range(10))


# ------------------------------------------------------------------ consistency, coherence, kill -9
def test_planted_rank_disagreement_named_and_coherence_of_ranks(ranks4: Path) -> None:
    tmp_path = ranks4
    # a planted disagreement of rank 1 is found and named; the healthy replay raises nothing
    bad = gf.analyze(tmp_path / "bad.zarr", only=["rankconsistency"], progress=False)
    flagged = [f for f in bad.flags if f.kind == "rank_disagreement"]
    assert [f.evidence["rank"] for f in flagged] == [1]
    assert flagged[0].tensor == "0.weight" and flagged[0].severity > 0.5
    assert 0.5e-2 < flagged[0].evidence["max_rel_diff"] < 2e-2     # the planted 1%, through a k=64 sketch
    healthy = gf.analyze(tmp_path / "same.zarr", only=["rankconsistency"], progress=False)
    assert not healthy.flags
    table = healthy.table("rankconsistency")
    assert sorted(set(table["rank"])) == [0, 1, 2, 3] and (table["max_rel_diff"] < 1e-6).all()
    # coherence of the per-rank loss series read from the multi-rank store: the shared period is found
    coh = gf.analyze(tmp_path / "series.zarr", only=["coherence"], progress=False).table("coherence")
    loss = coh[(coh["series"] == "batches/loss") & coh["significant"].astype(bool)]
    pairs = {(a, b) for a, b in zip(loss["rank_a"], loss["rank_b"], strict=True)}
    assert len(pairs) >= 3 and (np.abs(loss["period_steps"] - 8) < 0.5).all()


def test_kill_9_of_one_rank_keeps_every_written_record(ranks4: Path) -> None:
    tmp_path = ranks4
    # kill -9 of rank 1: a readable store with every record written, the killed rank's first three included
    store = gf.open_store(tmp_path / "killed.zarr")
    assert store.meta.ranks == {"world_size": 4, "completed": [0, 2, 3], "records": [6, 3, 6, 6]}
    assert store.n_records == 21
    b = store.batches()
    assert sorted(zip(b["rank"].tolist(), b["step"].tolist(), strict=True)) == sorted(
        [(r, t) for r in (0, 2, 3) for t in range(6)] + [(1, t) for t in range(3)])
    np.testing.assert_array_equal(b["loss"], b["rank"].astype(np.float32))   # each row moved whole
    grads = store.grad("0.weight").compute()
    assert np.isfinite(grads).all() and (np.abs(grads).reshape(21, -1).sum(axis=1) > 0).all()


# ------------------------------------------------------------------ torchrun gradforensics capture
def test_torchrun_capture_end_to_end(tmp_path: Path, llama_dir: Path, files: dict[str, Path]) -> None:  # noqa: F811
    """``torchrun --nproc-per-node 2 -m gradforensics capture`` on the tiny LLaMA: FSDP2, one store."""
    import subprocess
    import sys

    transformers = pytest.importorskip("transformers")
    from gradforensics.replay import data, losses

    out = tmp_path / "dist.zarr"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GRADFORENSICS_RANK_WAIT_S": "60"}
    tensors = ["model.layers.1.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(free_port()), "-m", "gradforensics", "capture", str(llama_dir), "--data", f"en={files['en']}",
           "--data", f"zh={files['zh']}", "--out", str(out), "--batches-per-source", "2", "--batch-size", "2",
           "--seq-len", "16", "--tensors", *tensors, "--sketch", "32", "--full", tensors[0], "--quiet"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    store = gf.open_store(out)
    assert store.n_records == 4 and store.meta.ranks["completed"] == [0, 1]
    b = store.batches()
    assert b["rank"].tolist() == [0, 1, 0, 1] and b["n_samples"].tolist() == [4] * 4    # 2 ranks x 2 sequences
    # oracle: record i of a source is the mean gradient of batches 2j and 2j+1 of it (rank 0's, rank 1's)
    model = transformers.LlamaForCausalLM.from_pretrained(llama_dir, local_files_only=True).eval()
    tok = transformers.AutoTokenizer.from_pretrained(llama_dir, local_files_only=True)
    srcs = data.parse_sources([f"en={files['en']}", f"zh={files['zh']}"])
    batches = data.load_batches(srcs, tok, seq_len=16, batch_size=2, n_batches=4, seed=0)
    sk = Sketcher(k=32)
    params = dict(model.named_parameters())
    for i, (src, j) in enumerate([("en", 0), ("zh", 0), ("en", 1), ("zh", 1)]):
        grads, loss = [], []
        for q in (0, 1):
            model.zero_grad()
            lv = losses.causal_lm(model, batches[src][2 * j + q])
            lv.backward()
            grads.append({n: params[n].grad.numpy().copy() for n in tensors})
            loss.append(float(lv.detach()))
        assert b["loss"][i] == pytest.approx(np.mean(loss), rel=1e-5)
        for n in tensors:
            want = (grads[0][n] + grads[1][n]) / 2
            spec = HeadSpec.from_attrs(store.sketches[n].attrs)
            rows = spec.split(want) if spec is not None else want
            if n == tensors[0]:
                np.testing.assert_allclose(store.grad(n)[i].compute(), rows, rtol=1e-4, atol=1e-7)
            want_sk = sk.project_heads(rows) if spec is not None else sk.project(want)
            np.testing.assert_allclose(store.sketch(n)[i].compute(), want_sk, rtol=1e-3, atol=1e-6)
    # --check-ranks: the whole model on every rank, the same batches everywhere; healthy ranks agree exactly
    check = tmp_path / "check.zarr"
    cmd = [*cmd[:cmd.index("--out")], "--out", str(check), "--batches-per-source", "1", "--batch-size", "2",
           "--seq-len", "16", "--tensors", tensors[0], "--check-ranks", "--quiet"]
    cmd[cmd.index("--master-port") + 1] = str(free_port())
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    store = gf.open_store(check)
    assert store.meta.extra == {"replicated": True} and store.n_records == 4       # 2 ranks x 2 sources x 1
    assert sorted(store.batches()["rank"].tolist()) == [0, 0, 1, 1]
    findings = gf.analyze(check, only=["rankconsistency"], progress=False)
    assert not findings.flags and (findings.table("rankconsistency")["max_rel_diff"] == 0).all()


# ------------------------------------------------------------------ a killed rank under torchrun, a refused job
def _torchrun(*args: str, log_dir: Path | None = None) -> list[str]:
    import sys

    logs = ["--log-dir", str(log_dir), "--redirects", "3"] if log_dir is not None else []
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
            *logs, *args]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "GRADFORENSICS_RANK_WAIT_S": "60"}


def _marker(out: Path, rank: int) -> dict[str, Any] | None:
    from gradforensics.store.ranks import read_marker

    return read_marker(str(out), rank)


def _on_disk(out: Path, rank: int) -> int:
    """Records of *rank* (of 2) whose last array's chunk is on disk (global index i * 2 + rank, before compaction)."""
    c = out / "sketch" / "model.layers.0.mlp.down_proj.weight" / "c"
    return sum(1 for f in c.iterdir() if f.name.isdigit() and int(f.name) % 2 == rank) if c.is_dir() else 0


def _wait(what: Any, proc: Any, timeout: float = 180.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = what()
        if got:
            return got
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            _, err = proc.communicate()
            pytest.fail(f"torchrun ended (rc {proc.returncode}) or timed out before the test's signal: {err[-3000:]}")
        time.sleep(0.02)


def test_torchrun_check_ranks_rank_killed_keeps_the_survivors_records(
        tmp_path: Path, llama_dir: Path, files: dict[str, Path]) -> None:  # noqa: F811
    """Rank 1 of ``capture --check-ranks`` frozen, rank 0 let run ahead, rank 1 killed: torchrun SIGTERMs rank 0,
    which closes the store and commits every record of both ranks that is on disk."""
    import subprocess

    out = tmp_path / "killed.zarr"
    tensor = "model.layers.0.mlp.down_proj.weight"
    cmd = _torchrun("-m", "gradforensics", "capture", str(llama_dir), "--data", f"en={files['en']}", "--data",
                    f"zh={files['zh']}", "--out", str(out), "--batches-per-source", "40", "--batch-size", "2",
                    "--seq-len", "16", "--tensors", tensor, "--sketch", "32", "--check-ranks", "--quiet")
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    m = _wait(lambda: (lambda m: m if m and m["records"] >= 2 else None)(_marker(out, 1)), proc)
    os.kill(m["pid"], signal.SIGSTOP)               # rank 1 frozen ...
    time.sleep(0.2)
    c1 = _marker(out, 1)["records"]                 # ... its count final (a marker follows its chunks)
    _wait(lambda: _on_disk(out, 0) >= c1 + 4, proc)    # rank 0 runs ahead, past the old prefix commit (c1 + 1)
    at_kill = _on_disk(out, 0)
    os.kill(m["pid"], signal.SIGKILL)               # ... and killed: torchrun sends SIGTERM to rank 0
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    store = gf.open_store(out)
    ranks = store.meta.ranks
    assert ranks["completed"] == [0] and ranks["records"][1] == c1
    c0 = ranks["records"][0]
    # rank 0 loses at most its record in flight: every record it had on disk at the kill is kept (and later ones)
    assert c0 >= at_kill - 1 >= c1 + 3, (c0, at_kill, c1)
    assert store.n_records == c0 + c1
    assert f"terminated (SIGTERM); {out} holds the {c0 + c1} records" in err, err[-2000:]
    b = store.batches()
    r = b["rank"]
    assert int((r == 0).sum()) == c0 and int((r == 1).sum()) == c1
    # --check-ranks: record i of every rank is batch i of the round-robin (en, zh, en, ...), the same batch
    src = b["mixture"].argmax(axis=1)
    for q, c in ((0, c0), (1, c1)):
        assert src[r == q].tolist() == [i % 2 for i in range(c)]
    np.testing.assert_array_equal(b["loss"][r == 1], b["loss"][r == 0][:c1])
    assert np.isfinite(store.sketch(tensor).compute()).all()
    findings = gf.analyze(out, progress=False)     # the default pass runs on it
    table = findings.table("rankconsistency")
    assert (table["max_rel_diff"] == 0).all() and not [f for f in findings.flags if f.kind == "rank_disagreement"]


def test_torchrun_ddp_rank_killed_keeps_the_survivors_records(tmp_path: Path) -> None:
    """DDP under torchrun: rank 1 kill -9'd after 3 records, rank 0 stopped by torchrun's SIGTERM mid-run."""
    import subprocess

    workers = Path(__file__).with_name("_multirank_workers.py")
    proc = subprocess.run(_torchrun(str(workers), "ddp_sigterm", str(tmp_path)), env=_env(), capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode != 0
    store = gf.open_store(tmp_path / "ddp_term.zarr")
    returned = int((tmp_path / "returned0").read_text())
    ranks = store.meta.ranks
    assert ranks["completed"] == [0] and ranks["records"][1] == 3
    c0 = ranks["records"][0]
    assert returned <= c0 <= returned + 1, (returned, c0)      # at most the record() SIGTERM cut short
    assert c0 > 3 and store.n_records == c0 + 3
    b = store.batches()
    assert b["step"][b["rank"] == 0].tolist() == list(range(c0))
    assert b["step"][b["rank"] == 1].tolist() == [0, 1, 2]
    np.testing.assert_array_equal(b["loss"], b["rank"].astype(np.float32))    # each row moved whole
    gf.analyze(tmp_path / "ddp_term.zarr", progress=False)


def test_torchrun_capture_refused_by_a_locked_store_says_one_line_on_every_rank(
        tmp_path: Path, llama_dir: Path, files: dict[str, Path]) -> None:  # noqa: F811
    """A second job on a store being written: rank 0's StoreLockedError reaches rank 1 (no barrier traceback)."""
    import subprocess

    from gradforensics.store.lock import StoreLock

    out, logs = tmp_path / "busy.zarr", tmp_path / "logs"
    cmd = _torchrun("-m", "gradforensics", "capture", str(llama_dir), "--data", f"en={files['en']}", "--out",
                    str(out), "--batches-per-source", "1", "--batch-size", "2", "--seq-len", "16", "--tensors",
                    "model.layers.0.mlp.down_proj.weight", "--check-ranks", "--quiet", log_dir=logs)
    with StoreLock(str(out)):                       # the first job's writer, as far as the lock can tell
        proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0
    per_rank = sorted(logs.glob("**/attempt_0/*/stderr.log"))
    assert [p.parent.name for p in per_rank] == ["0", "1"]
    for p in per_rank:
        text = p.read_text()
        assert text.count("\n") == 1 and "Traceback" not in text, text[-2000:]
        assert text.startswith(f"gradforensics capture: error: {out} is being written by another process")
    assert not out.exists()
