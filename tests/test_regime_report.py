"""The analysis regime (exact or long-history) is stated in flags.json and in the report.

DESIGN.md, "Long histories": what changes above N₀ is stated in flags.json header
fields and the report.  A small planted long store (:mod:`gradforensics.testing.planted_long`)
is forced into the long-history regime with the engine option ``long_history=0``.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest

import gradforensics as gf
from gradforensics.reporting import document, flagsjson, recordsmap
from gradforensics.testing.planted_long import long_history_store

N = 600
FORCE_LONG = {"engine": {"long_history": 0, "persist": False}}
ONLY = "drift,conflict,oscillation"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("regime") / "long.zarr"
    long_history_store(path, n=N, seed=1)
    return path


@pytest.fixture(scope="module")
def long_findings(store: Path) -> Any:
    return gf.analyze(store, only=ONLY, options=FORCE_LONG, progress=False)


@pytest.fixture(scope="module")
def exact_findings(store: Path) -> Any:
    """An exact pass, saved in the store (its Gram matrices are what the records map reads)."""
    return gf.analyze(store, only=ONLY, progress=False)


def test_flags_json_states_the_long_history_regime(long_findings: Any) -> None:
    regime = long_findings.header["regime"]
    doc = json.loads(json.dumps(long_findings.flags_json()))
    assert doc["regime"] == regime and regime["name"] == "long-history" and regime["n0"] == 0
    # the windows cover every record, the last one partly at most
    assert regime["window"] * regime["windows"] >= N > regime["window"] * (regime["windows"] - 1)
    assert regime["band"] >= 1
    flagsjson.validate(doc)
    assert list(doc) == ["schema", "store", "n_records", "mode", "regime", "flags", "not_judged"]


def test_flags_json_states_the_exact_regime(exact_findings: Any) -> None:
    doc = json.loads(json.dumps(exact_findings.flags_json()))
    assert doc["regime"]["name"] == "exact" and doc["regime"]["n0"] >= N
    assert set(doc["regime"]) == {"name", "n0"}
    flagsjson.validate(doc)


def _regime_mutations() -> list[tuple[str, Any]]:
    def setr(key: str, value: Any) -> Any:
        return lambda d: d["regime"].__setitem__(key, value)

    return [
        ("name", setr("name", "approximate")), ("missing", lambda d: d["regime"].pop("n0")),
        ("window", setr("window", 0)), ("extra", setr("extra", 1)), ("n0", setr("n0", "4096")),
        ("regime", lambda d: d.__setitem__("regime", "long-history")),
    ]


def test_regime_schema_rejects_mutations_like_jsonschema(long_findings: Any, exact_findings: Any) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    v = jsonschema.Draft202012Validator(flagsjson.FLAGS_SCHEMA)
    for findings in (long_findings, exact_findings):
        doc = json.loads(json.dumps(findings.flags_json()))
        assert flagsjson.errors(doc) == [] and not list(v.iter_errors(doc))
        for what, mutate in _regime_mutations():
            bad = copy.deepcopy(doc)
            mutate(bad)
            assert flagsjson.errors(bad), (what, bad["regime"])
            assert list(v.iter_errors(bad)), (what, bad["regime"])
    long = json.loads(json.dumps(long_findings.flags_json()))
    long["regime"].pop("band")                       # a long-history regime states its band
    assert flagsjson.errors(long) and list(v.iter_errors(long))
    exact = json.loads(json.dumps(exact_findings.flags_json()))
    exact["regime"]["window"] = 24                   # an exact regime has no windows
    assert flagsjson.errors(exact) and list(v.iter_errors(exact))
    exact.pop("regime")                              # findings saved before the field existed stay valid
    assert flagsjson.errors(exact) == [] and not list(v.iter_errors(exact))


def test_report_states_the_long_history_regime_and_skips_the_records_map(long_findings: Any, tmp_path: Path) -> None:
    assert recordsmap.pick(long_findings) is not None, "the planted store must raise a direction finding"
    r = long_findings.header["regime"]
    paths = gf.report(long_findings, tmp_path / "r")
    html = paths["html"].read_text()
    md = paths["markdown"].read_text()
    sentence = (f"{N:,} records above N₀ = 0: long-history regime, windows of {r['window']:,} records "
                f"({r['windows']:,} windows), band {r['band']:,} lags; per-record maps omitted.")
    assert f'<p class="regime" id="regime">{sentence}</p>' in html
    assert html.index('id="regime"') < html.index('id="at-a-glance"')          # under the verdict
    assert md.split("## At a glance")[0].count(sentence) == 1
    assert "long-history regime keeps window means" in html and "No records map:" in md
    assert not list((tmp_path / "r" / "figures").glob("records-map-*.png"))
    assert json.loads(paths["flags"].read_text())["regime"] == r


def test_records_map_skips_itself_on_the_regime_even_with_a_store(long_findings: Any, exact_findings: Any,
                                                                    store: Path) -> None:
    """The regime alone decides: a store that holds an exact pass's Gram matrices is not read."""
    from gradforensics.store.reader import Store

    assert recordsmap.records_map(exact_findings, Store(store))[0] is not None     # the exact pass's K is there
    fig, why, m = recordsmap.build(long_findings, Store(store))
    assert fig is None and m is None and why is not None and "long-history" in why and "N₀ = 0" in why


@pytest.mark.slow
def test_exact_regime_report_has_the_map_and_no_regime_note(exact_findings: Any, store: Path,
                                                              tmp_path: Path) -> None:
    paths = gf.report(exact_findings, tmp_path / "x", store)
    html = paths["html"].read_text()
    assert 'id="regime"' not in html
    assert re.search(rf"<th>Regime</th><td>{N:,} records, at most N₀ = [\d,]+: exact regime", html)
    assert list((tmp_path / "x" / "figures").glob("records-map-*.png"))
    assert document.regime_sentence(exact_findings).startswith(f"{N:,} records, at most N₀")


@pytest.mark.parametrize("regime", [{"name": "long-history", "n0": -1, "window": 2, "windows": 3, "band": 4},
                                    {"name": "exact", "n0": 4096, "band": 1}, {"name": "other", "n0": 1}, "exact",
                                    {"name": "long-history", "n0": 0, "window": 2.5, "windows": 3, "band": 4}])
def test_a_damaged_regime_in_saved_findings_is_left_out(long_findings: Any, tmp_path: Path, regime: Any) -> None:
    """A header read back from someone else's store may hold anything: the report must not fail on it."""
    import dataclasses

    f = dataclasses.replace(long_findings, header={**long_findings.header, "regime": regime})
    doc = f.flags_json()
    assert "regime" not in doc and flagsjson.errors(json.loads(json.dumps(doc))) == []
    assert document.regime_sentence(f) is None and not document.is_long_history(f)
    assert recordsmap.records_map(f, None) == (None, "the store was not given to the report, so its saved Gram "
                                                     "matrices cannot be read")
