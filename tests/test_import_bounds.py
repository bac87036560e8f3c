"""Sources that would hang an import or blow its memory up are refused in one line (issue 42, bounds).

A Megatron rank file that is a named pipe (``open()`` would wait for a writer forever), a
checkpoint whose tensor is a stride-0 view (``torch.zeros(1).expand(N, N)``: a few bytes saved,
N*N*4 declared), a ``trainer_state.json`` of millions of empty log entries.  The FIFO case runs
the CLI in a subprocess with a deadline, so a regression fails instead of hanging the suite.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from test_import_hostile import _refused, _series  # noqa: E402
from test_import_megatron import LAYOUTS, reference, write_dump  # noqa: E402

from gradforensics.errors import CheckpointError, LogReadError, SpecError  # noqa: E402

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes")


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_a_rank_file_that_is_a_fifo_is_refused_not_waited_on(tmp_path):
    lay = LAYOUTS["tp2_pp2"]
    save = write_dump(tmp_path / "save", lay, {it: reference(lay, it) for it in (1, 2)})
    fifo = save / "wgrads" / "iter_0000002" / "mp_rank_01_000.pth"
    fifo.unlink()
    os.mkfifo(fifo)
    run = subprocess.run([sys.executable, "-m", "gradforensics", "import", str(save), "--format", "megatron",
                          "--gated-mlp", "--out", str(tmp_path / "out.zarr"), "--quiet"],
                         capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[1])
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1, run.stderr
    assert "mp_rank_01_000.pth: a named pipe (FIFO), not a regular file" in lines[0]


@pytest.mark.parametrize("reader", ["json", "safetensors", "torch", "log", "heads"])
def test_every_reader_refuses_a_fifo_without_blocking(tmp_path, reader):
    from gradforensics import logs
    from gradforensics.recording.heads import parse_cli_heads
    from gradforensics.replay import untrusted

    fifo = tmp_path / "x.json"
    os.mkfifo(fifo)
    call = {"json": untrusted.read_json_object, "safetensors": untrusted.check_safetensors,
            "torch": untrusted.torch_load, "log": logs.read_table,
            "heads": lambda f: parse_cli_heads([str(f)])}[reader]
    with pytest.raises((CheckpointError, LogReadError, SpecError), match="a named pipe"):
        call(fifo)


def test_a_stride_0_tensor_is_refused_before_it_is_materialised(tmp_path, capsys):
    d = _series(tmp_path)
    torch.save({"model": {"w": torch.zeros(1).expand(12000, 12000), "b": torch.randn(3)}}, d / "step_10.pt")
    assert (d / "step_10.pt").stat().st_size < 4096          # 576 MB declared
    before = _peak_mib()
    _refused(tmp_path, capsys, [str(d)], "step_10.pt", "tensor 'model.w'", "strides (0, 0)", "storage of 4 B")
    assert _peak_mib() - before < 200


def test_views_that_fit_their_storage_still_load(tmp_path):
    from gradforensics.replay.untrusted import torch_load

    x = torch.arange(10.0)
    torch.save({"part": x[2:5], "whole": x, "ids": torch.arange(5).expand(1, -1), "t": x.view(2, 5).t()},
               tmp_path / "v.pt")
    got = torch_load(tmp_path / "v.pt")
    assert got["part"].tolist() == [2.0, 3.0, 4.0] and got["ids"].shape == (1, 5) and got["t"].shape == (5, 2)


def _hf_series(tmp_path: Path, state: str) -> Path:
    d = _series(tmp_path, 2)
    (d / "trainer_state.json").write_text(state)
    return d


def test_a_trainer_state_of_millions_of_empty_entries_is_refused_in_one_line(tmp_path, capsys):
    n = 6_000_000                                              # 18 MB; the 95 MB file cost 2.45 GB
    d = _hf_series(tmp_path, '{"log_history": [' + "{}," * (n - 1) + "{}]}")
    before = _peak_mib()
    _refused(tmp_path, capsys, [str(d)], "trainer_state.json", "6,000,002 JSON objects", "at most 2,000,000")
    assert _peak_mib() - before < 150


def test_a_trainer_state_under_the_cap_is_streamed_entry_by_entry(tmp_path):
    from gradforensics.importing.trainer_state import read_log_history

    rows = [{"step": s, "loss": 2.0 - s / 1e6, "learning_rate": 1e-3} for s in range(1, 300_000)]
    rows[5:5] = [{}, {"epoch": 1}, {"step": 7, "eval_loss": 3.0}, {"step": True, "loss": 1.0}]
    f = tmp_path / "trainer_state.json"
    f.write_text(json.dumps({"best_metric": None, "global_step": 10, "log_history": rows,
                             "stateful_callbacks": {"TrainerControl": {"args": {"should_save": True}}}},
                            indent=2, sort_keys=True))
    got = read_log_history(f)
    assert got is not None and len(got) == 299_999
    assert got[7] == {"loss": 2.0 - 7 / 1e6, "lr": 1e-3} and got[1] == {"loss": 2.0 - 1e-6, "lr": 1e-3}


@pytest.mark.parametrize("text, expect", [
    ("[1]", "holds an array, not a JSON object"),
    ('{"log_history": 3}', "log_history is not a list"),
    ('{"log_history": [{},]}', "not valid JSON"),
    ('{"log_history": [{}]} tail', "not valid JSON"),
    ('{"log_history": [{}]', "not valid JSON"),
])
def test_a_broken_trainer_state_is_one_line(tmp_path, text, expect):
    from gradforensics.importing.trainer_state import read_log_history

    f = tmp_path / "trainer_state.json"
    f.write_text(text)
    with pytest.raises(CheckpointError, match=expect):
        read_log_history(f)


def test_a_store_whose_metadata_is_a_fifo_is_refused_not_waited_on(tmp_path):
    from gradforensics.testing.planted import nonfinite_store

    store = tmp_path / "dump.zarr"
    nonfinite_store(store, n_records=4, records=(1,))
    meta = next(p for p in sorted((store / "grads").rglob("zarr.json")) if p.parent != store / "grads")
    meta.unlink()
    os.mkfifo(meta)
    run = subprocess.run([sys.executable, "-m", "gradforensics", "inspect", str(store)], capture_output=True,
                         text=True, timeout=120, cwd=Path(__file__).parents[1])
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1, run.stderr
    assert "zarr.json: not a regular file" in lines[0]


@pytest.mark.parametrize("suffix, text", [(".json", "[" + "{}," * 4999 + "{}]"), (".jsonl", "{}\n" * 5000)])
def test_a_json_log_of_millions_of_empty_rows_is_refused_before_pandas(tmp_path, monkeypatch, suffix, text):
    """Issue 42: 95 MB of ``{},`` cost `loss` 2.6 GB (array) / 4.9 GB (JSON Lines); the cap is 1000 here."""
    from gradforensics import logs

    monkeypatch.setattr(logs, "MAX_JSON_ROWS", 1000)
    f = tmp_path / f"log{suffix}"
    f.write_text(text)
    with pytest.raises(LogReadError, match=r"up to 5,00[01] JSON objects and arrays; a JSON log is read up to 1,000"):
        logs.read_table(f)
    f = tmp_path / "fine.jsonl"
    f.write_text("".join(json.dumps({"step": i, "loss": 1.0 / (i + 1)}) + "\n" for i in range(900)))
    assert len(logs.read_table(f)) == 900
