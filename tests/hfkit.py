"""Tokenizers made the way other people make them: trained by Hugging Face `tokenizers`, saved by `transformers`.

Each builder trains a small BPE on `TRAINING_TEXT` with the `tokenizers` library, lays it out the way
one model family does, wraps it in `transformers.PreTrainedTokenizerFast` (with a chat template where
the family has one) and writes the folder with ``save_pretrained``. None of it goes through tinylm:
these folders are what a user brings.

- ``gpt2``: ByteLevel pre-tokenizer (GPT-2's regex), the one special "<|endoftext|>" at id 0, the
  256 bytes in the trainer's order (not byte order); ``gpt2-prefix`` adds ``add_prefix_space``.
- ``smollm``: SmolLM's: a Digits pre-tokenizer (each digit alone) before GPT-2's ByteLevel, three ChatML
  specials at ids 0..2.
- ``llama3``: Split(Llama 3's regex) + ByteLevel, ``ignore_merges``, specials after the merges,
  "<|begin_of_text|>" put in front by a TemplateProcessing post-processor, Llama 3's chat template.
- ``qwen2``: an NFC normalizer, Qwen2's regex, no BOS, ChatML markers and template.
- ``sentencepiece``: Llama 2 / TinyLlama / Mistral: "▁" for spaces (Prepend + Replace normalizers),
  "<unk>", "<s>", "</s>" at 0..2, the 256 "<0xNN>" byte tokens at 3..258, byte fallback, a Strip
  decoder; ``sentencepiece-metaspace`` writes the same with the Metaspace pre-tokenizer (newer files).
- ``gemma``: Gemma's SentencePiece-style BPE: "<pad>", "<eos>", "<bos>", "<unk>" at 0..3, its turn markers,
  the 256 byte tokens, spaces replaced by "▁" with none put in front, byte fallback, "<bos>" put in front by
  the post-processor, Gemma's chat template.
"""

from __future__ import annotations

import inspect
import json
import textwrap
from pathlib import Path

# Training text: Python source (always on disk) plus the characters the tests probe with.
TRAINING_TEXT = [inspect.getsource(textwrap), inspect.getsource(json.decoder), inspect.getsource(json.encoder),
                 "Grüße aus Köln — naïve café, 東京と大阪、中文文本。 😀🎉 👨‍👩‍👧 привет мир\n" * 3]

# Text for the parity checks: everything the training text has, and what it has not (control
# characters, other scripts, long whitespace, lone combining marks, NFC-sensitive sequences).
PROBE_TEXT = (
    "Hello,  world!\r\n\tIt's 2024... naïve e\u0301 café 中文 😀 $x_1+y=3\n\n"
    "   leading spaces and trailing   \n" + " " * 40 + "x\n" + "\t" * 9 + "tabs\n"
    "\x00\x01\x07\x1b[0m control \x7f\u0085\u00a0nbsp\u200b zero-width\n"
    "한국어 텍스트, ελληνικά, עברית, العربية, हिन्दी, ไทย\n"
    "🏳️‍🌈 👍🏽 🤖 emoji runs 😀😀😀😀\n"
    "numbers 1234567 3.14159 1,000,000 ½ ² ٣\n"
    "don't I'LL we've they're 'quoted' \"double\"\n"
    "Å (A + ring) vs Å (precomposed), ﬁ ligature, ｆｕｌｌｗｉｄｔｈ\n"
)

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA2_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + message['content'].strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'].strip() + ' ' + eos_token }}"
    "{% endif %}{% endfor %}"
)

GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' + "
    "message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)

STYLES = ("gpt2", "gpt2-prefix", "smollm", "llama3", "qwen2", "sentencepiece", "sentencepiece-metaspace", "gemma")


def _byte_level_bpe(vocab_size: int, specials: list[str], pattern: str | None, *, prefix_space: bool = False,
                    ignore_merges: bool = False, nfc: bool = False, digits: bool = False, texts=None):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    if nfc:
        tok.normalizer = normalizers.NFC()
    if digits:  # SmolLM's: every digit on its own, then GPT-2's regex
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=prefix_space)])
    elif pattern is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=prefix_space)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=prefix_space, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts or TRAINING_TEXT, trainer)
    return tok


def _sentencepiece_bpe(vocab_size: int, metaspace: bool, texts=None, gemma: bool = False):
    """Llama 2's layout (or Gemma's), built from a `tokenizers` BPE trained on "▁"-words."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    # a small alphabet: rarer characters (CJK, emoji) must take the byte fallback
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False, limit_alphabet=120)
    trained.train_from_iterator(texts or TRAINING_TEXT, trainer)
    model = json.loads(trained.to_str())["model"]
    specials = (["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"] if gemma
                else ["<unk>", "<s>", "</s>"])
    vocab = {name: i for i, name in enumerate(specials)}
    vocab.update({f"<0x{b:02X}>": len(specials) + b for b in range(256)})
    for piece, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(piece, len(vocab))
    added = [{"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True} for i, c in enumerate(specials)]
    bos, unk = ("<bos>", "<unk>") if gemma else ("<s>", "<unk>")
    if gemma:  # spaces become "▁", and none is put in front of the text
        normalizer = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}
        pre = None
    elif metaspace:
        normalizer = None
        pre = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": False}
    else:
        normalizer = {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "\u2581"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]}
        pre = None
    decoder = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, {"type": "ByteFallback"},
        {"type": "Fuse"}] + ([] if gemma else [{"type": "Strip", "content": " ", "start": 1, "stop": 0}])}
    data = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": normalizer,
        "pre_tokenizer": pre, "decoder": decoder,
        "post_processor": {"type": "TemplateProcessing", "single": [
            {"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [vocab[bos]], "tokens": [bos]}}},
        "model": {"type": "BPE", "dropout": None, "unk_token": unk, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": model["merges"]},
    }
    return Tokenizer.from_str(json.dumps(data))


def build(style: str, folder: Path, vocab_size: int = 700, texts: list[str] | None = None) -> Path:
    """Train a tokenizer in ``style`` (one of `STYLES`) on ``texts`` (default `TRAINING_TEXT`) and save it
    with transformers into ``folder``."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    if style in ("gpt2", "gpt2-prefix"):
        tok = _byte_level_bpe(vocab_size, ["<|endoftext|>"], None, prefix_space=style == "gpt2-prefix", texts=texts)
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                       unk_token="<|endoftext|>", clean_up_tokenization_spaces=False)
    elif style == "smollm":
        tok = _byte_level_bpe(vocab_size, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, digits=True, texts=texts)
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                       pad_token="<|im_end|>", chat_template=CHATML_TEMPLATE,
                                       clean_up_tokenization_spaces=False)
    elif style == "llama3":
        tok = _byte_level_bpe(vocab_size, [], LLAMA3_PATTERN, ignore_merges=True, texts=texts)
        tok.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                                "<|eot_id|>"])
        bos = tok.token_to_id("<|begin_of_text|>")
        tok.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
            special_tokens=[("<|begin_of_text|>", bos)])
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>",
                                       eos_token="<|end_of_text|>", chat_template=LLAMA3_TEMPLATE,
                                       clean_up_tokenization_spaces=False)
    elif style == "qwen2":
        tok = _byte_level_bpe(vocab_size, [], QWEN2_PATTERN, nfc=True, texts=texts)
        tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                       chat_template=CHATML_TEMPLATE, clean_up_tokenization_spaces=False)
    elif style in ("sentencepiece", "sentencepiece-metaspace"):
        tok = _sentencepiece_bpe(vocab_size, metaspace=style.endswith("metaspace"), texts=texts)
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                       chat_template=LLAMA2_TEMPLATE, clean_up_tokenization_spaces=False)
    elif style == "gemma":
        tok = _sentencepiece_bpe(vocab_size, metaspace=False, texts=texts, gemma=True)
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
                                       pad_token="<pad>", chat_template=GEMMA_TEMPLATE,
                                       clean_up_tokenization_spaces=False)
    else:
        raise ValueError(f"unknown style {style!r}")
    fast.save_pretrained(str(folder))
    return folder
