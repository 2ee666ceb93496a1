"""The first sample reads like the text: the closing sample of a run and an unprompted `tinylm sample` start
from a line drawn from the validation split (a speaker's line in a play, a paragraph's first line past the
front matter elsewhere), and say so, instead of starting a new document at its title page and cast list."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from trainkit import tiny_config

from tinylm.cli import main
from tinylm.generate.opening import NEW_DOCUMENT, opening_of_text, speaker_lines
from tinylm.train import train

SPEAKERS = ("KING", "QUEEN", "FOOL", "LADY PERCY", "HOTSPUR")


def play(seed: int) -> str:
    """A play as Project Gutenberg writes one: a title page, the cast, then scenes of speeches."""
    lines = [f"THE TRAGEDY OF KING {seed}", "", "by William Shakespeare", "", "DRAMATIS PERSONAE", "",
             "KING, a king.", "QUEEN, his wife.", "", "ACT I.", "", "SCENE I. A room.", ""]
    for i in range(30):
        lines += [f"{SPEAKERS[(i * 3 + seed) % len(SPEAKERS)]}.", "the night is long and the bells ring out", ""]
    return "\n".join(lines)


@pytest.fixture(scope="module")
def plays(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("plays") / "plays"
    folder.mkdir()
    for i in range(8):
        (folder / f"play{i}.txt").write_text(play(i), encoding="utf-8")
    return folder


def test_a_play_opens_at_a_speaker_s_line_drawn_by_the_seed():
    documents = [play(0), play(1)]
    lines = set(speaker_lines(documents[0]))
    assert lines == {f"{name}.\n" for name in SPEAKERS}  # not "ACT I.", "SCENE I.", the cast or the title
    drawn = {opening_of_text(documents, seed).text for seed in range(40)}
    assert drawn == lines  # every speaker can open, by the seed
    assert opening_of_text(documents, 7) == opening_of_text(documents, 7)
    assert "speaker's line" in opening_of_text(documents, 7).source
    # a speech on the speaker's own line: the name alone opens it
    assert speaker_lines("ROMEO: But soft\nJULIET: Ay me\n") == ["ROMEO:", "JULIET:"]


def test_prose_opens_at_a_paragraph_past_the_front_matter_and_nothing_fits_a_new_document():
    doc = "Title\n\nby Someone\n\nIt was a dark night.\nThe rain fell.\n\nMorning came late."
    assert {opening_of_text([doc], seed).text for seed in range(20)} == {"It was a dark night.\n",
                                                                         "Morning came late.\n"}
    assert opening_of_text(["one paragraph only"], 0).text == ""
    assert opening_of_text(["one paragraph only"], 0).source == NEW_DOCUMENT


class _Terminal(io.StringIO):
    def isatty(self) -> bool:  # nothing piped in: `tinylm sample` has no prompt at all
        return True


def test_the_closing_sample_and_an_unprompted_sample_start_at_a_speech(tmp_path, plays, capsys, monkeypatch):
    logged: list[str] = []
    config = tiny_config(plays, tmp_path / "data", max_steps=2, sample_tokens=6, sample_temperature=0.0)
    result = train(config, tmp_path / "run", progress=False, log=logged.append)
    heading = next(line for line in logged if line.startswith("sample ("))
    assert "starting from a speaker's line drawn from the validation split" in heading
    assert any(result.sample.startswith(f"{name}.\n") for name in SPEAKERS), result.sample
    assert f"{result.sample.split(chr(10))[0]!r}" in heading  # the line it started from, named
    monkeypatch.setattr("sys.stdin", _Terminal())
    assert main(["sample", "--run", str(tmp_path / "run"), "--max-new-tokens", "4", "--seed", "3"]) == 0
    out, err = capsys.readouterr()
    assert "sample: starting from a speaker's line drawn from the validation split" in err
    assert any(out.startswith(f"{name}.\n") for name in SPEAKERS), out
