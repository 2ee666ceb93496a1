"""Hand-edited tokenizer files: every wrong size or type is one clear line, before anything is allocated.

tinylm's own files, and the files of other tools (tokenizer.json, vocab.json + merges.txt, .tiktoken, a model's
config.json): an id far past the others, an id that is not a whole number, a merge or added token that
Hugging Face `tokenizers` would refuse, JSON nested past any real file.
"""

from __future__ import annotations

import json
import re
import resource
import subprocess
import sys

import base64
import copy
import time

import pytest

from tinylm.cli import main
from tinylm.errors import TinyLMError
from tinylm.jsonfile import MAX_DEPTH
from tinylm.tokenizers import CharTokenizer, train_bpe
from tinylm.tokenizers.files import import_tokenizer
from tinylm.tokenizers.formats import (
    bytes_to_byte_level,
    imported_to_hf_json,
    load_hf_tokenizer_json,
    save_hf_tokenizer_json,
    to_hf_tokenizer_json,
)
from tinylm.tokenizers.hf_files import read_hf_tokenizer
from tinylm.tokenizers.imported import MAX_UNUSED_IDS

TEXT = ["To be, or not to be, that is the question. " * 20]


def edited(tmp_path, tok, **changes):
    data = tok.to_dict()
    data.update(changes)
    path = tmp_path / "tok.json"
    path.write_text(json.dumps(data))
    return path


def encode_with(path) -> subprocess.CompletedProcess:
    # 2 GB of address space: a billion reserved-token names would need far more, and be killed
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    return subprocess.run([sys.executable, "-m", "tinylm", "tokenizer", "encode", "--tokenizer", str(path),
                           "--text", "to be"], capture_output=True, text=True, timeout=120, preexec_fn=limit)


@pytest.mark.parametrize("changes,needle", [
    ({"n_reserved": 1_000_000_000}, "the reserved range must be 0 to 65,536 tokens, got 1,000,000,000"),
    ({"n_reserved": -1}, "the reserved range must be 0 to 65,536 tokens"),
    ({"n_reserved": 2.5}, "n_reserved must be a whole number, got 2.5"),
    ({"merges": [[1.5, 2]]}, "merge 0's ids must be a whole number, got 1.5"),
    ({"merges": [["116", "111"]]}, "merge 0's ids must be a whole number, got '116'"),
    ({"merges": [[True, 111]]}, "merge 0's ids must be a whole number, got True"),
    ({"merges": [[116, 111, 98]]}, "merge 0 must be a pair of token ids"),
    ({"merges": [[116, 9999]]}, "refers to a token that does not exist yet"),
    ({"pattern": 7}, "the split pattern must be text"),
])
def test_a_hand_edited_bpe_file_is_one_clear_line(tmp_path, changes, needle):
    tok = train_bpe(TEXT, 270, workers=1)
    done = encode_with(edited(tmp_path, tok, **changes))
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "is corrupt" in lines[0] and needle in lines[0], lines[0]


@pytest.mark.parametrize("changes,needle", [
    ({"pieces": ["a", 7]}, "pieces must be a list of non-empty strings"),
    ({"pieces": "abc"}, "pieces must be a list of non-empty strings"),
    ({"n_reserved": 10**12}, "the reserved range must be 0 to 65,536 tokens"),
])
def test_a_hand_edited_char_file_is_one_clear_line(tmp_path, changes, needle):
    done = encode_with(edited(tmp_path, CharTokenizer.train(TEXT), **changes))
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], done.stderr


# ----- other tools' files ---------------------------------------------------------------------------------------


def hf_tokenizer() -> dict:
    """A small byte-level tokenizer.json as `tokenizers` writes one: "<|endoftext|>" at id 0, the 256 bytes
    after it (so not tinylm's own layout), two merges."""
    vocab = {"<|endoftext|>": 0, **{bytes_to_byte_level(bytes([b])): b + 1 for b in range(256)}}
    merges = [["Ġ", "t"], ["h", "e"]]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {"version": "1.0", "truncation": None, "padding": None, "normalizer": None,
            "added_tokens": [{"id": 0, "content": "<|endoftext|>", "single_word": False, "lstrip": False,
                              "rstrip": False, "normalized": False, "special": True}],
            "pre_tokenizer": byte_level, "post_processor": None, "decoder": byte_level,
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": vocab, "merges": merges}}


def written(tmp_path, data, name="tokenizer.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return path


def added(data, name, i, special=True):
    data["added_tokens"].append({**data["added_tokens"][0], "content": name, "id": i, "special": special})


def refused(path, needle, **kwargs) -> str:
    with pytest.raises(TinyLMError) as caught:
        import_tokenizer(path, **kwargs)
    message = str(caught.value)
    assert "\n" not in message and str(path) in message and needle in message, message
    return message


def test_an_id_of_a_billion_is_one_line_from_the_cli_at_once_and_in_little_memory(tmp_path):
    data = hf_tokenizer()
    added(data, "<|far|>", 10**9)
    path = written(tmp_path, data)

    # 2 GB of address space: the ids below a billion would need 8 GB, and be killed
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    done = subprocess.run([sys.executable, "-m", "tinylm", "tokenizer", "import", str(path), "--out",
                           str(tmp_path / "out.json")], capture_output=True, text=True, timeout=120, preexec_fn=limit)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0] and "'<|far|>' has id 1,000,000,000" in lines[0], done.stderr
    assert not (tmp_path / "out.json").exists()


@pytest.mark.parametrize("edit", ["vocab", "added word", "special"])
def test_an_id_far_past_the_others_is_refused_before_anything_is_allocated(tmp_path, edit):
    data = hf_tokenizer()
    far = 10**7  # before the gap rule this "imported" as a ten-million-token vocabulary of empty tokens
    if edit == "vocab":
        data["model"]["vocab"]["far"] = far
    else:
        added(data, "far", far, special=edit == "special")
    started = time.perf_counter()
    refused(written(tmp_path, data), f"token 'far' has id {far:,}, but only")
    assert time.perf_counter() - started < 1


def test_a_few_unused_ids_are_fine_and_one_more_is_not(tmp_path):
    data = hf_tokenizer()
    used = len(data["model"]["vocab"]) + 1  # and the new token
    added(data, "<|last|>", used - 1 + MAX_UNUSED_IDS)  # exactly MAX_UNUSED_IDS ids below it stay unused
    tok = import_tokenizer(written(tmp_path, data), roles={"eos": "<|endoftext|>"})
    assert tok.vocab_size == used + MAX_UNUSED_IDS and tok.special_tokens["<|last|>"] == tok.vocab_size - 1
    data["added_tokens"][-1]["id"] += 1
    refused(written(tmp_path, data), f"at most {MAX_UNUSED_IDS:,} unused")


def test_a_tiktoken_rank_far_past_the_others_or_below_zero_is_one_line(tmp_path):
    lines = [f"{base64.b64encode(bytes([b])).decode()} {b}" for b in range(256)]
    far = written(tmp_path, "\n".join([*lines, f"{base64.b64encode(b'to').decode()} {10**8}"]), "far.tiktoken")
    refused(far, f"token b'to' has rank {10**8:,}, but only 257 ranks are in use")
    lines[7] = f"{base64.b64encode(bytes([7])).decode()} -3"
    refused(written(tmp_path, "\n".join(lines), "negative.tiktoken"), "token b'\\x07' has rank -3")


def test_a_tinylm_file_of_an_imported_tokenizer_states_no_far_id(tmp_path, capsys):
    tok = import_tokenizer(written(tmp_path, hf_tokenizer()))
    far = 10**7
    for changes in ({"vocab_size": far}, {"special_tokens": {**tok.special_tokens, "<|far|>": far}}):
        path = edited(tmp_path, tok, **changes)
        assert main(["tokenizer", "encode", "--tokenizer", str(path), "--text", "to be"]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and "is corrupt" in lines[0] and f"{far:,}" in lines[0], lines


def sloppy(path: str, value):
    """An edit of `hf_tokenizer`'s data: set the value at a slash-separated path ("model/vocab/he")."""
    def edit(data):
        *keys, last = path.split("/")
        node = data
        for key in keys:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
    return edit


@pytest.mark.parametrize("edit,needle", [
    # what `tokenizers` refuses with a traceback-free error of its own, tinylm refuses in one line
    (sloppy("model/vocab/he", 1.5), "the vocab gives 'he' the id 1.5; an id is a whole number from 0"),
    (sloppy("model/vocab/he", "7"), "the vocab gives 'he' the id '7'"),
    (sloppy("model/vocab/he", True), "the vocab gives 'he' the id True"),
    (sloppy("model/vocab/he", -1), "the vocab gives 'he' the id -1"),
    (sloppy("model/vocab", ["he", "Ġt"]), "the vocab is a list, not an object of token -> id"),
    (sloppy("model/merges/1", 7), "merge 1 is 7, not two tokens"),
    (sloppy("model/merges/1", "h e x"), "merge 1 is 'h e x', not two tokens"),
    (sloppy("model/merges", {"h": "e"}), "the merges are an object, not a list"),
    (sloppy("added_tokens/0/id", 1.5), "added token '<|endoftext|>' has the id 1.5"),
    (sloppy("added_tokens/0/id", -1), "added token '<|endoftext|>' has the id -1"),
    (sloppy("added_tokens/0", "<|endoftext|>"), "added token 0 (<|endoftext|>) has no \"content\" text"),
    (sloppy("added_tokens", {"<|endoftext|>": 0}), "added_tokens is an object, not a list"),
    (sloppy("model/merges/1", ["h", "zz"]), "merge 1 ('h', 'zz') uses 'zz', which is not in the vocab"),
    (lambda data: data["model"]["vocab"].pop("he"), "merge 1 ('h', 'e') makes 'he', which is not in the vocab"),
    # the pipeline's parts are objects (or null), a Sequence's steps a list of them
    (sloppy("pre_tokenizer", "ByteLevel"), "the pre_tokenizer (or a step in it) is a string, not an object"),
    (sloppy("normalizer", {"type": "Sequence", "normalizers": [7]}), "the normalizer (or a step in it) is a number"),
    (sloppy("decoder", {"type": "Sequence", "decoders": {}}), "the decoder is a Sequence whose 'decoders' is an object"),
    # one id, two tokens (or one token, two ids): the ids or the text would be ambiguous
    (lambda data: added(data, "<|other|>", 0), "added tokens '<|endoftext|>' and '<|other|>' share the id 0"),
    (lambda data: added(data, "<|endoftext|>", 300), "'<|endoftext|>' is listed with the ids 0 and 300"),
])
def test_a_sloppy_tokenizer_json_is_one_line_naming_the_entry(tmp_path, edit, needle):
    data = hf_tokenizer()
    edit(data)
    refused(written(tmp_path, data), needle)


def test_sloppy_gpt2_vocab_json_and_merges_txt_are_one_line(tmp_path):
    data = hf_tokenizer()
    vocab = data["model"]["vocab"]
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(" ".join(m) for m in data["model"]["merges"]))
    eos = {"eos": "<|endoftext|>"}
    assert import_tokenizer(written(tmp_path, vocab, "vocab.json"), roles=eos).vocab_size == len(vocab)
    refused(written(tmp_path, {**vocab, "he": "7"}, "vocab.json"), "vocab.json gives 'he' the id '7'")
    refused(written(tmp_path, {**vocab, "far": 10**7}, "vocab.json"), f"token 'far' has id {10**7:,}")
    path = written(tmp_path, vocab, "vocab.json")
    config = {"added_tokens_decoder": {"first": {"content": "<|endoftext|>", "special": True}}}
    written(tmp_path, config, "tokenizer_config.json")
    with pytest.raises(TinyLMError, match=re.escape("tokenizer_config.json: added token '<|endoftext|>' has the id "
                                                     "'first'")):
        import_tokenizer(path)
    (tmp_path / "tokenizer_config.json").unlink()
    (tmp_path / "merges.txt").write_text("h e x\n")
    with pytest.raises(TinyLMError, match=re.escape("merges.txt: merge 0 is 'h e x', not two tokens")):
        import_tokenizer(path, roles=eos)


def test_a_tokenizer_json_or_side_file_that_is_no_json_object_is_one_line(tmp_path):
    path = written(tmp_path, [hf_tokenizer()])
    for read in (read_hf_tokenizer, load_hf_tokenizer_json):
        with pytest.raises(TinyLMError, match=re.escape(f"{path} is a list, not a Hugging Face tokenizer.json")):
            read(path)
    written(tmp_path, hf_tokenizer())
    for name in ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        written(tmp_path, "null", name)
        refused(tmp_path, f"{tmp_path / name} is null, not a JSON object")  # as transformers refuses it
        (tmp_path / name).unlink()


def test_an_imported_tokenizer_is_written_by_the_one_tokenizer_json_writer(tmp_path):
    tok = import_tokenizer(written(tmp_path, hf_tokenizer()))
    (tmp_path / "out").mkdir()
    saved = save_hf_tokenizer_json(tok, tmp_path / "out" / "tokenizer.json")
    assert json.loads(saved.read_text(encoding="utf-8")) == to_hf_tokenizer_json(tok) == imported_to_hf_json(tok)
    assert import_tokenizer(saved).encode("the tokens") == tok.encode("the tokens")


# ----- JSON nested deeper than any real file ----------------------------------------------------------------------


def nested(depth: int) -> str:
    """A pre_tokenizer of ``depth`` Sequences, each in the one before: 2 * depth levels of JSON."""
    return '{"type": "Sequence", "pretokenizers": [' * depth + "null" + "]}" * depth


def one_line_from_cli(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"more than {MAX_DEPTH} levels deep" in err[0], err
    return err[0]


@pytest.mark.parametrize("depth", [
    100_000,  # json's own parser gives up (RecursionError) ...
    440,  # ... or parses it, and the code that walks the pipeline would not
])
def test_a_deeply_nested_tokenizer_json_is_one_line(tmp_path, capsys, depth):
    text = json.dumps(hf_tokenizer()).replace('"pre_tokenizer": {', f'"pre_tokenizer": {nested(depth)}, "was": {{', 1)
    path = written(tmp_path, text)
    assert str(path) in one_line_from_cli(capsys, ["tokenizer", "import", str(path), "--out", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()


def test_a_deeply_nested_tinylm_tokenizer_file_is_one_line(tmp_path, capsys):
    path = edited(tmp_path, CharTokenizer.train(TEXT))
    path.write_text(path.read_text().replace("{", '{"extra": ' + nested(100_000) + ", ", 1))
    assert str(path) in one_line_from_cli(capsys, ["tokenizer", "encode", "--tokenizer", str(path), "--text", "to be"])


def test_a_deeply_nested_model_config_json_is_one_line(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    written(model, '{"architectures": ' + "[" * 100_000 + "]" * 100_000 + "}", "config.json")
    line = one_line_from_cli(capsys, ["import", "--from", str(model), "--out", str(tmp_path / "run")])
    assert str(model / "config.json") in line and not (tmp_path / "run").exists()
