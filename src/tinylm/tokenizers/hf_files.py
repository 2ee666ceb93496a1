"""Read (and write back) the tokenizer files of `transformers` and `tokenizers`, in any id layout.

A checkpoint folder made by `transformers` holds its tokenizer in one of two ways:

- ``tokenizer.json`` (the `tokenizers` library's pipeline: normalizer, pre-tokenizer, BPE model,
  post-processor, decoder, added tokens), usually with ``tokenizer_config.json`` beside it;
- or the older ``vocab.json`` + ``merges.txt`` (GPT-2's own files), with the same side files.

``tokenizer_config.json`` (or ``special_tokens_map.json``) names the bos, eos, pad and unk tokens and
holds the ``chat_template`` (transformers 4.47+ may write it to ``chat_template.jinja`` instead).
Whether a text starts with BOS is up to tokenizer.json's post-processor (as in `transformers` 5;
GPT-2's vocab.json + merges.txt have none, and there ``add_bos_token`` says). The model's
``generation_config.json`` lists the ids that end a generation (``eos_token_id``: Llama 3 Instruct's
``<|eot_id|>`` besides eos); they and the token the chat template ends an assistant's turn with
become the tokenizer's ``stop_ids``.

`read_hf_tokenizer` turns them into the tokenizer that computes the same ids:

- a byte-level BPE in tinylm's own layout (as tinylm exports it) stays a `BPETokenizer` (with ChatML's two
  markers and tokenizer_config.json's chat template where the export is of a fine-tuned model);
- any other byte-level BPE (GPT-2, Llama 3, Qwen2, SmolLM-style files) is a `ByteLevelBPETokenizer`;
- a BPE over "▁"-pieces with ``<0xNN>`` byte tokens (Llama 2, TinyLlama, Mistral) is a
  `SentencePieceBPETokenizer`.

Everything that does not map (WordPiece or Unigram models, other normalizers or pre-tokenizers)
is one `TinyLMError` that names the part, never a tokenizer that gives other ids.

Reading and writing tokenizer.json itself is `tinylm.tokenizers.formats` (`imported_to_hf_json` writes an
imported tokenizer back as a tokenizer.json with the same ids); the other JSON files here are read with
`tinylm.jsonfile.read_json_object`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tinylm.errors import TinyLMError
from tinylm.jsonfile import read_json_object
from tinylm.tokenizers.base import Tokenizer
from tinylm.tokenizers.chat_template import turn_end_ids
from tinylm.tokenizers.formats import (
    byte_level_pre_tokenizer,
    byte_level_to_bytes,
    hf_added_tokens,
    hf_bpe_model,
    hf_entries,
    hf_merges,
    hf_pipeline,
    hf_vocab,
    read_hf_tokenizer_json,
    tokenizer_from_hf_json,
)
from tinylm.tokenizers.imported import (
    NORMALIZERS,
    SPACE_MARK,
    ByteLevelBPETokenizer,
    ImportedTokenizer,
    SentencePieceBPETokenizer,
    checked_vocab_size,
)

SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json")
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG_FILE = "generation_config.json"
ROLE_KEYS = {"bos": "bos_token", "eos": "eos_token", "pad": "pad_token", "unk": "unk_token"}
# names that usually end a text, tried in order when no file says which token is eos
EOS_GUESSES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<|eos|>", "<eos>", "<|im_end|>")


def _content(value: Any) -> str | None:
    """A token as tokenizer_config.json writes it: a string, or {"content": ...}, or null."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _side_config(folder: Path) -> dict[str, Any]:
    """tokenizer_config.json over special_tokens_map.json (either may be missing), plus chat_template.jinja."""
    merged: dict[str, Any] = {}
    for name in reversed(SIDE_FILES):
        path = folder / name
        if path.is_file():
            merged.update({k: v for k, v in read_json_object(path).items() if v is not None})
    template_file = folder / CHAT_TEMPLATE_FILE
    if template_file.is_file():
        merged["chat_template"] = template_file.read_text(encoding="utf-8")
    template = merged.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        merged["chat_template"] = named.get("default") or next(iter(named.values()), None)
    generation = folder / GENERATION_CONFIG_FILE
    if generation.is_file():
        merged["generation_eos_token_id"] = read_json_object(generation).get("eos_token_id")
    return merged


def _stop_ids(side: dict[str, Any], specials: dict[str, int], names: dict[str, str], size: int) -> list[int]:
    """The ids besides eos that end a generation: generation_config.json's ``eos_token_id`` (an id or a list;
    ids past the tokenizer's vocabulary are left out) and the token the chat template closes a turn with."""
    given = side.get("generation_eos_token_id")
    ids = {i for i in (given if isinstance(given, list) else [given])
           if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < size}
    template = side.get("chat_template")
    if isinstance(template, str):
        ids.update(turn_end_ids(template, specials, {f"{role}_token": name for role, name in names.items()}))
    return sorted(ids - {specials[names["eos"]]})


def read_hf_tokenizer(path: str | os.PathLike, *, roles: dict[str, str] | None = None) -> Tokenizer:
    """The tokenizer in a `transformers` folder, or in one tokenizer.json / vocab.json file (side files beside it).

    ``roles`` names the bos, eos or pad token where the files do not (e.g. {"eos": "<|endoftext|>"}).
    """
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            path = path / "tokenizer.json"
        elif (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
            path = path / "vocab.json"
        else:
            raise TinyLMError(f"{path} has neither tokenizer.json nor vocab.json with merges.txt")
    side = _side_config(folder)
    data = None if path.name == "vocab.json" else read_hf_tokenizer_json(path)
    if data is None or ("model" not in data and path.suffix == ".json" and (folder / "merges.txt").is_file()):
        return _from_vocab_and_merges(path, folder / "merges.txt", side, roles or {})
    if not isinstance(data.get("model"), dict):
        raise TinyLMError(f"{path} is not a Hugging Face tokenizer.json (no \"model\")")
    template = side.get("chat_template")
    try:  # tinylm's own layout keeps tinylm's own (faster, trainable) tokenizer, a fine-tuned one its chat template
        return tokenizer_from_hf_json(data, str(path), chat_template=template if isinstance(template, str) else None)
    except TinyLMError:
        pass
    return tokenizer_from_any_hf_json(data, side, roles or {}, str(path))


def tokenizer_from_any_hf_json(data: dict[str, Any], side: dict[str, Any], roles: dict[str, str],
                               source: str) -> ImportedTokenizer:
    """A parsed tokenizer.json (and its side config) as a byte-level or SentencePiece-style tokenizer."""

    def fail(what: str) -> TinyLMError:
        return TinyLMError(f"{source}: {what}; tinylm reads BPE tokenizers (byte-level, or SentencePiece-style "
                           "with byte fallback) only")

    model = hf_bpe_model(data, fail)
    hf_pipeline(data, source)
    vocab, merges, specials, words = hf_entries(data, source)
    size = checked_vocab_size([*vocab.items(), *specials.items(), *words.items()], source=source)
    add_bos, first = _template_start(data)
    if first is not None and "bos" not in roles and (first in specials or first in vocab):
        roles = {**roles, "bos": first}  # the token the pipeline starts a text with is the BOS the model saw
    byte_level = _is_byte_level(data)
    if byte_level:
        pattern, prefix_space = byte_level_pre_tokenizer(data.get("pre_tokenizer"), fail)
        normalizer = _unicode_normalizer(data.get("normalizer"), fail)
        if model.get("byte_fallback"):
            raise fail("a byte-level BPE with byte_fallback")
        return _byte_level(vocab, merges, size, pattern, specials, words, side, roles, fail,
                           add_prefix_space=prefix_space, normalizer=normalizer,
                           ignore_merges=bool(model.get("ignore_merges")), add_bos=add_bos)
    return _sentencepiece(data, vocab, merges, size, specials, words, side, roles, fail, add_bos=add_bos)


def _is_byte_level(data: dict[str, Any]) -> bool:
    def has(node: Any) -> bool:
        if not isinstance(node, dict):
            return False
        parts = node.get("pretokenizers") or node.get("decoders") or []
        return node.get("type") == "ByteLevel" or any(has(p) for p in parts)
    return has(data.get("pre_tokenizer")) or has(data.get("decoder"))


def _unicode_normalizer(node: Any, fail) -> str | None:
    steps = node.get("normalizers", []) if isinstance(node, dict) and node.get("type") == "Sequence" else \
        [node] if node else []
    if not steps:
        return None
    if len(steps) == 1 and steps[0].get("type") in NORMALIZERS:
        return steps[0]["type"]
    raise fail(f"its normalizer is {' + '.join(str(s.get('type')) for s in steps)}; tinylm applies NFC, NFKC, "
               "NFD or NFKD alone to byte-level BPE")


def _template_start(data: dict[str, Any]) -> tuple[bool, str | None]:
    """Whether the post-processor starts every text with a special token (a TemplateProcessing whose
    ``single`` begins with one), and that token's name.

    The post-processor alone decides: `transformers` (5.x) encodes with tokenizer.json's pipeline and
    ignores tokenizer_config.json's ``add_bos_token``, so a file that says true there but has no
    TemplateProcessing adds nothing, and the model reads its texts without a BOS."""
    post = data.get("post_processor") or {}
    steps = post.get("processors", []) if post.get("type") == "Sequence" else [post]
    for step in steps:
        if step.get("type") == "TemplateProcessing":
            single = step.get("single")
            first = single[0] if isinstance(single, list) and single and isinstance(single[0], dict) else {}
            token = first.get("SpecialToken")
            if not isinstance(token, dict):
                return False, None
            name = token.get("id")
            return True, name if isinstance(name, str) else None
    return False, None


def _resolve_roles(specials: dict[str, int], vocab_ids: dict[str, int], side: dict[str, Any],
                   given: dict[str, str], fail) -> tuple[dict[str, str], dict[str, int]]:
    """bos, eos, pad as special-token names: the caller's, the side files', then a guess for eos;
    bos and pad fall back to eos (as `transformers` users do). A role token the files keep as an
    ordinary vocab entry (GPT-2's "<|endoftext|>" in vocab.json) becomes a special token."""
    specials = dict(specials)
    names: dict[str, str] = {}
    for role, key in ROLE_KEYS.items():
        name = given.get(role) or _content(side.get(key))
        if name is None:
            continue
        if name not in specials:
            if name not in vocab_ids:
                if role in given:
                    raise TinyLMError(f"--{role} {name!r} is not a token of this tokenizer")
                continue  # the side file names a token this vocabulary lacks: ignore it
            specials[name] = vocab_ids[name]
        names[role] = name
    if "eos" not in names:
        guess = next((n for n in EOS_GUESSES if n in specials), None)
        if guess is None:
            raise fail(f"no token is named as eos (end of text) and none of {', '.join(EOS_GUESSES)} is a special "
                       f"token (it has {sorted(specials)[:6]}); name it, e.g. `--eos TOKEN`")
        names["eos"] = guess
    names.setdefault("bos", names["eos"])
    names.setdefault("pad", names["eos"])
    names.pop("unk", None)
    return names, specials


def _byte_level(vocab: dict[str, int], merges: list[tuple[str, str]], size: int, pattern: str,
                specials: dict[str, int], words: dict[str, int], side: dict[str, Any], roles: dict[str, str], fail, *,
                add_prefix_space: bool, normalizer: str | None, ignore_merges: bool,
                add_bos: bool) -> ByteLevelBPETokenizer:
    """The checked entries (``size``: their `checked_vocab_size`) as a byte-level BPE."""
    names, specials = _resolve_roles(specials, vocab, side, roles, fail)
    tokens: list[bytes | None] = [None] * size
    outside = {**specials, **words}
    for text, i in vocab.items():
        if text in outside and outside[text] == i:
            continue
        if tokens[i] is not None:
            raise fail(f"id {i} appears twice in the vocab")
        try:
            tokens[i] = byte_level_to_bytes(text)
        except TinyLMError as e:
            raise fail(f"{e} (id {i})") from None
    for text, i in words.items():
        tokens[i] = text.encode("utf-8")
    pairs = [(vocab[a], vocab[b]) for a, b in merges]
    try:
        return ByteLevelBPETokenizer(tokens, pairs, pattern, specials=specials, roles=names, vocab_size=size,
                                     add_prefix_space=add_prefix_space, normalizer=normalizer,
                                     ignore_merges=ignore_merges, add_bos=add_bos, added_words=words,
                                     chat_template=side.get("chat_template"),
                                     stop_ids=_stop_ids(side, specials, names, size))
    except ValueError as e:
        raise fail(str(e)) from None


def _from_vocab_and_merges(vocab_path: Path, merges_path: Path, side: dict[str, Any],
                           roles: dict[str, str]) -> ByteLevelBPETokenizer:
    """GPT-2's own files: vocab.json (byte-level string -> id) and merges.txt ("a b" per line)."""
    source = str(vocab_path)

    def fail(what: str) -> TinyLMError:
        return TinyLMError(f"{source}: {what}; tinylm reads GPT-2-style vocab.json + merges.txt")

    vocab = hf_vocab(read_json_object(vocab_path), source, "vocab.json")
    try:
        lines = merges_path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise TinyLMError(f"cannot read {merges_path}: {e}") from None
    merges = hf_merges([line for line in lines if line and not line.startswith("#version")], vocab, str(merges_path))
    # tokenizer_config.json's "added_tokens_decoder" is {"id": {"content": ..., "special": ...}}: the same entries
    # as a tokenizer.json's added_tokens, checked the same way
    decoder = side.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict):
        raise TinyLMError(f"{vocab_path.parent / SIDE_FILES[0]}: added_tokens_decoder is not an object of id -> token")
    added = [{**info, "id": int(i) if i.isascii() and i.isdigit() else i} if isinstance(info, dict) else info
             for i, info in decoder.items()]
    specials = hf_added_tokens(added, str(vocab_path.parent / SIDE_FILES[0]))[0]
    for name in side.get("additional_special_tokens") or []:
        name = _content(name)
        if name in vocab:
            specials[name] = vocab[name]
    added_file = vocab_path.parent / "added_tokens.json"
    words = {}
    if added_file.is_file():
        words = {k: v for k, v in hf_vocab(read_json_object(added_file), str(added_file), "added_tokens.json").items()
                 if k not in specials}
    size = checked_vocab_size([*vocab.items(), *specials.items(), *words.items()], source=source)
    return _byte_level(vocab, merges, size, "gpt2", specials, words, side, roles, fail,
                       add_prefix_space=bool(side.get("add_prefix_space", False)), normalizer=None,
                       ignore_merges=False, add_bos=bool(side.get("add_bos_token", False)))


# ----- SentencePiece-style BPE ------------------------------------------------------------------------


def _sentencepiece(data: dict[str, Any], vocab: dict[str, int], merges: list[tuple[str, str]], size: int,
                   specials: dict[str, int], words: dict[str, int], side: dict[str, Any], roles: dict[str, str],
                   fail, *, add_bos: bool) -> SentencePieceBPETokenizer:
    prefix, split = _sentencepiece_prefix(data.get("normalizer"), data.get("pre_tokenizer"), fail)
    names, specials = _resolve_roles(specials, vocab, side, roles, fail)
    pieces: list[str | None] = [None] * size
    for text, i in vocab.items():
        if specials.get(text) != i:
            pieces[i] = text
    for text, i in words.items():
        pieces[i] = text
    pairs = [(vocab[a], vocab[b]) for a, b in merges]
    model = data["model"]
    try:
        return SentencePieceBPETokenizer(
            pieces, pairs, specials=specials, roles=names, unk=model.get("unk_token"),
            byte_fallback=bool(model.get("byte_fallback")), fuse_unk=bool(model.get("fuse_unk")), prefix=prefix,
            split=split, strip_leading_space=_strips_leading_space(data.get("decoder")), vocab_size=size,
            add_bos=add_bos, added_words=words, chat_template=side.get("chat_template"),
            stop_ids=_stop_ids(side, specials, names, size))
    except ValueError as e:
        raise fail(str(e)) from None


def _sentencepiece_prefix(normalizer: Any, pre: Any, fail) -> tuple[str, bool]:
    """Where the "▁" goes in front, and whether the text is split before each "▁"."""
    steps = normalizer.get("normalizers", []) if isinstance(normalizer, dict) and \
        normalizer.get("type") == "Sequence" else [normalizer] if normalizer else []
    kinds = [s.get("type") for s in steps]
    replaces = any(s.get("type") == "Replace" and isinstance(s.get("pattern"), dict)
                   and s["pattern"].get("String") == " " and s.get("content") == SPACE_MARK for s in steps)
    prepends = any(s.get("type") == "Prepend" and s.get("prepend") == SPACE_MARK for s in steps)
    if steps and (set(kinds) - {"Replace", "Prepend"} or not replaces):
        raise fail(f"its normalizer is {' + '.join(map(str, kinds))}; tinylm reads SentencePiece-style files whose "
                   "normalizer replaces spaces with '▁' (and prepends one), or that use the Metaspace pre-tokenizer")
    if pre:
        if pre.get("type") != "Metaspace" or pre.get("replacement", SPACE_MARK) != SPACE_MARK:
            raise fail(f"its pre_tokenizer is {pre.get('type')}, not Metaspace('▁')")
        scheme = pre.get("prepend_scheme") or ("always" if pre.get("add_prefix_space", True) else "never")
        return (("prepend" if prepends else scheme), bool(pre.get("split", False)))
    if not replaces:
        raise fail("it neither replaces spaces with '▁' nor has a Metaspace pre-tokenizer, so it is not "
                   "SentencePiece-style; and it has no ByteLevel step, so it is not byte-level")
    return ("prepend" if prepends else "never"), False


def _strips_leading_space(decoder: Any) -> bool:
    steps = decoder.get("decoders", []) if isinstance(decoder, dict) and decoder.get("type") == "Sequence" else \
        [decoder] if decoder else []
    for s in steps:
        if s.get("type") == "Strip" and s.get("content") == " " and isinstance(s.get("start"), int) and s["start"] >= 1:
            return True
        if s.get("type") == "Metaspace":
            return (s.get("prepend_scheme") or ("always" if s.get("add_prefix_space", True) else "never")) != "never"
    return False


__all__ = ["read_hf_tokenizer", "tokenizer_from_any_hf_json"]
