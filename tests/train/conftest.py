"""Fixtures for the training tests: a local corpus and its prepared shards."""

from __future__ import annotations

from pathlib import Path

import pytest
from trainkit import tiny_config, write_corpus

from tinylm.train import prepare_data


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "plays")


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory, corpus) -> Path:
    """The corpus tokenized once (char tokenizer) for every test that trains."""
    folder = tmp_path_factory.mktemp("data") / "plays-char"
    prepare_data(tiny_config(corpus, folder).train, log=lambda line: None)
    return folder
