"""Hand-edited tokenizer files: every wrong size or type is one clear line, before anything is allocated."""

from __future__ import annotations

import json
import resource
import subprocess
import sys

import pytest

from tinylm.tokenizers import CharTokenizer, train_bpe

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
