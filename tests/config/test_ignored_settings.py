"""Settings a model family has no use for: `resolve_config` warns of them, so Python hears what `tinylm train`
says; the command shows the warning with the run's first line (a run refused before it starts shows its error
alone)."""

from __future__ import annotations

import warnings

import pytest

from tinylm.cli import main
from tinylm.config import resolve_config
from tinylm.config.resolve import warn_ignored

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n" * 30


def test_attention_settings_given_to_an_lstm_are_warned_of_where_resolve_config_is_called():
    with pytest.warns(UserWarning) as said:
        config = resolve_config(overrides={"family": "lstm", "n_head": 4, "lr": 1e-3})
    assert config.model.family == "lstm"
    assert [str(w.message) for w in said] == ["--n-head does not apply to an LSTM model and is ignored"]
    assert said[0].filename == __file__  # the caller's line, not resolve_config's


def test_an_n_gram_model_names_every_network_setting_in_one_line():
    with pytest.warns(UserWarning) as said:
        resolve_config(overrides=["--family", "ngram", "--order", "2", "--n-layer", "2", "--lr", "1e-3",
                                  "--corpus", "shakespeare", "--tokenizer-kind", "char"])
    assert [str(w.message) for w in said] == ["--lr, --n-layer do not apply to an n-gram model and are ignored"]


@pytest.mark.parametrize("overrides", [
    {"n_head": 4, "max_steps": 10},                              # a Transformer reads both
    {"family": "rnn", "n_layer": 2, "max_steps": 10},           # a recurrent network's own
    {"family": "ngram", "order": 3, "corpus": "shakespeare"},   # what counting reads
    {},
])
def test_settings_the_family_reads_are_not_warned_of(overrides):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolve_config(overrides=overrides)


def test_warn_ignored_says_one_flag_in_the_singular_and_nothing_for_none():
    with pytest.warns(UserWarning, match=r"^--stop-after does not apply to an n-gram model and is ignored$"):
        warn_ignored("ngram", ["--stop-after"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_ignored("gpt", [])


def test_the_command_says_it_with_the_run_s_first_line_and_not_before_an_error(tmp_path, capsys):
    corpus = tmp_path / "play.txt"
    corpus.write_text(TEXT)
    flags = ["train", "--model", "ngram", "--order", "2", "--n-layer", "2", "--tokenizer-kind", "char",
             "--data-dir", str(tmp_path / "data")]
    assert main([*flags, "--corpus", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "refused")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tinylm: error:") and "missing.txt" in err[0], err

    assert main([*flags, "--corpus", str(corpus), "--out", str(tmp_path / "counted")]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == "tinylm: warning: --n-layer does not apply to an n-gram model and is ignored", err

    assert main([*flags, "--corpus", str(corpus), "--out", str(tmp_path / "shown"), "--print-config"]) == 0
    assert capsys.readouterr().err == ""  # nothing is trained, so nothing is ignored
