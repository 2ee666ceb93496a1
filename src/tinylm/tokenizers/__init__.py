"""Tokenizers: text to token ids and back, behind one interface (`Tokenizer`).

- `CharTokenizer`: one token per character (vocabulary from the training text).
- `WordTokenizer`: the most frequent words, `<unk>` or byte fallback for the rest.
- `BPETokenizer`: byte-level BPE (merge the most frequent adjacent pair, repeat), encoded through tiktoken.
- `ByteLevelBPETokenizer`, `SentencePieceBPETokenizer`: tokenizers of models made elsewhere (GPT-2,
  Llama, Qwen2, Mistral), with their own ids; read by `tinylm.tokenizers.hf_files`.

`load_tokenizer(path)` reads any of them back from tinylm's versioned JSON file.
"""

from tinylm.tokenizers.base import BOS, EOS, KINDS, PAD, StreamDecoder, Tokenizer, load_tokenizer, tokenizer_from_dict
from tinylm.tokenizers.bpe import PATTERNS, BPETokenizer
from tinylm.tokenizers.bpe_train import train_bpe
from tinylm.tokenizers.imported import ByteLevelBPETokenizer, SentencePieceBPETokenizer
from tinylm.tokenizers.pieces import CharTokenizer, WordTokenizer

# the kinds `train_tokenizer` can train (the imported kinds are read from files, never trained)
TRAINABLE = ("char", "word", "bpe")


def train_tokenizer(kind: str, texts, *, vocab_size: int | None = None, pattern: str = "gpt4", unknown: str = "unk",
                    n_reserved: int = 0, workers: int | None = None, progress: bool = False) -> Tokenizer:
    """Train a tokenizer of ``kind`` ("char", "word" or "bpe") on ``texts``: the one place that picks the trainer.

    ``vocab_size`` is |V| with the special tokens (word and bpe; a char vocabulary is what the text holds);
    ``pattern`` is bpe's split pattern; ``unknown`` the char/word policy for unseen pieces ("unk" or "bytes");
    ``workers`` and ``progress`` are bpe's (processes counting pairs, a progress bar).
    """
    from tinylm.errors import TinyLMError

    if kind == "char":
        return CharTokenizer.train(texts, unknown=unknown, n_reserved=n_reserved)
    if kind not in TRAINABLE:
        raise TinyLMError(f"unknown tokenizer kind {kind!r}; expected one of {', '.join(TRAINABLE)}")
    if vocab_size is None:
        raise TinyLMError(f"a {kind} tokenizer needs a vocabulary size")
    if kind == "word":
        return WordTokenizer.train(texts, vocab_size, unknown=unknown, n_reserved=n_reserved)
    extra = {} if workers is None else {"workers": workers}
    return train_bpe(texts, vocab_size=vocab_size, pattern=pattern, n_reserved=n_reserved, progress=progress, **extra)


# KINDS: kind (as written in the JSON file) -> class, filled as the classes above are defined

__all__ = [
    "BOS", "EOS", "PAD", "PATTERNS", "KINDS",
    "Tokenizer", "StreamDecoder", "CharTokenizer", "WordTokenizer", "BPETokenizer",
    "ByteLevelBPETokenizer", "SentencePieceBPETokenizer",
    "train_bpe", "train_tokenizer", "TRAINABLE", "load_tokenizer", "tokenizer_from_dict",
]
