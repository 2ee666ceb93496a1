"""`tinylm explain tokens`: the pieces of a text for every tokenizer kind, BPE merge order, the picture, bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from matplotlib.image import imread

from tinylm.errors import TinyLMError
from tinylm.explain.tokens import format_pieces, merge_ranks, plot_pieces, token_pieces
from tinylm.tokenizers import train_tokenizer

TEXT = "To be, or not to be: that is the question. Éte\u0301 \U0001F600"
CORPUS = ["To be, or not to be: that is the question.", "the theme of the thesis", "Éte\u0301 \U0001F600"] * 20


@pytest.fixture(scope="module")
def tokenizers():
    return {kind: train_tokenizer(kind, CORPUS, vocab_size=290, unknown="bytes", workers=1)
            for kind in ("char", "word", "bpe")}


def explain(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tinylm", "explain", *args], capture_output=True, text=True)


@pytest.mark.parametrize("kind", ["char", "word", "bpe"])
def test_the_pieces_spell_the_text_with_the_encoder_s_ids(tokenizers, kind):
    tok = tokenizers[kind]
    pieces = token_pieces(tok, TEXT)
    assert [p.token_id for p in pieces] == tok.encode(TEXT)
    assert b"".join(p.token_bytes for p in pieces) == TEXT.encode("utf-8")
    assert sum(p.n_bytes for p in pieces) == len(TEXT.encode("utf-8"))
    table = format_pieces(pieces)
    assert f"{len(pieces)} tokens for {len(TEXT.encode())} bytes" in table


def test_bpe_merges_rebuild_each_piece_in_rank_order(tokenizers):
    tok = tokenizers["bpe"]
    pieces = token_pieces(tok, "the theme", merges=True)
    assert any(len(p.merges) >= 2 for p in pieces)  # "the" took more than one merge
    for p in pieces:
        assert p.merges == sorted(p.merges)
        # replaying the merges in that order from the bytes builds exactly this token
        made = {i: bytes([i]) for i in range(256)}
        for rank in p.merges:
            a, b = tok.merges[rank]
            assert a in made and b in made, "a merge used a token not built yet"
            made[256 + rank] = made[a] + made[b]
        assert made[p.token_id] == p.token_bytes
    assert merge_ranks(tok, ord("a")) == []  # a single byte needs no merge
    with pytest.raises(TinyLMError, match="this char tokenizer has none"):
        token_pieces(tokenizers["char"], "x", merges=True)


def test_an_imported_byte_level_tokenizer_and_its_merges(tmp_path):
    # a GPT-2-style tokenizer.json from Hugging Face `tokenizers`, whose ids are not tinylm's 256 + rank
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from tinylm.tokenizers.hf_files import read_hf_tokenizer

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = read_hf_tokenizer(tmp_path)
    assert tok.kind == "bytelevel"
    pieces = token_pieces(tok, "the theme", merges=True)
    assert [p.token_id for p in pieces] == hf.encode("the theme").ids
    for p in pieces:  # the merges, replayed in rank order, spell the piece
        made = {}
        for rank in p.merges:
            a, b = tok.merges[rank]
            made[rank] = tok.token_bytes(a) + tok.token_bytes(b)
        assert made[p.merges[-1]] == p.token_bytes and len(p.merges) == p.n_bytes - 1


def test_the_picture_has_a_box_per_piece(tokenizers, tmp_path):
    for text, n_columns in (("to be", None), (TEXT.replace("\U0001F600", "!"), 12)):  # glyphs the font has
        pieces = token_pieces(tokenizers["char"], text)
        image = imread(plot_pieces(pieces, tmp_path / "t.png"))
        columns = n_columns or len(pieces)
        assert image.shape[1] == round((columns * 0.95 + 0.4) * 110)  # as wide as a row of boxes
        rows = (len(pieces) + 11) // 12
        assert image.shape[0] == round((0.9 * rows + 0.5) * 110)
        assert image[..., :3].std() > 0.05


def test_the_command(tokenizers, tmp_path):
    path = tokenizers["bpe"].save(tmp_path / "tok.json")
    out = explain("tokens", "--tokenizer", str(path), "--text", "the theme", "--merges", "--json",
                  "--out", str(tmp_path / "t.png"))
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert "".join(p["text"] for p in report["pieces"]) == "the theme"
    assert all("merges" in p for p in report["pieces"]) and (tmp_path / "t.png").stat().st_size > 1000
    table = explain("tokens", "--tokenizer", str(path), "--text", "the theme", "--merges")
    assert "merges (rank order)" in table.stdout


def test_a_run_s_tokenizer(small_run_dir):
    out = explain("tokens", "--run", str(small_run_dir), "--text", "héllo")
    assert out.returncode == 0, out.stderr
    assert "6 tokens for 6 bytes" in out.stdout  # the byte-level tokenizer: é is two tokens of one byte each


@pytest.mark.parametrize("args, message", [
    (["--run", "no/such/run", "--text", "hi"], "run folder no/such/run does not exist"),
    (["--text", "hi"], "give the tokenizer with --tokenizer FILE or a run's with --run DIR"),
])
def test_bad_input_is_one_line(args, message):
    out = explain("tokens", *args)
    assert out.returncode != 0 and message in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_the_picture_gives_an_id_one_colour_and_shows_the_merges(tokenizers):
    from tinylm.explain.tokens import pieces_figure

    pieces = token_pieces(tokenizers["bpe"], "to be, or not to be, to be", merges=True)
    ids = [p.token_id for p in pieces]
    assert len(set(ids)) < len(ids) <= 10 + len(ids) - len(set(ids))  # some token comes back; ids fit the palette
    fig, ax = pieces_figure(pieces)
    colours = [tuple(patch.get_facecolor()) for patch in ax.patches]
    for a in range(len(ids)):
        for b in range(len(ids)):
            assert (colours[a] == colours[b]) == (ids[a] == ids[b]), (a, b)
    texts = [t.get_text() for t in ax.texts]
    for p in pieces:  # the ranks the table lists for a piece are in the picture too
        assert len(p.merges) <= 4 and (f"m {' '.join(map(str, p.merges))}" if p.merges else "m -") in texts, p
    _, plain = pieces_figure(token_pieces(tokenizers["bpe"], "to be"))
    assert not any(t.get_text().startswith("m ") for t in plain.texts)  # no --merges: no ranks drawn
