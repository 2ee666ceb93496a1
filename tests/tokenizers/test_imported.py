"""Tokenizers trained by Hugging Face `tokenizers` and saved by `transformers`, read by tinylm with every id kept.

The oracle is `transformers.AutoTokenizer` on the same folder (and `tiktoken` for a .tiktoken file). The
tokenizers are built in `hfkit`: GPT-2-style (with and without add_prefix_space), Llama-3-style,
Qwen2-style and SentencePiece-style with byte fallback (two spellings of the same pipeline).
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys

import pytest
from hfkit import PROBE_TEXT, STYLES, build

from tinylm.errors import TinyLMError
from tinylm.tokenizers import load_tokenizer
from tinylm.tokenizers.base import default_stop_ids, generation_excluded
from tinylm.tokenizers.files import export_tokenizer, import_tokenizer

import transformers  # noqa: F401  (in the test extra: absent, this fails rather than skips)
from transformers import AutoTokenizer  # noqa: E402

KINDS = {"gpt2": "bytelevel", "gpt2-prefix": "bytelevel", "smollm": "bytelevel", "llama3": "bytelevel", "qwen2": "bytelevel",
         "sentencepiece": "sentencepiece", "sentencepiece-metaspace": "sentencepiece", "gemma": "sentencepiece"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-tokenizers")
    return {style: build(style, root / style) for style in STYLES}


@pytest.fixture(scope="module")
def corpus(shakespeare_text) -> str:
    # a long stretch of real text (the SentencePiece encoder is pure Python), and the probe of odd characters
    return shakespeare_text[:400_000] + PROBE_TEXT * 3


@pytest.mark.parametrize("style", STYLES)
def test_same_ids_and_text_as_transformers_on_a_whole_corpus(folders, corpus, style):
    hf = AutoTokenizer.from_pretrained(str(folders[style]))
    tok = import_tokenizer(folders[style])
    assert tok.kind == KINDS[style]
    for text in (corpus, PROBE_TEXT, " starts with a space", "   ", "x", "\n\n\n", "e\u0301" * 50):
        ids = tok.encode(text)
        assert ids == hf(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == hf.decode(ids)
    # with the pipeline's own special tokens: what transformers' tokenizer(text) gives
    first = [tok.bos_id] if tok.add_bos else []
    assert first + tok.encode(PROBE_TEXT) == hf(PROBE_TEXT)["input_ids"]
    # special-token text is text unless allowed; allowed, it is the token, as transformers always reads it
    marked = f"one{hf.eos_token}two {hf.eos_token}"
    assert tok.encode(marked, allowed_special="all") == hf(marked, add_special_tokens=False)["input_ids"]
    assert tok.eos_id not in tok.encode(marked)
    assert tok.eos_id == hf.eos_token_id and (hf.bos_token is None or tok.bos_id == hf.bos_token_id)


@pytest.mark.parametrize("style", STYLES)
def test_the_tinylm_file_keeps_every_id_and_exports_back_to_the_same_ids(folders, corpus, style, tmp_path):
    from tokenizers import Tokenizer as HFTokenizer

    tok = import_tokenizer(folders[style])
    tok.save(tmp_path / "tok.json")
    again = load_tokenizer(tmp_path / "tok.json")
    text = corpus[:50_000] + PROBE_TEXT
    assert again.encode(text) == tok.encode(text) and again.fingerprint() == tok.fingerprint()
    assert again.roles == tok.roles and again.add_bos == tok.add_bos and again.chat_template == tok.chat_template
    assert again.stop_ids == tok.stop_ids
    # written back as tokenizer.json, the `tokenizers` library reads it to the same ids
    path = export_tokenizer(again, tmp_path / "out", "hf")
    oracle = HFTokenizer.from_file(str(path))
    assert oracle.encode(text, add_special_tokens=False).ids == tok.encode(text)
    assert oracle.decode(tok.encode(PROBE_TEXT), skip_special_tokens=False) == tok.decode(tok.encode(PROBE_TEXT))


def test_roles_come_from_the_side_files_and_generation_leaves_out_the_other_specials(folders):
    llama3 = import_tokenizer(folders["llama3"])
    assert llama3.roles == {"bos": "<|begin_of_text|>", "eos": "<|end_of_text|>", "pad": "<|end_of_text|>"}
    assert llama3.add_bos and llama3.chat_template and "<|start_header_id|>" in llama3.chat_template
    excluded = set(generation_excluded(llama3))
    assert llama3.eos_id not in excluded and llama3.special_tokens["<|begin_of_text|>"] in excluded
    assert llama3.special_tokens["<|eot_id|>"] not in excluded  # it ends a turn (a stop id): a model may write it
    assert {llama3.special_tokens[n] for n in ("<|start_header_id|>", "<|end_header_id|>")} <= excluded
    qwen2 = import_tokenizer(folders["qwen2"])  # no bos: it falls back to eos
    assert qwen2.roles == {"bos": "<|im_end|>", "eos": "<|im_end|>", "pad": "<|endoftext|>"} and not qwen2.add_bos
    sp = import_tokenizer(folders["sentencepiece"])
    assert sp.special_tokens == {"<unk>": 0, "<s>": 1, "</s>": 2} and sp.unk_id == 0 and sp.add_bos
    assert sp.token_bytes(3 + 0x41) == b"A" and sp.is_special(0) and 0 in generation_excluded(sp)
    # --eos and friends name a token the files do not, and must name a real one
    gpt2 = import_tokenizer(folders["gpt2"], roles={"pad": "<|endoftext|>"})
    assert gpt2.pad_id == gpt2.eos_id == 0
    with pytest.raises(TinyLMError, match="--eos '<nope>' is not a token of this tokenizer"):
        import_tokenizer(folders["gpt2"], roles={"eos": "<nope>"})


def test_stop_ids_come_from_generation_config_and_the_chat_templates_end_of_turn(folders, tmp_path):
    import shutil

    # no generation_config.json: the token Llama 3's template writes after an assistant's message
    llama3 = import_tokenizer(folders["llama3"])
    eot, end = llama3.special_tokens["<|eot_id|>"], llama3.eos_id
    assert llama3.stop_ids == [eot] and default_stop_ids(llama3) == {end, eot}
    # ChatML ends a turn with <|im_end|>, eos already; Llama 2's writes eos after the reply; GPT-2 has no template
    for style in ("qwen2", "sentencepiece", "gpt2"):
        assert import_tokenizer(folders[style]).stop_ids == []
    # generation_config.json's eos_token_id, an id or a list; eos itself and ids past the vocabulary are left out
    folder = shutil.copytree(folders["gpt2"], tmp_path / "gpt2")
    for given, expected in ((5, [5]), ([0, 7, 5, 10**6], [5, 7]), (None, []), ("x", [])):
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": given}))
        tok = import_tokenizer(folder)
        assert tok.stop_ids == expected and default_stop_ids(tok) == {0, *expected}
        assert not set(expected) & set(generation_excluded(tok))
    tok.save(tmp_path / "tok.json")
    saved = json.loads((tmp_path / "tok.json").read_text())
    del saved["stop_ids"]  # a file written before stop ids were kept
    (tmp_path / "old.json").write_text(json.dumps(saved))
    assert load_tokenizer(tmp_path / "old.json").stop_ids == []


def test_gpt2s_own_vocab_json_and_merges_txt(folders, corpus, tmp_path):
    """GPT-2's original files (no tokenizer.json): read with the same ids as transformers' GPT2Tokenizer."""
    from transformers import GPT2Tokenizer

    data = json.loads((folders["gpt2"] / "tokenizer.json").read_text())
    (tmp_path / "vocab.json").write_text(json.dumps(data["model"]["vocab"]))
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>",
                                                                "bos_token": "<|endoftext|>"}))
    tok = import_tokenizer(tmp_path)
    oracle = GPT2Tokenizer.from_pretrained(str(tmp_path))  # reads vocab.json and merges.txt
    text = corpus[:100_000] + PROBE_TEXT
    assert tok.encode(text) == oracle(text, add_special_tokens=False)["input_ids"]
    assert tok.eos_id == 0 and tok.is_special(0)


def test_a_tiktoken_file_in_any_byte_order_encodes_as_tiktoken_does(folders, corpus, tmp_path):
    import tiktoken

    from tinylm.tokenizers.bpe import PATTERNS

    gpt2 = import_tokenizer(folders["gpt2"])
    ranks = {b: i for i, b in enumerate(gpt2.tokens) if b is not None}  # byte tokens in the trainer's order
    assert ranks[b"\x00"] != 0
    path = tmp_path / "mine.tiktoken"
    path.write_text("".join(f"{base64.b64encode(b).decode()} {i}\n" for b, i in ranks.items()))
    tok = import_tokenizer(path, pattern="gpt2", n_reserved=2)
    oracle = tiktoken.Encoding("oracle", pat_str=PATTERNS["gpt2"], mergeable_ranks=ranks, special_tokens={})
    text = corpus[:200_000] + PROBE_TEXT
    assert tok.encode(text) == oracle.encode_ordinary(text)
    top = max(ranks.values()) + 1  # the specials follow the highest rank (id 0, the trainer's special, is a gap)
    assert 0 not in ranks.values() and tok.is_special(0) and tok.token_bytes(0) == b""
    assert tok.special_tokens == {"<|bos|>": top, "<|eos|>": top + 1, "<|pad|>": top + 2,
                                  "<|reserved_0|>": top + 3, "<|reserved_1|>": top + 4}
    # and back out as a .tiktoken file with the same lines
    out = export_tokenizer(tok, tmp_path / "again.tiktoken", "tiktoken")
    assert sorted(out.read_text().splitlines()) == sorted(path.read_text().splitlines())


def test_the_cli_imports_a_folder_and_encodes_with_it(folders, tmp_path):
    out = tmp_path / "tok.json"
    done = subprocess.run([sys.executable, "-m", "tinylm", "tokenizer", "import", str(folders["sentencepiece"]),
                           "--out", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "sentencepiece tokenizer" in done.stdout
    shown = subprocess.run([sys.executable, "-m", "tinylm", "tokenizer", "encode", "--tokenizer", str(out),
                            "--text", "Grüße 😀"], capture_output=True, text=True)
    hf = AutoTokenizer.from_pretrained(str(folders["sentencepiece"]))
    assert shown.returncode == 0, shown.stderr
    assert [int(w) for w in shown.stdout.split()] == hf("Grüße 😀", add_special_tokens=False)["input_ids"]
    info = subprocess.run([sys.executable, "-m", "tinylm", "tokenizer", "info", "--tokenizer", str(out), "--json"],
                          capture_output=True, text=True)
    assert json.loads(info.stdout)["roles"] == {"bos": "<s>", "eos": "</s>", "pad": "</s>"}


def test_what_does_not_map_is_one_clear_line(folders, tmp_path):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    wordpiece = HFTokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.Whitespace()
    wordpiece.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(TinyLMError, match="the model is WordPiece, not BPE"):
        import_tokenizer(tmp_path / "tokenizer.json")
    # a byte-level vocabulary without every byte cannot spell all text
    data = json.loads((folders["gpt2"] / "tokenizer.json").read_text())
    data["model"]["vocab"].pop("Ā")  # byte 0
    data["model"]["merges"] = [m for m in data["model"]["merges"] if "Ā" not in (m if isinstance(m, str) else "".join(m))]
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(TinyLMError, match="lacks 1 of the 256 single bytes"):
        import_tokenizer(tmp_path / "tokenizer.json")
    # a vocab entry outside GPT-2's byte-level characters is not byte-level BPE
    data = json.loads((folders["gpt2"] / "tokenizer.json").read_text())
    data["model"]["vocab"]["中"] = len(data["model"]["vocab"]) + 10
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(TinyLMError, match="vocab entry '中' .* not GPT-2 byte-level characters.*\\(id \\d+\\)"):
        import_tokenizer(tmp_path / "tokenizer.json")
    # no eos named and none of the usual names: say how to name it
    data = json.loads((folders["llama3"] / "tokenizer.json").read_text())
    for t in data["added_tokens"]:
        t["content"] = t["content"].replace("text", "TEXT")
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(TinyLMError, match="no token is named as eos.*--eos TOKEN"):
        import_tokenizer(tmp_path / "tokenizer.json")
    assert import_tokenizer(tmp_path / "tokenizer.json", roles={"eos": "<|end_of_TEXT|>"}).eos_id > 0
