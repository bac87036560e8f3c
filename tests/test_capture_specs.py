"""The capture's option groups (``gradforensics.replay.plan``), the one ``--fail-on`` rule, the shared defaults.

No model is loaded here: every check below happens before one would be.  The
end-to-end ``gf.capture`` test (against what the command writes) is in
``tests/test_capture_cli.py``.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from types import SimpleNamespace

import pytest

import gradforensics as gf
from gradforensics.cli import build_parser
from gradforensics.commands.capture import flags_of, specs
from gradforensics.errors import SpecError
from gradforensics.replay.plan import (
    DEFAULT_SKETCH,
    BatchSpec,
    ModelSpec,
    RecordSpec,
    as_spec,
    check_disk,
    exceeds_disk,
    parse_heads,
    record_bytes,
)
from gradforensics.reporting.severity import EXIT_FLAGGED, exit_code, reaches, reaching


@pytest.mark.parametrize(("make", "message"), [
    (lambda: BatchSpec(batch_size=0), "--batches-per-source and --batch-size must be >= 1; got 64 and 0."),
    (lambda: BatchSpec(batches_per_source=0), "--batches-per-source and --batch-size must be >= 1; got 0 and 8."),
    (lambda: BatchSpec(seq_len=1), "--seq-len must be >= 2; got 1."),
    (lambda: RecordSpec(sketch=0), "--sketch must be >= 1; got 0."),
    (lambda: RecordSpec(sketch=True), "--sketch must be a positive integer or None; got True."),
    (lambda: RecordSpec(full=["*.q_proj.weight"]), "--full selects whole tensors to keep next to --sketch; "
                                                    "without --sketch every recorded tensor is whole already."),
    (lambda: RecordSpec(heads=["*.q_proj.weight=x"]),
     "--heads '*.q_proj.weight=x': expected auto, none, or GLOB=H with H a positive integer."),
    (lambda: RecordSpec(dtype="int8"), "--dtype 'int8': expected one of bf16, bfloat16, f16, f32"),
    (lambda: ModelSpec(model_dtype="int8"), "--model-dtype must be one of ('float32', 'bfloat16', 'float16'); "
                                            "got 'int8'."),
    (lambda: ModelSpec(loss="mse"), "--loss must be one of auto, causal-lm, causal-lm-skip-first, masked-lm or module:function; got 'mse'."),
    (lambda: as_spec(BatchSpec, {"batch_sise": 4}), "BatchSpec: unknown option 'batch_sise'; the options are "
                                                   "batches_per_source, batch_size, seq_len, text_field, seed."),
    (lambda: as_spec(RecordSpec, 16), "expected a RecordSpec or a dict of its fields; got int."),
])
def test_each_spec_is_checked_once_with_the_commands_message(make, message):
    with pytest.raises(SpecError, match=re.escape(message)):
        make()


def test_specs_normalise_what_they_are_given_and_are_frozen():
    r = RecordSpec(tensors="*.q_proj.weight", heads=["*.q_proj.weight=8", "auto"], sketch=16, full=["*.q*"],
                   dtype="bf16")
    assert r.tensors == ("*.q_proj.weight",) and r.full == ("*.q*",) and r.dtype == "bfloat16"
    assert r.heads == {"*.q_proj.weight": 8, "auto": True}
    assert RecordSpec(heads="none").heads is None and RecordSpec().heads == "auto" == parse_heads(["auto"])
    assert RecordSpec(heads={"*.q": 4}).heads == {"*.q": 4}
    assert r.recorder_options() == {"tensors": ("*.q_proj.weight",), "heads": r.heads, "activations": None,
                                    "sketch": 16, "full": ("*.q*",), "dtype": "bfloat16", "attention": None}
    assert dataclasses.replace(r, dtype="bfloat16") == r           # a normalised spec re-validates to itself
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.sketch = 8  # type: ignore[misc]
    assert as_spec(BatchSpec, None) == BatchSpec() and as_spec(BatchSpec, {"seed": 3}).seed == 3
    assert as_spec(RecordSpec, {}, defaults={"sketch": 7}).sketch == 7
    assert as_spec(RecordSpec, {"sketch": None}, defaults={"sketch": 7}).sketch is None
    b = BatchSpec(seq_len=32)
    assert as_spec(BatchSpec, b) is b


def test_the_command_flags_are_the_spec_fields():
    """Every field of the three groups has its flag in ``capture`` (the flag's dest is the field's name)."""
    args = build_parser().parse_args(["capture", "ck", "--data", "a=a.txt", "--out", "o.zarr", "--batch-size", "4",
                                      "--heads", "*.q=2", "auto", "--dtype", "fp16", "--loss", "masked-lm"])
    for cls in (BatchSpec, RecordSpec, ModelSpec):
        assert set(flags_of(args, cls)) == {f.name for f in dataclasses.fields(cls)}, cls
    b, r, m = specs(args)
    assert b == BatchSpec(batch_size=4) and r == RecordSpec(heads={"*.q": 2, "auto": True}, dtype="float16")
    assert m == ModelSpec(loss="masked-lm")
    # the defaults of the flags are the defaults of the specs
    plain = specs(build_parser().parse_args(["capture", "ck", "--data", "a=a.txt", "--out", "o.zarr"]))
    assert plain == (BatchSpec(), RecordSpec(), ModelSpec())
    whatif = build_parser().parse_args(["whatif", "ck", "--data", "a=a.txt", "--arm", "x=sgd:lr=1", "--steps", "1",
                                        "--out", "o"])
    assert whatif.sketch == DEFAULT_SKETCH and set(flags_of(whatif, BatchSpec)) == {
        "batch_size", "seq_len", "text_field", "seed"}


def test_gf_capture_is_the_function_even_after_the_recording_package_is_imported():
    import gradforensics.recording
    import gradforensics.replay.pipeline
    from gradforensics.replay.pipeline import capture

    assert gf.capture is capture and gradforensics.recording.Recorder is gf.Recorder
    assert inspect.signature(gf.capture) == inspect.signature(capture)
    assert "capture" in gf.__all__


def test_whatif_takes_the_specs_and_the_old_keywords(tmp_path):
    """Checked before a model loads: an unknown keyword is a TypeError, a bad spec field a SpecError."""
    a = tmp_path / "a.txt"
    a.write_text("w1 w2 w3\n" * 20, encoding="utf-8")
    args = (tmp_path / "none.pt", {"a": a}, ["x=sgd:lr=0.1"], 2, tmp_path / "w")
    with pytest.raises(TypeError, match="unexpected keyword argument 'batchsize'"):
        gf.whatif(*args, batchsize=4)
    with pytest.raises(SpecError, match=re.escape("--sketch must be >= 1; got 0.")):
        gf.whatif(*args, record={"sketch": 0})
    with pytest.raises(SpecError, match=re.escape("--steps and --batch-size must be >= 1; got 2 and 0.")):
        gf.whatif(*args, batches=BatchSpec(), batch_size=0)
    with pytest.raises(SpecError, match=re.escape("--steps and --batch-size must be >= 1; got 2 and 0.")):
        gf.whatif(*args, batches={"batch_size": 0})
    with pytest.raises(SpecError, match="--model-dtype must be one of"):
        gf.whatif(*args, model=ModelSpec(), model_dtype="int8")
    assert not (tmp_path / "w").exists()


# ------------------------------------------------------------------ the disk
def test_one_disk_refusal_with_each_callers_words(tmp_path, monkeypatch, capsys):
    import shutil
    import sys

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=1000))
    per = record_bytes({"w": ((16, 16), 4)}, {}, sketch=None, full=None, n_sources=1)
    assert per == {"grads": 1024, "sketch": 0, "acts": 0, "meta": 36, "total": 1060}
    with pytest.raises(SpecError, match=re.escape(f"{tmp_path / 'd.zarr'} needs ~1.0 KiB but only 1000 B is free; "
                                                  "record fewer --tensors")):
        check_disk(per, 1, tmp_path / "d.zarr", say=sys.stderr)
    err = capsys.readouterr().err
    assert err.startswith("estimate: 1 records x 1.0 KiB (grads 1.0 KiB, meta 36 B) = 1.0 KiB; 1000 B free on the")
    assert check_disk(per, 1, tmp_path / "d.zarr", force=True)["total_bytes"] == 1060
    assert check_disk(per, 1, "s3://bucket/d.zarr")["total_bytes"] == 1060     # object storage: no free figure
    assert exceeds_disk({"total_bytes": 2, "free_bytes": 1}, tmp_path) and not exceeds_disk(
        {"total_bytes": 2, "free_bytes": 1}, "memory://x/d.zarr")


# ------------------------------------------------------------------ --fail-on
class _Rows:
    """A result that picks its own rows, as a Comparison does."""

    def __init__(self, severities):
        self.severities = severities

    def reaching(self, threshold):
        return [s for s in self.severities if reaches(s, threshold)]


def test_fail_on_is_one_rule_a_flag_at_the_threshold_fails():
    findings = SimpleNamespace(flags=[SimpleNamespace(severity=0.5), SimpleNamespace(severity=0.2)])
    assert exit_code(findings, 0.5) == EXIT_FLAGGED and exit_code(findings, 0.5 + 1e-9) == 0
    assert exit_code(findings, None) == 0 and exit_code(findings, 0.0) == EXIT_FLAGGED
    assert reaches(0.5 - 1e-13, 0.5) and not reaches(None, 0.0)
    assert [f.severity for f in reaching(findings.flags, 0.2)] == [0.5, 0.2]
    assert exit_code(_Rows([0.75]), 0.75) == EXIT_FLAGGED and exit_code(_Rows([0.74]), 0.75) == 0


def test_capture_command_names_a_bad_out_in_its_own_words(tmp_path, capsys):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from gradforensics import cli

    a = tmp_path / "a.txt"
    a.write_text("w1 w2 w3\n", encoding="utf-8")
    assert cli.main(["capture", str(tmp_path / "ck"), "--data", f"a={a}", "--out", str(tmp_path / "x.txt")]) == 2
    err = capsys.readouterr().err
    assert err == f"gradforensics capture: error: --out {tmp_path / 'x.txt'}: expected a *.zarr directory or a " \
                  "*.h5 / *.hdf5 file.\n"
