"""Intra-op thread counts for the model at hand (issue 20): one thread for a small model unless the user chose."""

from __future__ import annotations

import pytest

from gradforensics import cli
from gradforensics.errors import SpecError
from gradforensics.replay import threads
from gradforensics.replay.threads import SMALL_MODEL_PARAMS, choose_threads, parse_threads, torch_threads


def test_small_model_gets_one_thread_large_keeps_torch_default(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert choose_threads(0) == 1
    assert choose_threads(SMALL_MODEL_PARAMS - 1) == 1
    assert choose_threads(SMALL_MODEL_PARAMS) is None


def test_the_users_choice_wins(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert choose_threads(10) is None              # torch read OMP_NUM_THREADS itself: leave it
    assert choose_threads(10, requested=3) == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert choose_threads(10 * SMALL_MODEL_PARAMS, requested=2) == 2


@pytest.mark.parametrize("text, expected", [("auto", None), (None, None), ("1", 1), ("8", 8), (4, 4)])
def test_parse_threads(text, expected):
    assert parse_threads(text) == expected


@pytest.mark.parametrize("text", ["0", "-1", "two", "1.5", ""])
def test_parse_threads_refuses_in_one_line(text):
    with pytest.raises(SpecError, match="expected auto or a positive integer"):
        parse_threads(text)


@pytest.mark.parametrize("verb", ["demo", "capture", "whatif"])
def test_every_model_verb_takes_threads(verb, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main([verb, "--threads", "0"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --threads" in err and "expected auto or a positive integer" in err


def test_torch_threads_sets_and_restores():
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    other = 2 if before == 1 else 1
    with torch_threads(other):
        assert torch.get_num_threads() == other
    assert torch.get_num_threads() == before
    with torch_threads(None):
        assert torch.get_num_threads() == before


def test_for_model_counts_parameters(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    model = torch.nn.Linear(8, 4)
    assert threads.n_parameters(model) == 36
    torch.set_num_threads(2)
    try:
        with threads.for_model(model):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)
