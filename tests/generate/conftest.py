"""Fixtures for the generation tests (the tiny models and toy models are in `toys.py`)."""

from __future__ import annotations

import pytest
import torch

from tinylm.tokenizers import BPETokenizer


@pytest.fixture(autouse=True)
def one_thread():
    # tiny models on a busy 2-core machine: one thread is faster and keeps timings stable
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def byte_tokenizer() -> BPETokenizer:
    """The bare byte-level tokenizer: one token per byte (ids 0..255), then bos, eos, pad."""
    return BPETokenizer([], pattern="gpt2")
