"""tinylm: autoregressive Transformer language models end to end, from tokenizer to served model.

The pipeline, in order, and the few names most users need:

- tokenizers: `CharTokenizer`, `WordTokenizer`, `BPETokenizer`, `train_bpe`, `load_tokenizer`
- data: `load_corpus`, `prepare` (token shards)
- model: `GPT`, `GPTConfig`
- runs (what a trained model is on disk): `load_run`; training is `tinylm.train.train`
- generation: `SamplingParams`, with `tinylm.generate.generate`

The model, training and generation names are imported on first use, so that `import tinylm`
(and the `tinylm` command's --help) does not pay for importing PyTorch.
"""

from importlib import import_module
from typing import Any

from tinylm.errors import TinyLMError
from tinylm.tokenizers import BPETokenizer, CharTokenizer, Tokenizer, WordTokenizer, load_tokenizer, train_bpe

__version__ = "0.1.0"

_LAZY = {
    "load_corpus": "tinylm.data",
    "prepare": "tinylm.data",
    "GPT": "tinylm.model",
    "GPTConfig": "tinylm.model",
    "load_run": "tinylm.run",
    "SamplingParams": "tinylm.generate",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tinylm' has no attribute {name!r}")


__all__ = [
    "TinyLMError", "Tokenizer", "CharTokenizer", "WordTokenizer", "BPETokenizer", "train_bpe", "load_tokenizer",
    *_LAZY,
]
