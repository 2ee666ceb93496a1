"""Fixtures for the generation tests (the tiny models and toy models are in `toys.py`)."""

from __future__ import annotations

import pytest

from tinylm.tokenizers import BPETokenizer


@pytest.fixture(scope="session")
def byte_tokenizer() -> BPETokenizer:
    """The bare byte-level tokenizer: one token per byte (ids 0..255), then bos, eos, pad."""
    return BPETokenizer([], pattern="gpt2")
