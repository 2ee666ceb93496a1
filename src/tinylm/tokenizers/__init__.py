"""Tokenizers: text to token ids and back, behind one interface (`Tokenizer`).

- `CharTokenizer`: one token per character (vocabulary from the training text).
- `WordTokenizer`: the most frequent words, `<unk>` or byte fallback for the rest.
- `BPETokenizer`: byte-level BPE trained as in the lecture notes, encoded through tiktoken.
- `ByteLevelBPETokenizer`, `SentencePieceBPETokenizer`: tokenizers of models made elsewhere (GPT-2,
  Llama, Qwen2, Mistral), with their own ids; read by `tinylm.tokenizers.hf_files`.

`load_tokenizer(path)` reads any of them back from tinylm's versioned JSON file.
"""

from tinylm.tokenizers.base import BOS, EOS, PAD, StreamDecoder, Tokenizer, load_tokenizer, tokenizer_from_dict
from tinylm.tokenizers.bpe import PATTERNS, BPETokenizer, train_bpe
from tinylm.tokenizers.imported import ByteLevelBPETokenizer, SentencePieceBPETokenizer
from tinylm.tokenizers.pieces import CharTokenizer, WordTokenizer

# kind (as written in the JSON file) -> class; `load_tokenizer` dispatches on it
KINDS: dict[str, type[Tokenizer]] = {"char": CharTokenizer, "word": WordTokenizer, "bpe": BPETokenizer,
                                     "bytelevel": ByteLevelBPETokenizer, "sentencepiece": SentencePieceBPETokenizer}

__all__ = [
    "BOS", "EOS", "PAD", "PATTERNS", "KINDS",
    "Tokenizer", "StreamDecoder", "CharTokenizer", "WordTokenizer", "BPETokenizer",
    "ByteLevelBPETokenizer", "SentencePieceBPETokenizer",
    "train_bpe", "load_tokenizer", "tokenizer_from_dict",
]
