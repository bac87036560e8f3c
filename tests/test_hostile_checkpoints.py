"""Checkpoints you did not write: every broken or hostile one is one line naming the file, exit 2.

Each case is built here from a tiny LLaMA saved with ``save_pretrained``: safetensors cut
in the data or in the header, a header length of 2**62 (refused from the file size, before
anything is allocated for it), data offsets outside the file, pickles that name a global
outside torch's allowlist (the payload would create a marker file: it must not exist),
garbage and truncated ``.bin`` files, a zip that is not a torch archive, and malformed,
non-object and 200000-deep JSON.  The same files are handed to ``--model-factory`` as
state-dict files, and to the library calls, which raise the same one-line error.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import struct
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")

from test_capture_cli import corpus, llama_config  # noqa: E402

import gradforensics as gf  # noqa: E402
from gradforensics.cli import main  # noqa: E402
from gradforensics.errors import CheckpointError  # noqa: E402
from gradforensics.replay.checkpoint import load_checkpoint  # noqa: E402
from gradforensics.replay.untrusted import check_safetensors, read_json_object, read_state_dict  # noqa: E402

FACTORY = "test_capture_cli:tiny_llama_factory"
HUGE = 2**62


class Payload:
    """Unpickled without weights_only, this runs ``touch MARKER``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


# ---------------------------------------------------------------- building
@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A tiny LLaMA directory (model.safetensors, config, a word-level tokenizer) and a data file."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    d = tmp_path_factory.mktemp("base")
    words = ["<pad>", "<s>", "</s>", "<unk>", *sorted(set(" ".join(corpus("en", 50, 0)).split()))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                pad_token="<pad>", unk_token="<unk>")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(llama_config(300)).save_pretrained(d)
    fast.save_pretrained(d)
    (d / "en.txt").write_text("\n".join(corpus("en", 40, 1)) + "\n", encoding="utf-8")
    return d


def safetensors_parts(file: Path) -> tuple[dict, bytes]:
    raw = file.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def safetensors_bytes(header: dict, data: bytes) -> bytes:
    head = json.dumps(header).encode()
    return struct.pack("<Q", len(head)) + head + data


def _first_tensor(header: dict) -> str:
    return next(k for k in header if k != "__metadata__")


def _moved_offsets(raw: bytes, header: dict, data: bytes) -> bytes:
    header[_first_tensor(header)]["data_offsets"][1] = len(data) + 4096
    return safetensors_bytes(header, data)


def _wrong_shape(raw: bytes, header: dict, data: bytes) -> bytes:
    header[_first_tensor(header)]["shape"][0] += 1
    return safetensors_bytes(header, data)


#: safetensors damage: (raw, header, data) -> the damaged file, and what the line says
SAFETENSORS: dict[str, tuple[Callable[[bytes, dict, bytes], bytes], str]] = {
    "cut_in_data": (lambda raw, h, d: raw[:len(raw) - len(d) // 2], "holds {data} B after its header: truncated"),
    "cut_in_header": (lambda raw, h, d: raw[:8 + (len(raw) - len(d) - 8) // 2],
                      "the safetensors header length says {n} B but the file is {size} B in all: truncated"),
    "header_2_62": (lambda raw, h, d: struct.pack("<Q", HUGE) + raw[8:],
                    f"the safetensors header length says {HUGE} B but the file is {{size}} B in all"),
    "offsets_outside": (_moved_offsets, "ends at byte"),
    "wrong_shape": (_wrong_shape, "but its data_offsets span"),
    "header_not_json": (lambda raw, h, d: struct.pack("<Q", 12) + b"{not json!!}" + d,
                        "safetensors header: not valid JSON"),
    "header_array": (lambda raw, h, d: struct.pack("<Q", 2) + b"[]" + d, "safetensors header: holds an array"),
    "three_bytes": (lambda raw, h, d: b"abc", "3 B, too short for a safetensors file"),
}


def _state_dict(base: Path) -> dict:
    return transformers.LlamaForCausalLM.from_pretrained(base).state_dict()


#: pickled-file damage: (file, base, marker) -> writes the damaged file, and what the line says
PICKLES: dict[str, tuple[Callable[[Path, Path, Path], object], str]] = {
    "global_protocol_2": (lambda f, b, m: f.write_bytes(pickle.dumps(Payload(m), protocol=2)),
                          "holds objects outside plain tensors and containers (posix.system)"),
    "global_in_torch_zip": (lambda f, b, m: torch.save({"model.norm.weight": torch.ones(4), "x": Payload(m)}, f),
                            "holds objects outside plain tensors and containers (posix.system)"),
    "garbage": (lambda f, b, m: f.write_bytes(bytes(range(256)) * 8), "not a PyTorch checkpoint torch.load can read"),
    "truncated_zip": (lambda f, b, m: (torch.save(_state_dict(b), f), f.write_bytes(f.read_bytes()[:20000])),
                      "a zip archive (torch.save's format) without its central directory: truncated"),
    "zip_not_torch": (lambda f, b, m: zipfile.ZipFile(f, "w").writestr("notes.txt", "hello"),
                      "not a PyTorch checkpoint torch.load can read"),
    "empty": (lambda f, b, m: f.write_bytes(b""), "not a PyTorch checkpoint torch.load can read"),
}

DEEP = "[" * 200000 + "]" * 200000
#: JSON damage: file name -> content -> what the line says
JSONS: dict[str, tuple[str, str | None, str]] = {
    "config_malformed": ("config.json", '{"model_type": "llama",', "not valid JSON"),
    "config_array": ("config.json", "[1, 2, 3]", "holds an array, not a JSON object"),
    "config_string": ("config.json", '"llama"', "holds a string, not a JSON object"),
    "config_deep": ("config.json", DEEP, "JSON nested too deeply to read"),
    "config_deep_inside": ("config.json", '{"model_type": "llama", "x": ' + DEEP + "}", "JSON nested too deeply"),
    "config_latin1": ("config.json", None, "not UTF-8 text"),
    "config_architectures": ("config.json", '{"model_type": "llama", "architectures": 5}',
                             "architectures must be a list of class names"),
    "generation_config_deep": ("generation_config.json", DEEP, "JSON nested too deeply to read"),
    "tokenizer_config_array": ("tokenizer_config.json", "[]", "holds an array"),
    "tokenizer_deep": ("tokenizer.json", DEEP, "JSON nested too deeply to read"),
}


def run_capture(ckpt: Path, base: Path, tmp_path: Path, capsys, *extra: object) -> tuple[int, str]:
    argv = ["capture", str(ckpt), "--data", f"en={base / 'en.txt'}", "--out", str(tmp_path / "out.zarr"),
            "--seq-len", "16", "--batch-size", "2", "--batches-per-source", "1", "--quiet", *map(str, extra)]
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rc = main(argv)
    return rc, capsys.readouterr().err


def assert_one_line(rc: int, err: str, file: Path, want: str) -> None:
    assert rc == 2, err
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert "Traceback" not in err and str(file) in err and want in err, err


def hf_copy(base: Path, tmp_path: Path) -> Path:
    d = tmp_path / "ckpt"
    shutil.copytree(base, d, ignore=shutil.ignore_patterns("en.txt"))
    return d


# ---------------------------------------------------------------- safetensors
@pytest.mark.parametrize("case", sorted(SAFETENSORS))
def test_damaged_model_safetensors_is_one_line(tmp_path, base, capsys, case):
    d = hf_copy(base, tmp_path)
    file = d / "model.safetensors"
    raw = file.read_bytes()
    header, data = safetensors_parts(file)
    damage, want = SAFETENSORS[case]
    file.write_bytes(damage(raw, header, data))
    size = file.stat().st_size
    want = want.format(size=size, n=len(raw) - len(data) - 8, data=size - (len(raw) - len(data)))
    rc, err = run_capture(d, base, tmp_path, capsys)
    assert_one_line(rc, err, file, want)
    with pytest.raises(CheckpointError, match="^" + re.escape(str(file))):
        load_checkpoint(d)


def test_header_length_2_62_is_refused_from_the_file_size(tmp_path, monkeypatch):
    """Nothing is allocated for the header: the length is compared with the file size and the cap first."""
    from gradforensics.replay import untrusted

    file = tmp_path / "huge.safetensors"
    file.write_bytes(struct.pack("<Q", HUGE) + b"{}" + b"\0" * 64)
    with pytest.raises(CheckpointError, match=rf"header length says {HUGE} B but the file is 74 B in all"):
        check_safetensors(file)
    assert untrusted.MAX_HEADER_BYTES == 100_000_000      # the safetensors library's own cap
    monkeypatch.setattr(untrusted, "MAX_HEADER_BYTES", 1000)
    big = tmp_path / "big.safetensors"                     # within the file, past the cap: refused by the cap
    big.write_bytes(struct.pack("<Q", 1001) + b" " * 2000)
    with pytest.raises(CheckpointError, match=r"says 1001 B \(the file is 2008 B\); a header may take at most 1000 B"):
        check_safetensors(big)


def test_sharded_safetensors_are_checked_shard_by_shard(tmp_path, base, capsys):
    d = tmp_path / "sharded"
    transformers.LlamaForCausalLM.from_pretrained(base).save_pretrained(d, max_shard_size="100KB")
    for f in base.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, d / f.name)
    shards = sorted(d.glob("model-*.safetensors"))
    assert len(shards) >= 2 and not (d / "model.safetensors").exists()
    assert load_checkpoint(d).kind == "hf"                     # a sound sharded checkpoint loads
    shards[-1].write_bytes(shards[-1].read_bytes()[:-100])
    rc, err = run_capture(d, base, tmp_path, capsys)
    assert_one_line(rc, err, shards[-1], "truncated")
    index = d / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"][next(iter(doc["weight_map"]))] = "model-gone.safetensors"
    index.write_text(json.dumps(doc))
    rc, err = run_capture(d, base, tmp_path, capsys)
    assert_one_line(rc, err, index, "names shard 'model-gone.safetensors', which is not in")


# ---------------------------------------------------------------- pickles
def _bin_dir(base: Path, tmp_path: Path) -> Path:
    d = hf_copy(base, tmp_path)
    (d / "model.safetensors").unlink()
    return d


def test_a_sound_pytorch_model_bin_still_loads(tmp_path, base):
    d = _bin_dir(base, tmp_path)
    torch.save(_state_dict(base), d / "pytorch_model.bin")
    ckpt = load_checkpoint(d)
    ref = _state_dict(base)
    assert all(torch.equal(v, ref[k]) for k, v in ckpt.model.state_dict().items())


@pytest.mark.parametrize("case", sorted(PICKLES))
def test_hostile_pytorch_model_bin_is_refused_and_nothing_runs(tmp_path, base, capsys, case):
    d = _bin_dir(base, tmp_path)
    file, marker = d / "pytorch_model.bin", tmp_path / "PWNED"
    write, want = PICKLES[case]
    write(file, base, marker)
    rc, err = run_capture(d, base, tmp_path, capsys)
    assert_one_line(rc, err, file, want)
    if "global" in case:
        assert "nothing in the file was executed" in err and "refused to unpickle" in err
    assert not marker.exists()
    with pytest.raises(CheckpointError, match="^" + re.escape(str(file))):
        load_checkpoint(d)
    assert not marker.exists()


# ---------------------------------------------------------------- JSON
@pytest.mark.parametrize("case", sorted(JSONS))
def test_bad_json_in_the_directory_is_one_line(tmp_path, base, capsys, case):
    d = hf_copy(base, tmp_path)
    name, content, want = JSONS[case]
    file = d / name
    if content is None:
        file.write_bytes('{"model_type": "llama", "name": "caf\xe9"}'.encode("latin-1"))
    else:
        file.write_text(content, encoding="utf-8")
    rc, err = run_capture(d, base, tmp_path, capsys)
    assert_one_line(rc, err, file, want)
    with pytest.raises(CheckpointError, match="^" + re.escape(str(file))):
        load_checkpoint(d)


def test_json_reader_caps_the_size_and_names_the_file(tmp_path, monkeypatch):
    from gradforensics.replay import untrusted

    file = tmp_path / "config.json"
    file.write_text('{"a": "' + "x" * 200 + '"}')
    monkeypatch.setattr(untrusted, "MAX_JSON_BYTES", 100)
    with pytest.raises(CheckpointError, match=r"config\.json: 209 B, too large for a JSON file \(at most 100 B"):
        read_json_object(file)


def test_a_hostile_trainer_state_does_not_stop_the_load(tmp_path, base):
    """trainer_state.json only gives the step: a broken one leaves it to --step (0)."""
    d = hf_copy(base, tmp_path)
    for content in (DEEP, '{"global_step": Infinity}', "[]"):
        (d / "trainer_state.json").write_text(content)
        assert load_checkpoint(d).step == 0
    (d / "trainer_state.json").write_text('{"global_step": 12}')
    assert load_checkpoint(d).step == 12


# ---------------------------------------------------------------- --model-factory state-dict files
def _raw_cases() -> list[tuple[str, str]]:
    return ([("st", c) for c in sorted(SAFETENSORS)] + [("pt", c) for c in sorted(PICKLES)]
            + [("bin", c) for c in ("global_protocol_2", "garbage")])


@pytest.mark.parametrize(("suffix", "case"), _raw_cases())
def test_hostile_state_dict_file_with_model_factory(tmp_path, base, capsys, suffix, case):
    marker = tmp_path / "PWNED"
    if suffix == "st":
        file = tmp_path / "ckpt.safetensors"
        raw = (base / "model.safetensors").read_bytes()
        header, data = safetensors_parts(base / "model.safetensors")
        damage, want = SAFETENSORS[case]
        file.write_bytes(damage(raw, header, data))
        size = file.stat().st_size
        want = want.format(size=size, n=len(raw) - len(data) - 8, data=size - (len(raw) - len(data)))
    else:
        file = tmp_path / f"ckpt.{suffix}"
        write, want = PICKLES[case]
        write(file, base, marker)
    rc, err = run_capture(file, base, tmp_path, capsys, "--model-factory", FACTORY, "--tokenizer", base)
    assert_one_line(rc, err, file, want)
    assert not marker.exists()
    with pytest.raises(CheckpointError, match="^" + re.escape(str(file))):
        read_state_dict(file)
    assert not marker.exists()


def test_sound_state_dict_files_still_load(tmp_path, base):
    ref = _state_dict(base)
    torch.save({"model": ref}, tmp_path / "ok.pt")
    assert read_state_dict(tmp_path / "ok.pt").keys() == ref.keys()
    st = read_state_dict(base / "model.safetensors")
    assert st.keys() == ref.keys() and all(torch.equal(st[k], ref[k]) for k in ref)


def test_gf_capture_raises_the_same_line(tmp_path, base):
    file = tmp_path / "evil.pt"
    marker = tmp_path / "PWNED"
    torch.save({"x": Payload(marker)}, file)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointError, match=r"evil\.pt: refused to unpickle .*nothing in the file was executed"):
            gf.capture(file, {"en": base / "en.txt"}, tmp_path / "o.zarr",
                       batches={"batches_per_source": 1, "batch_size": 2, "seq_len": 16},
                       model={"model_factory": FACTORY, "tokenizer": base, "loss": "causal-lm"})
    assert not marker.exists() and not (tmp_path / "o.zarr").exists()
