"""The tokenizer half of a GGUF file: what llama.cpp reads to turn text into the model's ids and back.

Byte-level BPE (tinylm's own, GPT-2, Llama 3, Qwen2, .tiktoken) is written as llama.cpp's "gpt2"
tokenizer model with a ``tokenizer.ggml.pre`` name for the split regex (`pre_tokenizer_name`,
`LLAMA_CPP_PRE`); SentencePiece-style BPE (Llama 2, Mistral) as its "llama" model with
merge-order scores and BYTE tokens. docs/export.md ("The GGUF tokenizer") has the details.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any

from tinylm.errors import TinyLMError
from tinylm.tokenizers.base import Tokenizer, default_stop_ids
from tinylm.tokenizers.bpe import BPETokenizer, pattern_name
from tinylm.tokenizers.formats import DIGITS_THEN_GPT2, _bpe_below, bytes_to_byte_level, pattern_from_oniguruma
from tinylm.tokenizers.imported import ByteLevelBPETokenizer, ImportedTokenizer, SentencePieceBPETokenizer

# our split pattern name -> llama.cpp's tokenizer.ggml.pre (see `tinylm.export.gguf`)
LLAMA_CPP_PRE: dict[str, str] = {"gpt2": "gpt-2", "gpt4": "dbrx"}
# the split regexes of imported families, as their tokenizer.json files write them -> llama.cpp's name
# (SmolLM's Digits + ByteLevel pipeline is the one pattern `DIGITS_THEN_GPT2` reads it as)
_FAMILY_PATTERNS: dict[str, str] = {"smollm": DIGITS_THEN_GPT2[True]}
_FAMILY_REGEXES: dict[str, str] = {
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+",
}


def _require_gguf() -> ModuleType:
    """The `gguf` package, imported on first use: an optional dependency that only GGUF export needs."""
    try:
        import gguf
    except ImportError:
        raise TinyLMError("GGUF export needs the `gguf` package (llama.cpp's writer): pip install gguf") from None
    return gguf


def pre_tokenizer_name(tokenizer: Tokenizer, pre_tokenizer: str | None = None) -> str:
    """llama.cpp's pre-tokenizer for ``tokenizer``'s split pattern (or the caller's ``pre_tokenizer``)."""
    if pre_tokenizer is not None:
        return pre_tokenizer
    pattern = getattr(tokenizer, "pattern", "")
    name = pattern_name(pattern)
    if name in LLAMA_CPP_PRE:
        return LLAMA_CPP_PRE[name]
    for pre, regex_text in _FAMILY_REGEXES.items():
        if pattern == pattern_from_oniguruma(regex_text):
            return pre
    for pre, family_pattern in _FAMILY_PATTERNS.items():
        if pattern == family_pattern:
            return pre
    known = [f"{k} -> {v}" for k, v in LLAMA_CPP_PRE.items()] + ["Llama 3's -> llama-bpe", "Qwen2's -> qwen2",
                                                                  "SmolLM's -> smollm"]
    raise TinyLMError(
        f"the tokenizer splits text with the pattern {name or pattern!r}, which llama.cpp has no pre-tokenizer for "
        f"(it knows {', '.join(known)}); name one with pre_tokenizer=... if you accept that llama.cpp will split text "
        "differently, or train the tokenizer with the gpt2 or gpt4 pattern")


def _padded(tokens: list[str], types: list[int], vocab_size: int, unused: int) -> None:
    for i in range(len(tokens), vocab_size):  # embedding rows no token uses (never sampled by name)
        tokens.append(f"[PAD{i}]")
        types.append(unused)


def _require_readable(tokenizer: Tokenizer) -> None:
    """Refuse, in one line, a tokenizer kind llama.cpp has no model for."""
    if not isinstance(tokenizer, (BPETokenizer, ByteLevelBPETokenizer, SentencePieceBPETokenizer)):
        raise TinyLMError(f"a {tokenizer.kind} tokenizer cannot go into a GGUF file: llama.cpp reads byte-level BPE "
                          "(tokenizer.ggml.model 'gpt2') and SentencePiece ('llama'); train the model with a BPE "
                          "tokenizer")


def check_tokenizer(tokenizer: Tokenizer, pre_tokenizer: str | None = None) -> None:
    """Refuse, in one line, a tokenizer llama.cpp cannot read or split as we do (before a file is written)."""
    _require_readable(tokenizer)
    if not isinstance(tokenizer, SentencePieceBPETokenizer):
        pre_tokenizer_name(tokenizer, pre_tokenizer)


def tokenizer_metadata(tokenizer: Tokenizer, vocab_size: int) -> dict[str, Any]:
    """The tokenizer model, token strings, types and merges (or scores) llama.cpp reads, for ``vocab_size`` rows."""
    g = _require_gguf()
    types_of = g.TokenType
    if isinstance(tokenizer, SentencePieceBPETokenizer):
        return _sentencepiece(tokenizer, vocab_size, types_of)
    _require_readable(tokenizer)
    added = getattr(tokenizer, "added_words", {})
    tokens: list[str] = []
    types: list[int] = []
    for i in range(tokenizer.vocab_size):
        if i in tokenizer._special_bytes:
            tokens.append(tokenizer.token_bytes(i).decode("utf-8"))  # a special token is stored as its name
            types.append(int(types_of.CONTROL))
        elif isinstance(tokenizer, ByteLevelBPETokenizer) and tokenizer.tokens[i] is None:
            tokens.append(f"[PAD{i}]")
            types.append(int(types_of.UNUSED))
        elif i in added.values():
            tokens.append(tokenizer.token_bytes(i).decode("utf-8"))
            types.append(int(types_of.USER_DEFINED))
        else:
            tokens.append(bytes_to_byte_level(tokenizer.token_bytes(i)))
            types.append(int(types_of.NORMAL))
    _padded(tokens, types, vocab_size, int(types_of.UNUSED))
    return {"model": "gpt2", "tokens": tokens, "token_types": types, "merges": _merges(tokenizer)}


def _merges(tokenizer: BPETokenizer | ByteLevelBPETokenizer) -> list[str]:
    if isinstance(tokenizer, BPETokenizer):
        spell = [bytes_to_byte_level(b) for b in tokenizer.vocab]
        return [f"{spell[a]} {spell[b]}" for a, b in tokenizer.merges]
    if tokenizer.merges:
        return [f"{bytes_to_byte_level(tokenizer.tokens[a])} {bytes_to_byte_level(tokenizer.tokens[b])}"
                for a, b in tokenizer.merges]
    # a .tiktoken file has ranks, no merges: token r was made from the two pieces BPE gives its bytes with the
    # ranks below r (a token BPE cannot make that way is reached only as a whole chunk, and gets no merge)
    ranks = tokenizer._token_ids
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) > 1:
            parts = _bpe_below(token, ranks, rank)
            if len(parts) == 2:
                merges.append(f"{bytes_to_byte_level(parts[0])} {bytes_to_byte_level(parts[1])}")
    return merges


def _sentencepiece(tok: SentencePieceBPETokenizer, vocab_size: int, types_of: Any) -> dict[str, Any]:
    byte_tokens = set(tok._byte_token)  # the ids of the 256 <0xNN> pieces
    made_by = {}
    for r, (a, b) in enumerate(tok.merges):
        made_by.setdefault(tok._merge[a, b][1], r)
    tokens: list[str] = []
    types: list[int] = []
    scores: list[float] = []
    last = -float(len(tok.merges) + 1)
    for i in range(tok.vocab_size):
        piece = tok.pieces[i]
        if i == tok.unk_id:
            tokens.append(tok.unk or "<unk>")
            types.append(int(types_of.UNKNOWN))
        elif i in tok._special_bytes:
            tokens.append(tok.token_bytes(i).decode("utf-8"))
            types.append(int(types_of.CONTROL))
        elif piece is None:
            tokens.append(f"[PAD{i}]")
            types.append(int(types_of.UNUSED))
        elif i in tok.added_words.values() and i not in byte_tokens:  # a byte token is a BYTE, however listed
            tokens.append(piece)
            types.append(int(types_of.USER_DEFINED))
        else:
            tokens.append(piece)
            types.append(int(types_of.BYTE if i in byte_tokens else types_of.NORMAL))
        scores.append(-float(made_by[i]) if i in made_by else (0.0 if len(piece or "") <= 1 else last))
    _padded(tokens, types, vocab_size, int(types_of.UNUSED))
    scores += [last] * (len(tokens) - len(scores))
    return {"model": "llama", "tokens": tokens, "token_types": types, "scores": scores,
            "add_space_prefix": tok.prefix != "never"}


def write_tokenizer(writer: Any, tokenizer: Tokenizer, vocab_size: int, pre_tokenizer: str | None,
                    start: Sequence[int] | None = None) -> None:
    """Add ``tokenizer`` to a `gguf.GGUFWriter`: its model, pre-tokenizer, tokens, merges or scores, and ids.
    ``start`` (none or one special id; default: the tokenizer's own BOS where it adds one) is the BOS the file
    tells llama.cpp to put before a prompt."""
    if start is None:
        start = [tokenizer.bos_id] if tokenizer.add_bos else []
    vocab = tokenizer_metadata(tokenizer, vocab_size)
    writer.add_tokenizer_model(vocab["model"])
    if vocab["model"] == "gpt2":
        writer.add_tokenizer_pre(pre_tokenizer_name(tokenizer, pre_tokenizer))
    else:
        writer.add_tokenizer_pre("default")
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types(vocab["token_types"])
    if "merges" in vocab:
        writer.add_token_merges(vocab["merges"])
    if "scores" in vocab:
        writer.add_token_scores(vocab["scores"])
        writer.add_add_space_prefix(vocab["add_space_prefix"])
    writer.add_bos_token_id(start[0] if start else tokenizer.bos_id)
    writer.add_eos_token_id(tokenizer.eos_id)
    writer.add_pad_token_id(tokenizer.pad_id)
    stop_ids = sorted(default_stop_ids(tokenizer) - {tokenizer.eos_id})
    if stop_ids:  # the end of a turn (Llama 3's <|eot_id|>, a fine-tuned tinylm model's <|im_end|>): llama.cpp
        writer.add_eot_token_id(stop_ids[0])  # stops generating there too, and its chat replies end with the turn
    unk = getattr(tokenizer, "unk_id", None)
    if isinstance(tokenizer, ImportedTokenizer) and unk is not None:
        writer.add_unk_token_id(unk)
    # the token tinylm puts before a prompt (run.start_ids: a tinylm model's separator, an imported Llama's
    # "<s>", or none), as the BOS llama.cpp adds
    writer.add_add_bos_token(bool(start))
    writer.add_add_eos_token(False)
    template = getattr(tokenizer, "chat_template", None)
    if template:
        writer.add_chat_template(template)
