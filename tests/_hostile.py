"""Helpers for the hostile-store tests: tiny stores, tampering, and guarded CLI calls.

Every CLI call goes through :func:`run_cli`, which runs ``gradforensics.cli.main``
in-process under three guards: a wall-clock alarm (a hang fails the test instead
of blocking CI), a cap on the address space (a hostile shape cannot page in
gigabytes on a shared machine; the attempt fails loudly as a MemoryError), and a
peak-RSS check (``ru_maxrss``).  The stores are built from scratch with the
public :class:`gradforensics.Recorder`.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import resource
import signal
import sys
import unicodedata
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import gradforensics as gf
from gradforensics.store.layout import LayoutPolicy

SUFFIXES = (".zarr", ".h5")
SOURCES = ("a", "b")
#: Tensors of a hostile test store: a head-split one and a plain one.
TENSORS: dict[str, tuple[int, ...]] = {"attn.q": (16, 8), "mlp.up": (12, 8)}
HEADS = {"attn.q": 4}
ACT = "mlp.act"
MB = 1 << 20
GB = 1 << 30


# --------------------------------------------------------------- building
def grads_of(i: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([seed, i])
    return {t: rng.standard_normal(s).astype(np.float32) for t, s in TENSORS.items()}


def build_store(
    path: str | os.PathLike[str],
    n: int = 8,
    *,
    seed: int = 0,
    sketch: int | None = None,
    activations: bool = False,
    weights_every: int | None = None,
    records_per_chunk: int | None = 4,
    **kw: Any,
) -> Path:
    """A tiny valid store: *n* records of two tensors (``attn.q`` split into 4 heads).

    With the defaults every array is chunked by ``records_per_chunk`` records,
    uncompressed, with no padding rows (``small_chunk_bytes=0``), so every byte
    of every chunk is live data.
    """
    kw.setdefault("heads", HEADS)
    kw.setdefault("layout", LayoutPolicy(small_chunk_bytes=0))
    kw.setdefault("background", False)
    kw.setdefault("mode", "training")
    if sketch is not None:
        kw.setdefault("sketch", {"k": sketch, "seed": 3})
        kw.setdefault("full", ["*"])
    rng = np.random.default_rng([seed, 99])
    with gf.Recorder(path, sources=list(SOURCES), records_per_chunk=records_per_chunk, **kw) as rec:
        for i in range(n):
            g = grads_of(i, seed)
            acts = {ACT: np.tanh(rng.standard_normal((20, 6))).astype(np.float32)} if activations else None
            w = {"mlp.up": (g["mlp.up"] * 0.5).astype(np.float32)} if weights_every and i % weights_every == 0 else None
            rec.record(step=i, loss=2.0 + 0.1 * np.sin(i), source=SOURCES[i % len(SOURCES)], n_samples=16, lr=1e-3,
                       grads=g, activations=acts, weights=w)
    return Path(path)


# ------------------------------------------------------------------ guards
class Hang(BaseException):  # BaseException: no `except Exception` in the code under test eats it
    """Raised by the alarm: the call did not finish in time."""


@contextlib.contextmanager
def alarm(seconds: float, what: str = "call") -> Iterator[None]:
    """Raise :class:`Hang` in the main thread if the block runs longer than *seconds*."""

    def handler(signum: int, frame: Any) -> None:
        raise Hang(f"{what} did not finish within {seconds} s (hang)")

    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _vm_size() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


@contextlib.contextmanager
def address_space_cap(extra: int) -> Iterator[None]:
    """Cap the process's address space at its current size + *extra* bytes for the block.

    Protects the shared machine: an allocation sized by hostile metadata fails at
    once (MemoryError, which then fails the test as an escaped exception) instead
    of paging in gigabytes.  The RSS contract itself is checked with ru_maxrss.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = _vm_size() + extra
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def peak_rss() -> int:
    """Peak resident set size of this process so far, in bytes (Linux: ru_maxrss is KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass
class Result:
    argv: list[str]
    rc: int
    out: str
    err: str
    seconds: float
    rss_growth: int

    def __str__(self) -> str:
        return f"{self.argv}: rc={self.rc}, stderr={self.err!r}"


def run_cli(argv: list[str], *, timeout: float = 20.0, vm_extra: int = 3 * GB, note: str = "") -> Result:
    """``gradforensics.cli.main(argv)`` under the guards; an escaping exception gets *note* attached."""
    import time

    from gradforensics.cli import main

    out, err = io.StringIO(), io.StringIO()
    rss0 = peak_rss()
    t0 = time.perf_counter()
    try:
        with (alarm(timeout, f"gradforensics {' '.join(argv)}"), address_space_cap(vm_extra),
              contextlib.redirect_stdout(out), contextlib.redirect_stderr(err)):
            rc = main(argv)
    except BaseException as exc:
        exc.add_note(f"gradforensics {argv!r} escaped with {type(exc).__name__}; stderr so far: {err.getvalue()!r}")
        if note:
            exc.add_note(note)
        raise
    return Result(list(argv), rc, out.getvalue(), err.getvalue(), time.perf_counter() - t0, peak_rss() - rss0)


def has_control(text: str) -> bool:
    return any(unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp") for ch in text)


def assert_error_line(res: Result, verb: str | None = None) -> str:
    """*res* is exit 2 with exactly one clean ``gradforensics <verb>: error: ...`` line on stderr; returns it."""
    verb = verb or res.argv[0]
    assert res.rc == 2, f"expected exit 2 (one-line error), got {res}"
    assert res.err.endswith("\n") and res.err.count("\n") == 1, f"stderr is not exactly one line: {res.err!r}"
    line = res.err[:-1]
    assert line.startswith(f"gradforensics {verb}: error: "), f"unexpected error line: {line!r}"
    assert not has_control(line), f"error line carries control characters: {line!r}"
    assert_terminal_safe(res)
    return line


def assert_terminal_safe(res: Result) -> None:
    """What the verb printed can go to a real terminal: UTF-8 encodable, no control sequences (newlines and tabs aside)."""
    for stream, text in (("stdout", res.out), ("stderr", res.err)):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise AssertionError(f"{res.argv[0]}: {stream} cannot be written to a UTF-8 terminal ({exc}): "
                                 f"{text[:300]!r}") from None
        bad = sorted({ch for ch in text.replace("\n", "").replace("\t", "") if has_control(ch)})
        assert not bad, f"{res.argv[0]}: {stream} carries control characters {bad!r}: {text[:300]!r}"


def assert_ok_or_error_line(res: Result) -> None:
    """The contract for any store: success, or exit 2 with one line; either way, terminal-safe output."""
    assert res.rc in (0, 2), f"expected exit 0 or 2, got {res}"
    if res.rc == 2:
        assert_error_line(res)
    else:
        assert_terminal_safe(res)


def flags_of(out_dir: Path) -> list[dict[str, Any]]:
    f = out_dir / "flags.json"
    return json.loads(f.read_text())["flags"] if f.is_file() else []


def assert_no_nonfinite(out_dir: Path) -> None:
    bad = [f for f in flags_of(out_dir) if f.get("kind") == "nonfinite"]
    assert not bad, f"damage was blamed on training: nonfinite finding(s) {bad[:2]}"


# --------------------------------------------------------------- tampering
def load_json(p: Path) -> Any:
    return json.loads(p.read_text())


def dump_json(p: Path, obj: Any) -> None:
    p.write_text(json.dumps(obj, indent=2))


def edit_root_meta(store: Path, fn: Callable[[dict[str, Any]], Any]) -> None:
    """Replace the ``gradforensics`` root attribute by ``fn(meta)`` (*fn* may edit in place and return None)."""
    if store.suffix == ".zarr":
        doc = load_json(store / "zarr.json")
        meta = doc["attributes"]["gradforensics"]
        new = fn(meta)
        doc["attributes"]["gradforensics"] = meta if new is None else new
        dump_json(store / "zarr.json", doc)
    else:
        import h5py

        with h5py.File(store, "r+") as f:
            meta = json.loads(f.attrs["gradforensics"])
            new = fn(meta)
            f.attrs["gradforensics"] = json.dumps(meta if new is None else new)


def set_array_attr(store: Path, name: str, key: str, value: Any) -> None:
    """Set attribute *key* of array *name* (``grads/attn.q``) to the JSON value *value*."""
    if store.suffix == ".zarr":
        p = store / name / "zarr.json"
        doc = load_json(p)
        doc["attributes"][key] = value
        dump_json(p, doc)
    else:
        import h5py

        with h5py.File(store, "r+") as f:
            f[name].attrs[key] = json.dumps(value)


def snapshot(root: Path, exclude: tuple[Path, ...] = ()) -> dict[str, tuple[Any, ...]]:
    """Every entry under *root* (links not followed): relative path -> (kind, size, mtime_ns, link target)."""
    out: dict[str, tuple[Any, ...]] = {}
    ex = tuple(str(e) for e in exclude)
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        if any(dirpath == e or dirpath.startswith(e + os.sep) for e in ex):
            dirnames[:] = []
            continue
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            if any(full == e for e in ex):
                continue
            st = os.lstat(full)
            link = os.readlink(full) if os.path.islink(full) else None
            kind = "link" if link is not None else ("dir" if os.path.isdir(full) else "file")
            out[os.path.relpath(full, root)] = (kind, 0 if kind == "dir" else st.st_size,
                                                0 if kind == "dir" else st.st_mtime_ns, link)
    return out


def diff(before: dict[str, tuple[Any, ...]], after: dict[str, tuple[Any, ...]]) -> list[str]:
    """Entries created, changed or removed between two snapshots."""
    return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))


def python() -> str:
    return sys.executable


# ------------------------------------------------------- writer processes
def lock_path(store: str | os.PathLike[str]) -> Path:
    """The sidecar lock of a store: ``<store path>.lock`` (JSON with the holder's host and pid)."""
    return Path(f"{os.fspath(store)}.lock")


def child_command(func: str, *args: Any) -> list[str]:
    """``python -c`` running ``_hostile.<func>(*args)`` in a fresh interpreter."""
    here = os.path.dirname(os.path.abspath(__file__))
    code = f"import sys; sys.path.insert(0, {here!r}); import _hostile; _hostile.{func}(*{args!r})"
    return [sys.executable, "-c", code]


def child_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MPLBACKEND": "Agg"}


def slow_writer(path: str, min_records: int, delay: float, stop_on_stdin: bool) -> None:
    """Child process: hold a Recorder open on *path* and keep writing records (one commit each).

    Prints ``READY <pid>`` once *min_records* records are committed.  With
    *stop_on_stdin* it then keeps writing one record every *delay* seconds until a
    line arrives on stdin, closes and prints ``DONE <n>``; otherwise it blocks
    forever after READY (a writer waiting to be killed).
    """
    import threading
    import time

    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
    rec = gf.Recorder(path, sources=list(SOURCES), heads=HEADS, background=False, records_per_chunk=1,
                      layout=LayoutPolicy(small_chunk_bytes=0))
    i = 0
    while True:
        rec.record(step=i, loss=float(i), source=SOURCES[i % 2], grads=grads_of(i))
        i += 1
        if i == min_records:
            print(f"READY {os.getpid()}", flush=True)
            if not stop_on_stdin:
                stop.wait()
                time.sleep(3600)
        if i >= min_records:
            if stop.is_set():
                break
            time.sleep(delay)
    rec.close()
    print(f"DONE {i}", flush=True)


def try_open(path: str) -> None:
    """Child process: try to open a Recorder on *path*; exit 3 with ``LOCKED <message>`` when refused."""
    from gradforensics.errors import StoreLockedError

    try:
        rec = gf.Recorder(path, sources=list(SOURCES), overwrite=True, background=False)
    except StoreLockedError as exc:
        print(f"LOCKED {exc}", flush=True)
        sys.exit(3)
    rec.close()
    print("OPENED", flush=True)
    sys.exit(0)


def import_refused(tmp_path: Path, capsys: Any, source: Path, *expect: str) -> None:
    """``gradforensics import SOURCE`` exits 2 with one error line holding each of *expect*, no traceback."""
    from gradforensics.cli import main

    out = tmp_path / f"out-{source.name}.zarr"
    assert main(["import", str(source), "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for e in expect:
        assert e in lines[0], lines[0]
