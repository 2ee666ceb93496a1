"""Fixtures for the explain tests: a small untrained Transformer run folder on the byte-level tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tinylm.config import Config, GPTConfig, TrainConfig, dump_toml
from tinylm.model import GPT, RecurrentLM
from tinylm.run import checkpoint_path, save_checkpoint, write_run_info
from tinylm.tokenizers import BPETokenizer


@pytest.fixture(scope="session")
def small_run_dir(tmp_path_factory) -> Path:
    """A run folder as `tinylm train` leaves it (config.toml, tokenizer.json, run.json, a best checkpoint), block_size 16."""
    folder = tmp_path_factory.mktemp("explain-run")
    tok = BPETokenizer([], pattern="gpt2")
    model_config = GPTConfig(vocab_size=tok.vocab_size, block_size=16, n_layer=2, d_model=32, n_head=4,
                             positions="rope", norm="rmsnorm", mlp="swiglu", bias=False, init_std=0.25)
    config = Config(model_config, TrainConfig())
    torch.manual_seed(0)
    model = GPT(model_config)
    save_checkpoint(checkpoint_path(folder, "best"), model_state=model.state_dict(), optimizer_state=None,
                    rng_state={}, state={"step": 0}, config=config, tokenizer=tok)
    (folder / "config.toml").write_text(dump_toml(config.to_dict()), encoding="utf-8")
    tok.save(folder / "tokenizer.json")
    write_run_info(folder, {"status": "complete"})
    return folder


@pytest.fixture
def lstm_run_dir(tmp_path) -> Path:
    """An untrained one-layer LSTM run folder: what the Transformer-only explanations must refuse in one line."""
    tok = BPETokenizer([], pattern="gpt2")
    model_config = GPTConfig(family="lstm", vocab_size=tok.vocab_size, block_size=16, n_layer=1, d_model=16)
    config = Config(model_config, TrainConfig())
    save_checkpoint(checkpoint_path(tmp_path, "best"), model_state=RecurrentLM(model_config).state_dict(),
                    optimizer_state=None, rng_state={}, state={"step": 0}, config=config, tokenizer=tok)
    (tmp_path / "config.toml").write_text(dump_toml(config.to_dict()), encoding="utf-8")
    write_run_info(tmp_path, {"status": "complete"})
    return tmp_path
