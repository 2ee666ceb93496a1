"""tinylm: autoregressive Transformer language models end to end, as the lecture notes describe them.

The pipeline, in the order of the lectures: tokenizers (`tinylm.tokenizers`), corpora and
token shards (`tinylm.data`), then the model, training and generation.
"""

from tinylm.errors import TinyLMError
from tinylm.tokenizers import BPETokenizer, CharTokenizer, Tokenizer, WordTokenizer, load_tokenizer, train_bpe

__version__ = "0.1.0"

__all__ = [
    "TinyLMError",
    "Tokenizer",
    "CharTokenizer",
    "WordTokenizer",
    "BPETokenizer",
    "train_bpe",
    "load_tokenizer",
]
