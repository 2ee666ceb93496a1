"""Imported tokenizers give `tokenizers`' ids and text on any text, not only on the texts they were built with.

The oracle is the `tokenizers` library itself, loading the very tokenizer.json `hfkit` saved with
`transformers` for each family's layout (GPT-2, GPT-2 with a prefix space, SmolLM, Llama 3, Qwen2,
Llama 2 / Mistral with Prepend + Replace, TinyLlama with Metaspace, and whatever `hfkit.STYLES` adds),
and a few variants people's files have:

- ``sentencepiece-trainer-bytes``: the "<0xNN>" byte tokens given to the `tokenizers` trainer as special
  tokens, so the file lists them as special added tokens too (byte fallback must still use them);
- ``llama3-nobos`` and ``sentencepiece-nobos``: the same files without a post-processor (BOS added by
  nothing), as many Llama-3-style and Mistral-style files are.

Hypothesis draws texts from what breaks tokenizers (code with indentation and blank lines, every kind of
whitespace, CRLF, accented and CJK letters, emoji with joiners and modifiers, control characters, digits,
contractions, special-token names and look-alikes) and any characters at all; every text must give the
same ids with and without the post-processor's tokens, and the same decoded text. Then whole texts the
tests did not write: Shakespeare and the standard library's own documentation.
"""

from __future__ import annotations

import json
import pydoc
import unicodedata
from pathlib import Path

import pytest
from hfkit import STYLES, TRAINING_TEXT, build
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tinylm.run import text_start_ids
from tinylm.tokenizers.hf_files import read_hf_tokenizer

import tokenizers
import transformers  # noqa: F401  (in the test extra: absent, this fails rather than skips)

VARIANTS = ("sentencepiece-trainer-bytes", "llama3-nobos", "sentencepiece-nobos")

WHITESPACE = [" ", "  ", "\t", "\n", "\n\n", "\r\n", "\r", "\x0b", "\x0c", "\u00a0", "\u2003", "\u3000", "\u200b",
              "\u2028", "\u0085", " \n ", "\t\t\n", "    ", " " * 17]
WORDS = ["def", "return", "self", "x_1", "print", "the", "Hello", "WORLD", "naïve", "café", "Grüße", "Köln",
         "e\u0301", "Å", "ﬁ", "ｆｕｌｌ", "東京", "中文文本", "한국어", "привет", "ελληνικά", "עברית", "العربية", "हिन्दी",
         "ไทย", "😀", "🙂", "👨‍👩‍👧", "👍🏽", "🏳️‍🌈", "🤖🤖", "\x00", "\x01", "\x07", "\x1b[0m", "\x7f", "\u0085",
         "0", "7", "42", "1234567", "3.14159", "1,000,000", "½", "²", "٣", "'s", "'t", "'re", "'ve", "'m",
         "'ll", "'d", "'S", "'LL", "don't", "I'M", "they're", "'quoted'", '"double"', "--", "...", "()", "{}",
         "[]", ":", ";", "=", "==", "+=", "->", "#", "@", "$", "%", "\\", "/", "|", "~", "`"]
CODE = ["def f(x):\n    return x\n", "class A:\n\n    def g(self):\n        pass\n", "\tif x:\r\n\t\ty = 1\r\n",
        "    # comment\n\n\n", "for i in range(10):\n    print(i)\n", "x = {'a': [1, 2, 3]}\n", "\n    \n\t\n"]


def look_alikes(names: list[str]) -> list[str]:
    """Each special token's name, and strings that are almost one (cut short, spaced, another case)."""
    out = ["<0x41>", "<0xC3>", "<0x0A>", "<0xzz>", "<|", "|>", "<|endoftext", "endoftext|>", "</s", "<s", "< s>",
           "<unk", "▁", "▁▁", "Ġ", "Ċ"]
    for name in names:
        out += [name, name[:-1], name[1:], name.upper(), name.replace("|", " |"), " " + name + " ", name + name]
    return out


def texts(names: list[str]):
    atoms = st.sampled_from(WHITESPACE + WORDS + CODE + look_alikes(names))
    anything = st.text(min_size=1, max_size=6)  # any code points but surrogates, which no file can hold
    return st.lists(st.one_of(atoms, atoms, atoms, anything), min_size=0, max_size=24).map("".join)


def _variant(name: str, folder: Path) -> Path:
    """A file as `hfkit.build` writes it, changed the way some families' files are."""
    if name == "sentencepiece-trainer-bytes":
        from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers
        from transformers import PreTrainedTokenizerFast

        tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
        specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
        trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials, show_progress=False, limit_alphabet=60)
        tok.train_from_iterator(TRAINING_TEXT, trainer)
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", 1)])
        PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                clean_up_tokenization_spaces=False).save_pretrained(str(folder))
        return folder
    base = name.removesuffix("-nobos")
    build(base, folder)
    data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    data["post_processor"] = None
    (folder / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("parity")
    made = {style: build(style, root / style) for style in STYLES}
    made.update({name: _variant(name, root / name) for name in VARIANTS})
    return made


@pytest.fixture(scope="module", params=list(STYLES) + list(VARIANTS))
def pair(request, folders):
    """(ours, theirs): the tokenizer tinylm reads from the folder, and `tokenizers`' own from its tokenizer.json."""
    folder = folders[request.param]
    return read_hf_tokenizer(folder), tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))


def check_same(ours, theirs, text: str) -> None:
    plain = theirs.encode(text, add_special_tokens=False).ids
    # tokenizers always reads special-token names as the specials: tinylm does when they are allowed
    assert ours.encode(text, allowed_special="all") == plain, text
    # what the post-processor puts first (BOS, or nothing) is what a tinylm prompt starts with
    assert text_start_ids(ours) + plain == theirs.encode(text).ids, text
    assert ours.decode(plain) == theirs.decode(plain, skip_special_tokens=False), text


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_ids_start_and_decoding_equal_tokenizers_on_drawn_text(pair, data):
    ours, theirs = pair
    text = data.draw(texts(sorted(ours.special_tokens)))
    check_same(ours, theirs, text)


def test_byte_fallback_spells_what_the_vocabulary_lacks_in_bytes(folders):
    """The case people met: a tokenizers-trained SentencePiece BPE whose byte tokens are special added tokens."""
    folder = folders["sentencepiece-trainer-bytes"]
    ours, theirs = read_hf_tokenizer(folder), tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    text = "return ü 🙂 x"
    ids = ours.encode(text)
    assert ids == theirs.encode(text, add_special_tokens=False).ids
    assert ours.unk_id not in ids and ours.decode(ids) == text
    assert ours.pipeline_start_ids() + ids == theirs.encode(text).ids


def _stdlib_docs() -> str:
    """The standard library's own documentation, as `pydoc` renders it: prose, signatures and examples."""
    return "\n\n".join(pydoc.render_doc(m, renderer=pydoc.plaintext) for m in (json, unicodedata))


@pytest.mark.slow
@pytest.mark.parametrize("which", ["shakespeare", "stdlib"])
def test_whole_texts_the_tests_did_not_write(pair, which, request):
    ours, theirs = pair
    # its first 50,000 characters: verse, prose, stage directions and speakers
    text = request.getfixturevalue("shakespeare_text")[:50_000] if which == "shakespeare" else _stdlib_docs()
    check_same(ours, theirs, text)
