"""How the report reads a results store and fills its overview, each held against an oracle.

* series images -> what ``numpy.load`` reads, over many random series (dtypes, 0-d, empty,
  Fortran order, NaN) in ``pack_series`` and ``np.savez`` images; damaged members refused,
  naming the member and what is wrong;
* tables -> the table rules written out row by row here (cells: string, number or null; head:
  null or a non-negative integer), the first failing row named;
* flags -> the same flags with the kinds given or looked up, evidence nesting bounded;
* the overview's matrix and the layer table -> each cell is the largest severity of the flags
  on it (0 where the analysis covered the unit without a flag), written out here flag by flag;
  exact, since a maximum of given values rounds nothing;
* ``report``'s garbage collection: fewer collections inside, garbage still collected,
  the collector's settings restored after.
"""

from __future__ import annotations

import gc
import io
import math
import zipfile

import numpy as np
import pandas as pd
import pytest

from gradforensics.analysis.contract.model import AnalysisResult, Findings, Flag
from gradforensics.analysis.engine.results import pack_series, parse_flag, parse_series, parse_table
from gradforensics.errors import CorruptStoreError

RNG = np.random.default_rng(28)
DTYPES = ["<f8", "<f4", "<i8", "<i4", "|u1", "|b1", "<c16", "<U7", ">f8", "<f2"]


def _random_series(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    out = {}
    for i in range(n):
        dt = np.dtype(DTYPES[rng.integers(len(DTYPES))])
        shape = [(), (0,), (1,), (int(rng.integers(2, 40)),), (int(rng.integers(1, 6)), int(rng.integers(1, 6))),
                 (2, 0, 3)][rng.integers(6)]
        if dt.kind == "U":
            a = np.asarray(rng.choice(["", "a", "bé", "xyz1234"], size=shape)).astype(dt)
        elif dt.kind == "b":
            a = rng.random(shape) < 0.5
        else:
            a = (rng.standard_normal(shape) * 100).astype(dt)
            if dt.kind in "fc" and a.size:
                a.flat[rng.integers(a.size)] = np.nan
        if a.ndim == 2 and rng.random() < 0.5:
            a = np.asfortranarray(a)
        out[f"g/{i}/{'x' * int(rng.integers(0, 3))}"] = a
    return out


def _same_arrays(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert list(got) == list(want)
    for k, v in want.items():
        g = got[k]
        assert (g.dtype, g.shape, g.tobytes(order="A")) == (v.dtype, v.shape, v.tobytes(order="A")), k
        assert g.flags.f_contiguous == v.flags.f_contiguous and g.flags.c_contiguous == v.flags.c_contiguous, k
        assert g.flags.writeable, k


def _np_load(image: np.ndarray) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(image.tobytes()), allow_pickle=False) as z:
        return {str(k): z[f"s{i}"] for i, k in enumerate(z["__keys__"])}


@pytest.mark.parametrize("seed", range(12))
def test_series_images_read_as_numpy_load_reads_them(seed: int) -> None:
    rng = np.random.default_rng(seed)
    series = _random_series(rng, int(rng.integers(0, 60)))
    image = pack_series(series)
    _same_arrays(parse_series(image), _np_load(image))
    buf = io.BytesIO()                                   # an image np.savez wrote (zipfile's own layout)
    np.savez(buf, **{f"s{i}": v for i, v in enumerate(series.values())},
             __keys__=np.asarray(list(series), dtype=str))
    old = np.frombuffer(buf.getvalue(), dtype=np.uint8)
    _same_arrays(parse_series(old), _np_load(old))


def test_the_members_arrays_are_their_own_and_writable() -> None:
    got = parse_series(pack_series({"a": np.arange(5.0), "b": np.arange(5.0)}))
    got["a"][0] = 7.0
    assert got["a"][0] == 7.0 and got["b"][0] == 0.0


def _member(image: np.ndarray, name: str) -> zipfile.ZipInfo:
    with zipfile.ZipFile(io.BytesIO(image.tobytes())) as zf:
        return zf.getinfo(name)


def _damaged(image: np.ndarray, at: int, data: bytes) -> np.ndarray:
    b = bytearray(image.tobytes())
    b[at:at + len(data)] = data
    return np.frombuffer(bytes(b), dtype=np.uint8)


def test_damaged_members_are_refused_with_their_messages() -> None:
    image = pack_series({"j": np.zeros(3), "k": np.arange(16, dtype=np.float64)})
    info = _member(image, "s1.npy")                     # not the first: its header is not the zip's magic
    start = info.header_offset + 30 + len("s1.npy")
    cases = {
        "has no local header": _damaged(image, info.header_offset, b"PK\x09\x09"),
        "is truncated or fails its CRC-32": _damaged(image, start + 200, b"\xff"),
    }
    for what, bad in cases.items():
        with pytest.raises(CorruptStoreError, match=rf"member 's1\.npy' {what}"):
            parse_series(bad)


def _savez_with(member: bytes) -> np.ndarray:
    """A zip of ``__keys__`` (one key) and ``s0.npy`` holding *member* as written."""
    buf = io.BytesIO()
    keys = io.BytesIO()
    np.save(keys, np.asarray(["k"]))
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("__keys__.npy", keys.getvalue())
        zf.writestr("s0.npy", member)
    return np.frombuffer(buf.getvalue(), dtype=np.uint8)


def test_bad_npy_members_are_refused_with_their_messages() -> None:
    good = io.BytesIO()
    np.save(good, np.arange(8, dtype=np.float64))
    raw = good.getvalue()
    header_end = raw.index(b"\n") + 1                 # the data of 8 floats after it
    with pytest.raises(CorruptStoreError, match=r"member 's0\.npy' has \.npy version \(3, 0\)"):
        parse_series(_savez_with(raw[:6] + b"\x03\x00" + raw[8:]))
    big = io.BytesIO()
    np.save(big, np.arange(100, dtype=np.float64))
    declared = big.getvalue()
    with pytest.raises(CorruptStoreError, match=r"declares shape \(100,\) of float64, more than its"):
        parse_series(_savez_with(declared[:declared.index(b"\n") + 1] + raw[header_end:]))
    parse_series(_savez_with(raw))                                     # the intact member reads


# ------------------------------------------------------------------ tables
def _rows_oracle(data: list, columns: list[str]) -> str | None:
    """The table rules, row by row: the message of the first failing row (None: the table is valid)."""
    head = columns.index("head") if "head" in columns else None
    for i, row in enumerate(data):
        if not isinstance(row, list) or len(row) != len(columns):
            return f"row {i} must be a list of {len(columns)} cells"
        if not all(c is None or isinstance(c, (str, int, float)) for c in row):
            return f"row {i} holds a cell that is not a string, number or null"
        h = None if head is None else row[head]
        if h is not None and not (isinstance(h, (int, float)) and not isinstance(h, bool) and math.isfinite(h)
                                  and h >= 0 and h == int(h)):
            return f"row {i}: head must be null or a non-negative integer"
    return None


def _mutate(rng: np.random.Generator, data: list, n_cols: int) -> None:
    i = int(rng.integers(len(data)))
    bad = [("row", (1, 2)), ("row", [1.0] * (n_cols + 1)), ("row", "text"), ("cell", [1]), ("cell", {"a": 1}),
           ("cell", b"x"), ("head", -1), ("head", 1.5), ("head", float("nan")), ("head", "2"), ("head", True),
           ("cell", np.float32(1.0)), ("cell", True), ("head", 3)][rng.integers(14)]
    where, value = bad
    if where == "row":
        data[i] = value
    elif where == "cell":
        data[i][int(rng.integers(1, n_cols))] = value
    else:
        data[i][1] = value


@pytest.mark.parametrize("seed", range(40))
def test_tables_are_accepted_and_refused_by_the_rules(seed: int) -> None:
    rng = np.random.default_rng(seed)
    columns = ["tensor", "head", "x", "y"]
    n = int(rng.integers(1, 30))
    data = [[f"t{j}", None if rng.random() < 0.5 else int(rng.integers(0, 4)), float(rng.standard_normal()),
             None if rng.random() < 0.2 else int(rng.integers(-5, 5))] for j in range(n)]
    for _ in range(int(rng.integers(0, 3))):
        _mutate(rng, data, len(columns))
    want = _rows_oracle(data, columns)
    if want is None:
        got = parse_table({"columns": columns, "data": data}, "here")
        pd.testing.assert_frame_equal(got, parse_table({"columns": columns, "data": [list(r) for r in data]}, "x"))
        assert len(got) == n
    else:
        with pytest.raises(CorruptStoreError, match="^here: " + want.replace("(", r"\(")):
            parse_table({"columns": columns, "data": data}, "here")


def test_a_table_without_a_head_column_checks_every_cell() -> None:
    assert len(parse_table({"columns": ["tensor", "v"], "data": [["a", 1], ["b", None]]}, "t")) == 2
    with pytest.raises(CorruptStoreError, match="row 1 holds a cell"):
        parse_table({"columns": ["tensor", "v"], "data": [["a", 1], ["b", [2]]]}, "t")


# ------------------------------------------------------------------ flags
GOOD = {"kind": "conflict", "tensor": "t", "head": None, "sources": ["a", "b"], "severity": 0.7,
        "records": [0, 3], "evidence": {"cosine": -0.5}, "summary": "s"}


def test_flags_parse_the_same_with_the_kinds_given_and_nesting_still_bounded() -> None:
    from gradforensics.analysis.contract.registry import flag_kinds

    assert parse_flag(GOOD) == parse_flag(GOOD, "flag", flag_kinds())
    deep: dict = {"v": 1}
    for _ in range(20):
        deep = {"d": deep}
    for kinds in (None, flag_kinds()):
        with pytest.raises(CorruptStoreError, match="nested deeper than 16"):
            parse_flag({**GOOD, "evidence": deep}, "f", kinds)
        with pytest.raises(CorruptStoreError, match="kind must be one of " + ", ".join(flag_kinds())):
            parse_flag({**GOOD, "kind": "nope"}, "f", kinds)
    flat = parse_flag({**GOOD, "evidence": {"a": 1, "b": "x", "c": None}})
    assert flat.evidence == {"a": 1, "b": "x", "c": None}


# ------------------------------------------------------------------ overview and layer table
def _findings(rng: np.random.Generator, heads: bool) -> Findings:
    tensors = [f"model.layers.{i}.mlp.weight" for i in range(int(rng.integers(1, 12)))] + ["lm_head.weight"]
    def table(with_head: bool) -> pd.DataFrame:
        rows = [(t, float(h) if with_head else np.nan) for t in tensors for h in (range(3) if with_head else [0])]
        return pd.DataFrame(rows, columns=["tensor", "head"])
    results = {"conflict": AnalysisResult(table(heads), {}), "drift": AnalysisResult(table(False), {}),
               "noise": AnalysisResult(pd.DataFrame(), {})}
    flags = []
    for _ in range(int(rng.integers(0, 40))):
        kind = ["conflict", "drift", "noise", "oscillation"][rng.integers(4)]
        ev = {"analysis": "drift"} if rng.random() < 0.2 else {}
        head = int(rng.integers(0, 3)) if heads and rng.random() < 0.6 else None
        flags.append(Flag(kind, str(rng.choice(tensors)), head, (), float(rng.choice([0.0, 0.3, 0.5, 0.75, 1.0])),
                          (0, 3), ev, "s"))
    flags.sort(key=lambda f: -f.severity)
    return Findings("s", 4, "training", (), {}, results, flags)


def _overview_oracle(findings: Findings):
    """The matrix by its definition: per cell the largest severity of its flags, 0 where covered."""
    from gradforensics.reporting import figures, names
    from gradforensics.store.names import layer_of

    ov = figures.overview_data(findings)
    rows, h = ov.rows, ov.heads
    col = {lay: j for j, lay in enumerate(ov.layers)}
    m = np.full(ov.matrix.shape, np.nan)

    def cols(name: str, head: int | None) -> slice:
        lay = layer_of(name)
        j = col[figures.OTHER if lay is None else lay]
        if head is None or h == 1:
            return slice(j * h, (j + 1) * h)
        return slice(j * h + head, j * h + head + 1)

    for r, n in enumerate(rows):
        entries = names.table_units(findings.table(n))
        if not entries:
            m[r, :] = 0.0
        for t, _ in entries:
            m[r, cols(t, None)] = 0.0
    for f in findings.flags:
        r = rows.index(figures.analysis_name(f, findings))
        s = cols(f.tensor, f.head)
        cur = m[r, s]
        m[r, s] = np.where(np.isnan(cur), f.severity, np.maximum(np.nan_to_num(cur), f.severity))
    return ov, m


@pytest.mark.parametrize("seed", range(16))
def test_overview_matrix_and_layer_table_hold_each_cells_largest_severity(seed: int) -> None:
    from gradforensics.reporting import figures, tables

    findings = _findings(np.random.default_rng(seed), heads=seed % 2 == 0)
    ov, want = _overview_oracle(findings)
    np.testing.assert_array_equal(ov.matrix, want)
    assert figures.flag_analyses(findings) == [figures.analysis_name(f, findings) for f in findings.flags]
    cols, rows = tables.layer_table(findings)
    for f in findings.flags:                          # every flag's cell holds at least its severity
        a = figures.analysis_name(f, findings)
        row = next(r for r in rows if (r["tensor"], r["head"]) == (f.tensor, f.head))
        assert a in cols and row[a] >= f.severity and f.kind in row["flags"]


# ------------------------------------------------------------------ garbage collection
def test_few_collections_restores_the_collector_and_still_collects() -> None:
    import weakref

    from gradforensics.commands.report import COLLECT_EVERY, few_collections

    before, frozen = gc.get_threshold(), gc.get_freeze_count()
    assert frozen == 0
    with few_collections():
        assert gc.get_threshold()[0] == max(before[0], COLLECT_EVERY)
        assert gc.get_freeze_count() > 0

        class Node:
            pass

        a, b = Node(), Node()
        a.other, b.other = b, a                       # a cycle: only the collector frees it
        gone = weakref.ref(a)
        del a, b
        gc.collect()
        assert gone() is None
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0


def test_few_collections_leaves_what_was_frozen_before_frozen_and_collection_off_off() -> None:
    from gradforensics.commands.report import few_collections

    before = gc.get_threshold()
    gc.freeze()
    try:
        n = gc.get_freeze_count()
        with few_collections():
            pass
        assert gc.get_freeze_count() >= n
    finally:
        gc.unfreeze()
    gc.set_threshold(0)
    try:
        with few_collections():
            assert gc.get_threshold()[0] == 0
    finally:
        gc.set_threshold(*before)
