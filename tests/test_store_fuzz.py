"""Property-based fuzz of store metadata (issue 10): one mutated attribute, and every verb holds the contract.

One small valid store per backend is built once (a head-split tensor, a sketch,
activations, a weight snapshot) and analysed once, so its ``analysis/``
documents exist.  Each example copies it into a fresh directory and mutates ONE
randomly chosen attribute:

* Zarr: any key at any depth of any ``zarr.json`` (list items included): its value
  replaced by a random JSON value (ints incl. huge and negative, floats incl.
  NaN/inf, strings incl. control characters and ``../``, bools, null, lists,
  dicts), or the key deleted;
* HDF5: any attribute of any object (the root ``gradforensics`` one included):
  replaced by random JSON text, random bytes or ints, or deleted - or, for an
  attribute holding a JSON document, any key at any depth inside it.

Then ``inspect``, ``report`` and ``analyze`` (``--out`` inside the example's
directory; ``report`` before ``analyze``, so the damaged ``analysis/`` documents
are what it reads) must each exit 0, or 2 with exactly one line on stderr; no
exception may escape; each call finishes within ``GF_FUZZ_TIMEOUT`` seconds
(default 20, an alarm); peak RSS stays under 1 GB; and nothing is written
outside the example's directory (inside it, only under ``--out`` and the store).

Each test runs once per *stratum*, a (backend, action) pair - Zarr/HDF5 times
replace/perturb/delete - so that every strategy gets its share of examples however
few there are.  Two profiles, chosen by ``GF_FUZZ_PROFILE``:

* ``ci`` (the default, what the README's test command and CI run): 16 examples per
  stratum of the full test (96 in all), 8 of the ``inspect``-only one (48);
* ``long``: 84 and 17 per stratum (504 and 102, the fuzz as it was first run);
  ``GF_FUZZ_PROFILE=long python -m pytest tests/test_store_fuzz.py -s`` (about 15
  minutes here).

``GF_FUZZ_EXAMPLES`` / ``GF_FUZZ_OPEN_EXAMPLES`` override the totals of either
profile (split evenly over the strata).  Examples are derandomized: CI runs the same
ones every time.  A failure prints its mutation; shrinking is
off unless ``GF_FUZZ_SHRINK=1``.  Run with ``-s`` for timings and exit codes.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _hostile import (
    GB,
    assert_ok_or_error_line,
    build_store,
    diff,
    peak_rss,
    run_cli,
    snapshot,
)
from hypothesis import HealthCheck, Phase, given, reject, settings
from hypothesis import strategies as st

SUFFIXES = (".zarr", ".h5")
ACTIONS = ("replace", "perturb", "delete")
STRATA = [(suffix, action) for suffix in SUFFIXES for action in ACTIONS]
#: examples per stratum (full test, inspect-only test) of each profile
PROFILES = {"ci": (16, 8), "long": (84, 17)}
PROFILE = os.environ.get("GF_FUZZ_PROFILE", "ci")
if PROFILE not in PROFILES:
    raise ValueError(f"GF_FUZZ_PROFILE={PROFILE!r}: expected one of {', '.join(PROFILES)}")


def _per_stratum(env: str, default: int) -> int:
    total = os.environ.get(env)
    return default if total is None else max(1, math.ceil(int(total) / len(STRATA)))


N_FULL = _per_stratum("GF_FUZZ_EXAMPLES", PROFILES[PROFILE][0])
N_OPEN = _per_stratum("GF_FUZZ_OPEN_EXAMPLES", PROFILES[PROFILE][1])
TIMEOUT = float(os.environ.get("GF_FUZZ_TIMEOUT", "20"))
#: Shrinking re-runs a failing example hundreds of times (minutes here) to simplify a value that is already a
#: single, printed mutation: off unless GF_FUZZ_SHRINK=1.
SHRINK = os.environ.get("GF_FUZZ_SHRINK", "0") == "1"
RSS_LIMIT = 1 * GB

FUZZ_SETTINGS = {
    "derandomize": True,
    "database": None,
    "deadline": None,
    "print_blob": True,
    "phases": [Phase.explicit, Phase.reuse, Phase.generate, *([Phase.shrink] if SHRINK else [])],
    "suppress_health_check": [HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                              HealthCheck.data_too_large, HealthCheck.filter_too_much],
}

# ------------------------------------------------------------------ values
HOSTILE_INTS = [0, 1, -1, 2, 3, 4, 7, 8, 9, 12, 16, 64, 255, 256, 2**31 - 1, 2**31, 2**32, 2**53 + 1,
                2**63 - 1, 2**63, -(2**63), 2**64, 10**9, 10**12, 10**18, 10**100, -(10**12)]
HOSTILE_FLOATS = [math.nan, math.inf, -math.inf, 0.5, 3.7, -0.0, 1e-300, 1e308, -1.5, 8.0, 1e12]
HOSTILE_STRINGS = ["", ".", "..", "../", "../../escape", "/tmp/gf-fuzz-escape", "a/b", "a\\b", "zarr.json",
                   "\x00", "\n", "x\ny", "\r", "\x1b[31mred", "\u202eevil", "\ud800", "x" * 4096, "NaN",
                   "-1", "12", "1e999", "float16", "float32", "bfloat16-as-uint16", "uint8", "<f4", "training",
                   "replay", "grads/mlp.up", "analysis/findings", "c", "json", "regular", "bytes", "crc32c",
                   "<script>alert(1)</script>", "=HYPERLINK(\"x\")", "+1", "@SUM(A1)"]
KEYS = ["schema", "sources", "mode", "n_records", "n_weights", "records_per_chunk", "heads", "split_axis", "role",
        "shape", "encoding", "k", "seed", "method", "edges", "scale", "format", "name", "configuration",
        "chunk_shape", "data_type", "node_type", "zarr_format", "attributes", "codecs", "fill_value"]

scalars = st.one_of(
    st.integers(), st.sampled_from(HOSTILE_INTS),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(HOSTILE_FLOATS),
    st.text(max_size=12), st.sampled_from(HOSTILE_STRINGS),
    st.booleans(), st.none(),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=5),
                            st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(max_size=6)), inner, max_size=4)),
    max_leaves=8,
)


def perturbed(orig: Any) -> st.SearchStrategy[Any]:
    """A value of the same kind as *orig* but wrong: what a subtle corruption or a malicious edit leaves.

    Random values of another type are mostly refused at the first look; these reach deeper code.
    """
    if isinstance(orig, bool):
        return st.sampled_from([not orig, int(orig), str(orig).lower(), None])
    if isinstance(orig, int):
        return st.one_of(
            st.sampled_from([orig + 1, orig - 1, -orig, 2 * orig, 1000 * orig, orig + 2**32, 0, -1, float(orig),
                             orig + 0.5, str(orig)]),
            st.integers(-4 * abs(orig) - 16, 4 * abs(orig) + 16), st.sampled_from(HOSTILE_INTS))
    if isinstance(orig, float):
        return st.one_of(st.sampled_from([-orig, 2 * orig, orig + 0.5, math.nan, math.inf, -math.inf, 0.0]),
                         st.floats(allow_nan=True, allow_infinity=True))
    if isinstance(orig, str):
        return st.one_of(
            st.sampled_from([orig + "x", orig[:-1], orig.upper(), "../" + orig, orig + "/..", orig + "\n", 2 * orig,
                             "\x1b[2J" + orig, ""]),
            st.sampled_from(HOSTILE_STRINGS), st.text(max_size=8))
    if isinstance(orig, list):
        if not orig:
            return st.lists(scalars, min_size=1, max_size=3)
        return st.one_of(
            st.integers(0, len(orig) - 1).flatmap(
                lambda i: perturbed(orig[i]).map(lambda v: [*orig[:i], v, *orig[i + 1:]])),
            st.sampled_from([orig[:-1], [*orig, orig[-1]], orig[::-1], []]))
    if isinstance(orig, dict):
        if not orig:
            return st.dictionaries(st.sampled_from(KEYS), scalars, min_size=1, max_size=2)
        keys = sorted(orig)
        return st.one_of(
            st.sampled_from(keys).flatmap(lambda k: perturbed(orig[k]).map(lambda v: {**orig, k: v})),
            st.sampled_from(keys).map(lambda k: {kk: vv for kk, vv in orig.items() if kk != k}),
            st.tuples(st.sampled_from(KEYS), json_values).map(lambda kv: {**orig, kv[0]: kv[1]}))
    return json_values


# ------------------------------------------------------------------ targets
def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key path (dict keys and list indices, at any depth) inside a JSON document."""
    out: list[tuple[Any, ...]] = []
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        out.append((*prefix, k))
        out += _paths(v, (*prefix, k))
    return out


def _get(doc: Any, path: tuple[Any, ...]) -> Any:
    for k in path:
        doc = doc[k]
    return doc


def zarr_targets(store: Path) -> dict[tuple[str, tuple[Any, ...]], Any]:
    """(zarr.json relative to the store, key path) -> original value, for every key of every zarr.json."""
    out = {}
    for f in sorted(store.rglob("zarr.json")):
        rel, doc = str(f.relative_to(store)), json.loads(f.read_text())
        out.update({(rel, path): _get(doc, path) for path in _paths(doc)})
    return out


def hdf5_targets(store: Path) -> dict[tuple[str, str, tuple[Any, ...]], Any]:
    """(object, attribute, key path inside the attribute's JSON document; () = the attribute itself) -> original."""
    import h5py

    out: dict[tuple[str, str, tuple[Any, ...]], Any] = {}
    with h5py.File(store, "r") as f:
        names = ["/"]
        f.visit(names.append)
        for name in names:
            for attr, raw in f[name].attrs.items():
                try:
                    doc = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
                except (TypeError, ValueError, AttributeError):
                    out[(name, attr, ())] = None
                    continue
                out[(name, attr, ())] = doc
                out.update({(name, attr, path): _get(doc, path) for path in _paths(doc)})
    return out


def _apply(doc: Any, path: tuple[Any, ...], action: str, value: Any) -> Any:
    """*doc* with the entry at *path* replaced by *value* (or deleted)."""
    if not path:
        return value
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    if action == "delete":
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return doc


def mutate_zarr(store: Path, target: tuple[str, tuple[Any, ...]], action: str, value: Any) -> str:
    rel, path = target
    f = store / rel
    doc = _apply(json.loads(f.read_text()), path, "delete" if action == "delete" else "replace", value)
    f.write_text(json.dumps(doc))          # NaN/Infinity as Python's json writes them: hostile too
    return f"{rel} {list(path)} {action} {value!r}"[:600]


def mutate_hdf5(store: Path, target: tuple[str, str, tuple[Any, ...]], action: str, value: Any) -> str:
    import h5py

    name, attr, path = target
    with h5py.File(store, "r+") as f:
        attrs = f[name].attrs
        if path:   # inside the attribute's JSON document
            raw = attrs[attr]
            doc = _apply(json.loads(raw.decode() if isinstance(raw, bytes) else raw), path,
                         "delete" if action == "delete" else "replace", value)
            attrs[attr] = json.dumps(doc)
        elif action == "delete":
            del attrs[attr]
        else:
            try:
                attrs[attr] = value
            except (TypeError, ValueError):   # h5py cannot store it (e.g. a NUL in a str): not a store problem
                reject()
    return f"{name} @{attr} {list(path)} {action} {value!r}"[:600]


def hdf5_attr_values() -> st.SearchStrategy[Any]:
    """What may replace a whole HDF5 attribute: JSON text, bytes, ints, int arrays."""
    return st.one_of(
        json_values.map(json.dumps),
        st.binary(min_size=1, max_size=64).map(np.void),
        st.binary(min_size=1, max_size=64).map(lambda b: np.frombuffer(b, dtype=np.uint8)),
        st.sampled_from(HOSTILE_INTS).filter(lambda i: -(2**63) <= i < 2**63).map(np.int64),
        st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=4).map(lambda v: np.array(v, np.int64)),
        st.floats(allow_nan=True, allow_infinity=True).map(np.float64),
        st.text(max_size=16),
    )


# ------------------------------------------------------------------ fixtures
class _Bases(dict):  # type: ignore[type-arg]
    def __repr__(self) -> str:   # hypothesis prints the fixtures of a failing example: keep it short
        return f"<fuzz bases in {self.get('root')}>"


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One analysed store per backend, with its mutation targets and a snapshot to check it stays untouched."""
    root = tmp_path_factory.mktemp("fuzz-bases")
    out: dict[str, Any] = _Bases(root=root)
    for suffix in SUFFIXES:
        p = build_store(root / f"base{suffix}", 8, activations=True, weights_every=4, sketch=8)
        res = run_cli(["analyze", str(p), "--out", str(root / f"out{suffix}"), "--quiet"], timeout=120)
        assert res.rc == 0, f"the valid base store does not analyse: {res}"
        originals: dict[Any, Any] = zarr_targets(p) if suffix == ".zarr" else hdf5_targets(p)
        targets = sorted(originals, key=repr)
        root_targets = [t for t in targets if (t[0] == "zarr.json" if suffix == ".zarr" else t[0] == "/")]
        assert root_targets and len(targets) > len(root_targets)
        out[suffix] = {"path": p, "targets": targets, "root_targets": root_targets, "originals": originals}
    out["snapshot"] = snapshot(root)
    return out


#: per verb tuple: example durations, and exit codes per verb (printed at the end with -s)
STATS: dict[tuple[str, ...], dict[str, Any]] = {}


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Examples live under *tmp_path*; the working directory is an empty ``cwd/`` there (relative writes show)."""
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    return tmp_path


_counter = itertools.count()


def _example(bases: dict[str, Any], workdir: Path, data: st.DataObject, verbs: tuple[str, ...],
             stratum: tuple[str, str]) -> None:
    suffix, action = stratum
    base = bases[suffix]
    target = data.draw(st.one_of(st.sampled_from(base["root_targets"]), st.sampled_from(base["targets"]),
                                 st.sampled_from(base["targets"])), label="target")
    original = base["originals"][target]
    whole_h5_attr = suffix == ".h5" and not target[-1]
    value = None
    if action == "perturb":
        value = data.draw(perturbed(original), label="value")
        if whole_h5_attr:
            value = json.dumps(value)
    elif action == "replace":
        value = data.draw(hdf5_attr_values() if whole_h5_attr else json_values, label="value")

    ex = workdir / f"ex{next(_counter)}"
    ex.mkdir()
    try:
        store = ex / f"dump{suffix}"
        if suffix == ".zarr":
            shutil.copytree(base["path"], store, symlinks=True)
            what = mutate_zarr(store, target, action, value)
        else:
            shutil.copy2(base["path"], store)
            what = mutate_hdf5(store, target, action, value)
        note = f"mutation ({suffix}): {what}"
        outside = snapshot(workdir, exclude=(ex,))
        inside = snapshot(ex)
        t0 = time.perf_counter()
        for verb in verbs:
            argv = [verb, str(store)]
            if verb != "inspect":
                argv += ["--out", str(ex / f"out-{verb}")]
            if verb == "analyze":
                argv.append("--quiet")
            res = run_cli(argv, timeout=TIMEOUT, note=note)
            rcs = STATS.setdefault(verbs, {"seconds": [], "rc": {}})["rc"]
            rcs[(verb, res.rc)] = rcs.get((verb, res.rc), 0) + 1
            try:
                assert_ok_or_error_line(res)
            except AssertionError as exc:
                exc.add_note(note)
                raise
            # The process's peak RSS may already be high from earlier tests of the same session, so
            # the bound is on what this call added to it (strict when the file runs alone: the
            # peak then starts near the interpreter's own); the address-space cap of run_cli
            # stops a runaway allocation before it pages the machine.
            assert res.rss_growth < RSS_LIMIT, (f"peak RSS grew by {res.rss_growth / GB:.2f} GB in {argv[0]} "
                                                f"(now {peak_rss() / GB:.2f} GB); {note}")
        stats = STATS.setdefault(verbs, {"seconds": [], "rc": {}})
        stats["seconds"].append(time.perf_counter() - t0)
        if stats["seconds"][-1] >= max(stats["seconds"]):
            stats["slowest"] = note
        assert diff(outside, snapshot(workdir, exclude=(ex,))) == [], f"written outside the example's directory; {note}"
        # inside: only under --out, and in the store only its analysis/ (an HDF5 store is one file)
        own = (f"{store.name}/analysis", f"{store.name}/analysis/") if suffix == ".zarr" else (store.name, None)
        stray = [p for p in diff(inside, snapshot(ex))
                 if not (p.startswith("out-") or p == own[0] or (own[1] and p.startswith(own[1])))]
        assert not stray, f"written outside --out and the store's analysis/: {stray[:5]}; {note}"
        assert snapshot(bases["root"]) == bases["snapshot"], f"the base store was changed; {note}"
    finally:
        shutil.rmtree(ex, ignore_errors=True)


def _stratum_id(stratum: tuple[str, str]) -> str:
    return f"{stratum[0].lstrip('.')}-{stratum[1]}"


@pytest.mark.slow
@pytest.mark.parametrize("stratum", STRATA, ids=_stratum_id)
@settings(max_examples=N_FULL, **FUZZ_SETTINGS)
@given(data=st.data())
def test_fuzz_metadata_all_verbs(bases: dict[str, Any], workdir: Path, data: st.DataObject,
                                 stratum: tuple[str, str]) -> None:
    _example(bases, workdir, data, ("inspect", "report", "analyze"), stratum)


@pytest.mark.slow
@pytest.mark.parametrize("stratum", STRATA, ids=_stratum_id)
@settings(max_examples=N_OPEN, **FUZZ_SETTINGS)
@given(data=st.data())
def test_fuzz_metadata_inspect(bases: dict[str, Any], workdir: Path, data: st.DataObject,
                               stratum: tuple[str, str]) -> None:
    _example(bases, workdir, data, ("inspect",), stratum)


@pytest.fixture(scope="module", autouse=True)
def _summary() -> Any:
    yield
    for verbs, stats in STATS.items():
        t = np.array(stats["seconds"])
        if t.size:
            rcs = ", ".join(f"{v} rc={rc}: {n}" for (v, rc), n in sorted(stats["rc"].items()))
            print(f"\nfuzz {'+'.join(verbs)}: {t.size} examples, {t.mean():.2f} s mean, {np.median(t):.2f} s median, "
                  f"{t.max():.2f} s max, {t.sum():.0f} s in all; {rcs}; slowest: {stats.get('slowest')}")
