"""A Hugging Face config.json with absurd sizes is refused by `tinylm import` in one line, before the model is
allocated, and nothing is written: no run whose sampling would then try to allocate terabytes."""

from __future__ import annotations

import json

import pytest
from exportkit import tiny_model

from tinylm.cli import main
from tinylm.export import export_hf


@pytest.mark.parametrize("name, changes, named", [
    ("gpt2", {"n_layer": 100_000_000}, "lower n_layer (now 100000000"),
    ("gpt2", {"n_positions": 1e12, "n_ctx": 1e12}, "lower block_size (now 1000000000000"),  # learned positions
    ("llama-gqa", {"max_position_embeddings": 1e12}, "lower block_size (now 1000000000000"),  # RoPE tables, KV cache
    ("llama-gqa", {"intermediate_size": 10**12}, "lower d_ff (now 1000000000000"),
    ("llama-gqa", {"hidden_size": 10**7, "num_attention_heads": 1, "num_key_value_heads": 1}, "lower d_model"),
])
def test_an_absurd_config_json_is_refused_before_the_model_is_built(tmp_path, capsys, tokenizer, name, changes,
                                                                    named):
    folder = export_hf(tiny_model(name), tokenizer, tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    code = main(["import", "--from", str(folder), "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "more than this machine's" in err[0] and named in err[0], err
    assert not (tmp_path / "run" / "config.toml").exists()  # no run to sample from


@pytest.mark.parametrize("name, changes", [
    ("gpt2", {"n_layer": float("inf")}),
    ("gpt2", {"n_head": "twelve"}),
    ("llama-gqa", {"max_position_embeddings": [4096]}),
    ("llama-gqa", {"rms_norm_eps": "small"}),
])
def test_a_size_that_is_not_a_number_is_one_line(tmp_path, capsys, tokenizer, name, changes):
    folder = export_hf(tiny_model(name), tokenizer, tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))  # inf is written as Infinity
    code = main(["import", "--from", str(folder), "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "holds a value that is not a number" in err[0], err
    assert not (tmp_path / "run").exists()
