"""Import a local Hugging Face `transformers` checkpoint (GPT-2, Llama, Qwen3, Qwen2, Mistral, Phi-3, Gemma 2 or
Gemma 3 text, or the Mixture-of-Experts Mixtral and Qwen2-MoE) into tinylm.

`import_hf` reads config.json (`config_from_hf`), model.safetensors or its shards (`read_hf_weights`;
never pickle files) and the tokenizer files into a `GPT`, a tokenizer and a `GPTConfig`, with the
rules of `tinylm.export.weights`; `import_hf_into_run` writes them as a tinylm run directory that
`sample`, `eval`, `serve` and ``train --init-from`` read (what `tinylm import` does).
Variants tinylm does not compute are refused in one line naming the key; docs/export.md has more.

Usage::

    model, tokenizer, config = import_hf("path/to/hf-checkpoint")
    import_hf_into_run("path/to/hf-checkpoint", "runs/imported")
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from tinylm.atomic import atomic_write_text
from tinylm.config import Config, GPTConfig, dump_toml
from tinylm.errors import TinyLMError
from tinylm.export.hf import CONFIG_FILE, TOKENIZER_FILE, WEIGHTS_FILE, WEIGHTS_INDEX_FILE
from tinylm.export.hf_families import (HF_CLASSES, MODEL_TYPES, MOE_SHAPED, Architecture, default_rule,
                                      llama_family_config, refusal, required)
from tinylm.export.hf_moe import moe_family_config, split_fused_experts, take_constant_tensors
from tinylm.export.weights import architecture_for, convert_to_ours, hf_rules
from tinylm.jsonfile import read_json_object
from tinylm.lock import folder_lock
from tinylm.model.gpt import GPT
from tinylm.run import CONFIG_FILE as RUN_CONFIG_FILE
from tinylm.run import (
    check_new_run_folder,
    checkpoint_path,
    clear_run_folder,
    copy_checkpoint,
    save_checkpoint,
    write_run_info,
)
from tinylm.run import TOKENIZER_FILE as RUN_TOKENIZER_FILE
from tinylm.tokenizers.base import Tokenizer
from tinylm.tokenizers.hf_files import read_hf_tokenizer

# GELU activations of GPT-2 configs that are the tanh form we compute (the erf form "gelu" is not)
_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


def _read_json(path: Path, what: str) -> dict[str, Any]:
    return read_json_object(path, missing="{path} is missing: a Hugging Face checkpoint folder has {what}", what=what)


def _arch_of(hf: Mapping[str, Any], source: str) -> Architecture:
    model_type = hf.get("model_type")
    classes = hf.get("architectures") or []
    for arch, cls in HF_CLASSES.items():
        if model_type == MODEL_TYPES.get(arch, arch) or cls in classes:
            return arch
    *others, last = HF_CLASSES.values()
    raise TinyLMError(
        f"{source} describes a {model_type or '?'} model ({', '.join(classes) or 'no architectures listed'}); "
        f"tinylm imports {', '.join(others)} and {last} checkpoints only"
    )


def config_from_hf(hf: Mapping[str, Any], source: str = CONFIG_FILE) -> tuple[GPTConfig, Architecture]:
    """The `GPTConfig` of a GPT-2, Llama, Qwen3, Qwen2, Mistral, Phi-3, Gemma 2 / 3, Mixtral or Qwen2-MoE config.json,
    and which it is; variants tinylm does not compute are errors (one line naming the key), and so are values that
    are not numbers where a size or rate is read (a string, a list, infinity)."""
    try:
        return _config_from_hf(hf, source)
    except (TypeError, ValueError, OverflowError) as e:  # int("twelve"), int(float("inf")), float([1])
        raise TinyLMError(f"{source} holds a value that is not a number where tinylm reads a size or rate ({e}); "
                          "fix the file, or import the model it came with") from None


def _config_from_hf(hf: Mapping[str, Any], source: str) -> tuple[GPTConfig, Architecture]:
    arch = _arch_of(hf, source)
    if arch in MOE_SHAPED:
        return moe_family_config(hf, arch, source), arch
    if arch != "gpt2":
        return llama_family_config(hf, arch, source), arch

    def need(key: str, *alternatives: str) -> Any:
        return required(hf, source, arch, key, *alternatives)

    tie = bool(hf.get("tie_word_embeddings", True))
    act = hf.get("activation_function", "gelu_new")
    if act not in _TANH_GELUS:
        raise refusal(source, arch, f"activation_function is {act!r}, and tinylm's GELU is the tanh form "
                                    f"({', '.join(_TANH_GELUS)})")
    for key, ok in (("scale_attn_by_inverse_layer_idx", False), ("add_cross_attention", False),
                    ("scale_attn_weights", True)):
        if bool(hf.get(key, ok)) != ok:
            raise refusal(source, arch, f"{key} is {hf.get(key)}")
    d_model = int(need("n_embd", "hidden_size"))
    d_ff = hf.get("n_inner")
    config = GPTConfig(
        vocab_size=int(need("vocab_size")), block_size=int(need("n_positions", "n_ctx")),
        n_layer=int(need("n_layer")), d_model=d_model, n_head=int(need("n_head")), mlp="gelu",
        d_ff=None if d_ff is None else default_rule(int(d_ff), d_model, "gelu"),
        norm="layernorm", norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)), positions="learned",
        bias=True, tie_embeddings=tie, dropout=float(hf.get("resid_pdrop", 0.0)),
        init_std=float(hf.get("initializer_range", 0.02)),
    )
    return config, arch


def read_hf_weights(src_dir: str | os.PathLike) -> dict[str, Tensor]:
    """Every tensor of a checkpoint folder: model.safetensors, or the shards its index lists. No pickle files."""
    src_dir = Path(src_dir)
    index = src_dir / WEIGHTS_INDEX_FILE
    if (src_dir / WEIGHTS_FILE).is_file():
        files = [src_dir / WEIGHTS_FILE]
    elif index.is_file():
        weight_map = _read_json(index, "a shard index").get("weight_map")
        if not isinstance(weight_map, dict):
            raise TinyLMError(f"{index} has no weight_map")
        files = [src_dir / name for name in sorted(set(weight_map.values()))]
    else:
        pickles = sorted(p.name for p in src_dir.glob("*.bin")) + sorted(p.name for p in src_dir.glob("*.pt"))
        hint = (f" It has {', '.join(pickles[:3])}: pickle files, which can run code when loaded and which tinylm "
                "does not open; convert them to safetensors first (in transformers: from_pretrained, then "
                "save_pretrained(..., safe_serialization=True))") if pickles else ""
        raise TinyLMError(f"{src_dir} has no {WEIGHTS_FILE} (or {WEIGHTS_INDEX_FILE} with shards).{hint}")
    tensors: dict[str, Tensor] = {}
    for path in files:
        if not path.is_file():
            raise TinyLMError(f"{path} is missing (listed in {WEIGHTS_INDEX_FILE})")
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    tensors[name] = f.get_tensor(name)
        except Exception as e:  # safetensors has its own error types for a damaged file
            raise TinyLMError(f"{path} is not a readable safetensors file ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:120]})") from None
    return tensors


def _normalize_names(tensors: dict[str, Tensor], arch: Architecture, config: GPTConfig) -> dict[str, Tensor]:
    """Their names as `hf_rules` spells them: drop non-weight buffers, add GPT-2's optional prefix, drop a tied head."""
    out: dict[str, Tensor] = {}
    for name, t in tensors.items():
        # GPT-2's causal-mask buffers and Llama's cached RoPE frequencies are not weights
        if name.endswith((".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")):
            continue
        if arch == "gpt2" and not name.startswith(("transformer.", "lm_head.")):
            name = "transformer." + name  # OpenAI's own upload names the GPT2Model's tensors without it
        out[name] = t
    if config.tie_embeddings:
        out.pop("lm_head.weight", None)  # some files store the tied head anyway; it is E
    if arch in MOE_SHAPED:
        out = split_fused_experts(out, arch)
    return out


def import_hf(src_dir: str | os.PathLike, *,
              roles: dict[str, str] | None = None) -> tuple[GPT, Tokenizer, GPTConfig]:
    """A local `transformers` checkpoint of one of the architectures `config_from_hf` reads as a tinylm model (eval mode,
    float32), tokenizer and config.

    ``src_dir`` holds config.json, model.safetensors (or sharded safetensors with their index) and
    tokenizer.json. Unsupported architectures and variants, missing files, and tokenizers that are
    not in tinylm's id layout are `TinyLMError`s that say which.
    """
    src_dir = Path(src_dir)
    if not src_dir.is_dir():
        raise TinyLMError(f"{src_dir} is not a folder; give the folder that holds config.json and model.safetensors")
    config, arch = config_from_hf(_read_json(src_dir / CONFIG_FILE, "config.json"), str(src_dir / CONFIG_FILE))
    if not (src_dir / TOKENIZER_FILE).is_file() and not (src_dir / "vocab.json").is_file():
        raise TinyLMError(f"{src_dir} has no {TOKENIZER_FILE} (nor vocab.json + merges.txt): tinylm needs the "
                          "tokenizer the model was trained with")
    tensors = _normalize_names(read_hf_weights(src_dir), arch, config)
    if arch in MOE_SHAPED:
        tensors = take_constant_tensors(tensors, config, arch, str(src_dir))
    try:
        tokenizer = read_hf_tokenizer(src_dir, roles=roles)
    except TinyLMError as e:
        raise TinyLMError(f"the weights are readable, but the tokenizer is not: {e}") from None
    if tokenizer.vocab_size > config.vocab_size:
        raise TinyLMError(f"{src_dir}: the tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is "
                          f"{config.vocab_size}; they are not a pair")

    with torch.random.fork_rng(devices=[]):  # the random init is overwritten at once; leave the caller's RNG alone
        model = GPT(config)
    expected = model.state_dict()
    ours = convert_to_ours(tensors, hf_rules(config, arch), expected, str(src_dir))
    if config.tie_embeddings:
        ours["lm_head.weight"] = ours["E.weight"]
    # an MoE layer's selection bias (moe_balance "bias" only, which neither architecture has): zeros, as made
    ours |= {name: t for name, t in expected.items() if name not in ours and name.endswith(".mlp.bias")}
    model.load_state_dict(ours, strict=True)
    return model.eval(), tokenizer, config



def import_hf_into_run(src_dir: str | os.PathLike, run_dir: str | os.PathLike, *, force: bool = False,
                       roles: dict[str, str] | None = None) -> Path:
    """Import a `transformers` checkpoint (see `import_hf`) as a tinylm run directory at ``run_dir``.

    The run has config.toml (the imported [model] table and default [train] settings),
    tokenizer.json, run.json (status "imported", where it came from) and one checkpoint at step 0,
    saved as both "latest" and "best", so `load_run`, `tinylm sample`, `serve` and
    ``tinylm train --init-from RUN_DIR`` read it like a trained run. An existing non-empty folder
    is replaced only with ``force``, and only if it is a tinylm run.
    """
    src_dir, run_dir = Path(src_dir), Path(run_dir)
    check_new_run_folder(run_dir, force, resumable=False, folder_arg="run_dir")  # before the lock makes the folder
    with folder_lock(run_dir, "import"):
        check_new_run_folder(run_dir, force, resumable=False, folder_arg="run_dir")  # again: another may have written it
        # everything is read before anything is deleted
        model, tokenizer, model_config = import_hf(src_dir, roles=roles)
        clear_run_folder(run_dir)
        config = Config(model=model_config)
        run_dir.mkdir(parents=True, exist_ok=True)
        source = {"format": "huggingface", "path": str(src_dir.resolve()),
                  "architecture": HF_CLASSES[architecture_for(model_config)]}
        # run.json first: a folder with tinylm's run.json is a run, and only a run is ever replaced
        write_run_info(run_dir, {"status": "importing", "step": 0, "imported_from": source})
        atomic_write_text(run_dir / RUN_CONFIG_FILE, dump_toml(config.to_dict()))
        tokenizer.save(run_dir / RUN_TOKENIZER_FILE)
        state = {"step": 0, "tokens": 0, "elapsed": 0.0, "best_val_loss": None, "imported_from": source}
        latest = checkpoint_path(run_dir, "latest")
        save_checkpoint(latest, model_state=model.state_dict(), optimizer_state=None, rng_state={}, state=state,
                        config=config, tokenizer=tokenizer)
        copy_checkpoint(latest, checkpoint_path(run_dir, "best"))
        write_run_info(run_dir, {"status": "imported", "step": 0, "imported_from": source})
    return run_dir



__all__ = ["config_from_hf", "read_hf_weights", "import_hf", "import_hf_into_run"]
