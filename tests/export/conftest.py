"""Fixtures for the export tests: one thread and a throwaway BPE tokenizer (see `exportkit`)."""

from __future__ import annotations

import pytest
import torch
from exportkit import make_tokenizer

from tinylm.tokenizers import BPETokenizer


@pytest.fixture(autouse=True)
def one_thread():
    # Tiny models on a busy 2-core machine: splitting their matmuls across threads costs more than it saves.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tokenizer() -> BPETokenizer:
    return make_tokenizer()
