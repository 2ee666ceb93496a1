"""Data: corpora of documents, and the token shards a model trains on.

- `load_corpus(spec)`: a built-in corpus (``shakespeare``, ``stdlib``) or local text files,
  folders and JSONL, as a lazily read `Corpus` of `Document`\\s (`tinylm.data.corpora`).
- `prepare(corpus, tokenizer, out_dir)`: tokenize once into ``train.bin`` / ``val.bin`` with
  EOS between documents; `ShardSet` reads them back as memmaps and draws training windows
  (`tinylm.data.shards`).
"""

from tinylm.data.corpora import CORPORA, ERRORS, Corpus, Document, cache_dir, load_corpus, strip_gutenberg
from tinylm.data.shards import ShardSet, prepare, token_dtype

__all__ = [
    "CORPORA", "ERRORS", "Corpus", "Document", "load_corpus", "cache_dir", "strip_gutenberg",
    "ShardSet", "prepare", "token_dtype",
]
