"""Export a tinylm model as a Hugging Face `transformers` checkpoint folder: GPT-2, Llama, Qwen3, Qwen2, Mistral, Phi-3,
Gemma 2 or 3, or, for a Mixture of Experts, Mixtral or Qwen2-MoE (`tinylm.export.hf_moe`).

`export_hf` writes config.json (`hf_config`), model.safetensors (the tensors `hf_rules` names, from
`tinylm.export.weights`) and, with a tokenizer, tokenizer.json, tokenizer_config.json,
special_tokens_map.json and generation_config.json, so that ``AutoModelForCausalLM`` and
``AutoTokenizer`` load the folder and compute what tinylm computes. `tinylm.export.hf_import`
reads such a folder back. docs/export.md explains the mapping.

Usage::

    export_hf(run.model, run.tokenizer, "out/hf")       # then AutoModelForCausalLM.from_pretrained("out/hf")
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from tinylm.atomic import atomic_write_text, disk_writes
from tinylm.config import GPTConfig
from tinylm.errors import TinyLMError
from tinylm.export.hf_families import HF_CLASSES, MOE_SHAPED, llama_family_fields
from tinylm.export.hf_moe import constant_tensors, moe_family_fields
from tinylm.export.weights import architecture_for, convert_to_theirs, hf_rules
from tinylm.model.gpt import GPT
from tinylm.run import save_safetensors, text_start_ids
from tinylm.tokenizers.base import Tokenizer, default_stop_ids, generation_excluded
from tinylm.tokenizers.bpe import BPETokenizer
from tinylm.tokenizers.formats import to_hf_tokenizer_json
from tinylm.tokenizers.imported import ImportedTokenizer

# what `from_pretrained` reads; `export_hf` writes all of them
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"  # a sharded checkpoint's map: tensor -> shard file
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_FILE = "special_tokens_map.json"
GENERATION_CONFIG_FILE = "generation_config.json"
EXPORTED_FILES = (CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, SPECIAL_TOKENS_FILE,
                  GENERATION_CONFIG_FILE)


def hf_config(config: GPTConfig, tokenizer: Tokenizer | None = None, dtype: torch.dtype = torch.float32, *,
              start_ids: Sequence[int] | None = None) -> dict[str, Any]:
    """config.json for ``config``: the `transformers` GPT2Config, LlamaConfig, Qwen3Config, Qwen2Config or
    MistralConfig fields that say the same. Its bos_token_id is the token every text starts with
    (`declared_start`)."""
    arch = architecture_for(config)
    specials: dict[str, Any] = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    if tokenizer is not None:
        specials = {"bos_token_id": _bos_name_and_id(tokenizer, declared_start(tokenizer, start_ids))[1],
                    "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}
    dtype_name = str(dtype).removeprefix("torch.")
    common = {"architectures": [HF_CLASSES[arch]], "model_type": arch, "vocab_size": config.vocab_size,
              "initializer_range": config.init_std, "tie_word_embeddings": config.tie_embeddings,
              "use_cache": True, **specials,
              # `dtype` is what transformers 5 reads, `torch_dtype` what 4.x reads
              "dtype": dtype_name, "torch_dtype": dtype_name}
    if arch == "gpt2":
        return {**common,
                "n_positions": config.block_size,
                "n_ctx": config.block_size,  # the old name of n_positions; llama.cpp's converter reads it
                "n_embd": config.d_model, "n_layer": config.n_layer, "n_head": config.n_head,
                "n_inner": config.hidden_dim,
                "activation_function": "gelu_new",  # GELU's tanh form, which our MLP computes
                "layer_norm_epsilon": config.norm_eps,
                "resid_pdrop": config.dropout, "embd_pdrop": config.dropout, "attn_pdrop": config.dropout,
                "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
                "reorder_and_upcast_attn": False}
    if arch in MOE_SHAPED:
        return {**common, **moe_family_fields(config, arch)}
    return {**common, **llama_family_fields(config, arch)}


def declared_start(tokenizer: Tokenizer, start_ids: Sequence[int] | None) -> list[int]:
    """The ids every text starts with in the export: ``start_ids`` (a run's `tinylm.run.Run.start_ids`), or by
    default what a packed run of ``tokenizer`` starts with (EOS, the separator, for tinylm's own tokenizers;
    an imported one's own BOS, or nothing). At most one token: the BOS that transformers and llama.cpp add."""
    start = text_start_ids(tokenizer) if start_ids is None else [int(i) for i in start_ids]
    if len(start) > 1 or any(not tokenizer.is_special(i) for i in start):
        raise TinyLMError(f"the export can declare one special start token before every text, not {start}")
    return start


def _bos_name_and_id(tokenizer: Tokenizer, start: Sequence[int]) -> tuple[str, int]:
    """The BOS the export declares: the start token where texts have one, else the tokenizer's own."""
    if not start:
        return tokenizer.roles["bos"], tokenizer.bos_id
    names = {i: name for name, i in tokenizer.special_tokens.items()}
    return names[start[0]], start[0]


def start_post_processor(tokenizer: Tokenizer, start: Sequence[int]) -> dict[str, Any] | None:
    """tokenizer.json's post-processor that puts ``start`` (one special token) before every text; None: nothing."""
    if not start:
        return None
    name, i = _bos_name_and_id(tokenizer, start)
    return {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": name, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": name, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": name, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {name: {"id": name, "ids": [i], "tokens": [name]}}}


def _tokenizer_files(tokenizer: Tokenizer, block_size: int, model_vocab: int,
                     start: Sequence[int] = ()) -> dict[str, dict[str, Any]]:
    """tokenizer_config.json, special_tokens_map.json and generation_config.json for ``tokenizer``, with a model
    of ``model_vocab`` outputs (more than the tokenizer's ids when its output layer is padded), whose texts
    start with ``start`` (`declared_start`)."""
    eos, pad = (tokenizer.roles[role] for role in ("eos", "pad"))
    bos, bos_id = _bos_name_and_id(tokenizer, start)
    reserved = [name for name in tokenizer.special_tokens if name not in (bos, eos, pad)]
    added_words = getattr(tokenizer, "added_words", {})
    added = {
        str(i): {"content": name, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                 "special": name in tokenizer.special_tokens}
        for name, i in sorted({**tokenizer.special_tokens, **added_words}.items(), key=lambda kv: kv[1])
    }
    unk = getattr(tokenizer, "unk", None)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",  # reads tokenizer.json alone; no vocab.json/merges.txt
        "bos_token": bos, "eos_token": eos, "pad_token": pad, "unk_token": unk,
        "additional_special_tokens": reserved,
        "added_tokens_decoder": added,
        "model_max_length": block_size,
        # the token tinylm puts before a prompt (run.start_ids: a tinylm model's separator, an imported
        # Llama's "<s>"), named as the BOS the tokenizer adds: tokenizer.json's post-processor adds it (what
        # transformers 5 follows), and older transformers read add_bos_token
        "add_bos_token": bool(start), "add_eos_token": False,
        # transformers' old default strips spaces before punctuation when decoding: not our text
        "clean_up_tokenization_spaces": False,
    }
    template = getattr(tokenizer, "chat_template", None)
    if template is not None:
        tokenizer_config["chat_template"] = template
    special_tokens_map = {"bos_token": bos, "eos_token": eos, "pad_token": pad, "additional_special_tokens": reserved}
    if unk is not None:
        special_tokens_map["unk_token"] = unk
    # suppress_tokens: transformers' generate then never draws what tinylm's samplers never draw (PAD, BOS, ...)
    # eos_token_id as a list when tinylm ends a generation at other tokens too (`default_stop_ids`: Llama 3's
    # <|eot_id|>, the <|im_end|> a fine-tuned tinylm model closes its turn with), so a reply ends where tinylm's does
    stop = [tokenizer.eos_id, *sorted(default_stop_ids(tokenizer) - {tokenizer.eos_id})]
    generation_config = {"bos_token_id": bos_id, "eos_token_id": stop if len(stop) > 1 else stop[0],
                         "pad_token_id": tokenizer.pad_id,
                         "suppress_tokens": generation_excluded(tokenizer) + list(range(tokenizer.vocab_size,
                                                                                         model_vocab))}
    return {TOKENIZER_CONFIG_FILE: tokenizer_config, SPECIAL_TOKENS_FILE: special_tokens_map,
            GENERATION_CONFIG_FILE: generation_config}


def _check_tokenizer(tokenizer: Tokenizer | None, config: GPTConfig, what: str) -> Tokenizer | None:
    if tokenizer is None:
        return None
    if not isinstance(tokenizer, (BPETokenizer, ImportedTokenizer)):
        raise TinyLMError(
            f"a {tokenizer.kind} tokenizer cannot be exported for {what}: tokenizer.json and GGUF hold byte-level "
            "BPE only. Train the model with a BPE tokenizer (--tokenizer-kind bpe), or export the weights alone "
            "(tokenizer=None in Python)"
        )
    if tokenizer.vocab_size > config.vocab_size:
        raise TinyLMError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only {config.vocab_size} "
                          "rows of embeddings: they are not a pair")
    return tokenizer


def _check_out_dir(out_dir: Path, names: Sequence[str], overwrite: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise TinyLMError(f"{out_dir} exists and is not a folder; choose another --out")
    present = [name for name in names if (out_dir / name).exists()]
    if present and not overwrite:
        raise TinyLMError(f"{out_dir} already holds {', '.join(present)}; choose another --out or overwrite "
                          "explicitly (--force)")


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def export_hf(model: GPT, tokenizer: Tokenizer | None, out_dir: str | os.PathLike, *, overwrite: bool = False,
              start_ids: Sequence[int] | None = None) -> Path:
    """Write ``model`` (and ``tokenizer``) as a `transformers` checkpoint folder; returns the folder.

    The folder loads with ``AutoModelForCausalLM.from_pretrained(out_dir)`` as GPT2LMHeadModel,
    LlamaForCausalLM or Qwen3ForCausalLM (`architecture_for` decides, or refuses) and with
    ``AutoTokenizer`` when a tokenizer is given (it must be byte-level BPE). ``tokenizer=None``
    writes the weights and config.json alone. Existing files are replaced only with ``overwrite``.
    ``start_ids`` is what the model's texts start with (a run's `tinylm.run.Run.start_ids`; by default
    `declared_start`'s): the tokenizer puts it before every text, so ``AutoTokenizer(prompt)`` gives the
    ids `tinylm sample` reads.
    """
    config = model.config
    arch = architecture_for(config)
    tok = _check_tokenizer(tokenizer, config, "transformers")
    start = declared_start(tok, start_ids) if tok is not None else []
    out_dir = Path(out_dir)
    names = EXPORTED_FILES if tok is not None else (CONFIG_FILE, WEIGHTS_FILE)
    _check_out_dir(out_dir, names, overwrite)

    state = model.state_dict()
    tensors = convert_to_theirs(state, hf_rules(config, arch))
    if arch in MOE_SHAPED:  # Qwen2-MoE's shared-expert gates, which tinylm has no parameter for
        tensors |= {name: t.to(state["E.weight"].dtype) for name, t in constant_tensors(config, arch).items()}
    # The files are written whole into a hidden folder inside out_dir and only then renamed into place
    # (renames in one file system need no space), so a full or read-only disk leaves no mix of new and
    # old files there, nor a weights file without its config.json: one line says so.
    made = not out_dir.exists()
    intact = "nothing was replaced in it" if not made else "nothing half-written is left"
    with disk_writes(f"the export to {out_dir}", intact, retry="export again"):
        out_dir.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".export.", suffix=".tmp", dir=out_dir))
        try:
            # {"format": "pt"} is what transformers' own save_pretrained writes, and what it checks on load
            save_safetensors(tensors, staging / WEIGHTS_FILE, metadata={"format": "pt"})
            _write_json(staging / CONFIG_FILE, hf_config(config, tok, state["E.weight"].dtype, start_ids=start))
            if tok is not None:
                tokenizer_json = to_hf_tokenizer_json(tok)
                tokenizer_json["post_processor"] = start_post_processor(tok, start)
                _write_json(staging / TOKENIZER_FILE, tokenizer_json)
                for name, data in _tokenizer_files(tok, config.block_size, config.vocab_size, start).items():
                    _write_json(staging / name, data)
            for name in names:
                os.replace(staging / name, out_dir / name)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            if made:
                shutil.rmtree(out_dir, ignore_errors=True)  # made here, and nothing of it is finished
            raise
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir



__all__ = [
    "CONFIG_FILE", "WEIGHTS_FILE", "WEIGHTS_INDEX_FILE", "TOKENIZER_FILE", "EXPORTED_FILES",
    "hf_config", "export_hf",
]
