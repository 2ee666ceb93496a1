"""Fixtures for the export tests: a throwaway BPE tokenizer (see `exportkit`)."""

from __future__ import annotations

import pytest
from exportkit import make_tokenizer

from tinylm.tokenizers import BPETokenizer


@pytest.fixture(scope="session")
def tokenizer() -> BPETokenizer:
    return make_tokenizer()
