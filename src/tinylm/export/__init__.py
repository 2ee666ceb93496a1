"""Leaving tinylm and coming in: Hugging Face `transformers` checkpoints and GGUF files for llama.cpp.

- `export_hf` (`tinylm.export.hf`) / `import_hf` (`tinylm.export.hf_import`): a model and its tokenizer
  as a GPT-2, Llama, Qwen3, Qwen2 or Mistral checkpoint folder (config.json, model.safetensors,
  tokenizer.json, ...) and back (`tinylm.export.hf_families` maps the Llama-shaped ones, RoPE scaling
  and sliding windows included); `import_hf_into_run` makes a tinylm run directory of one (what
  `tinylm import` does).
- `export_gguf` (`tinylm.export.gguf`): one GGUF file, weights and tokenizer, for llama.cpp.
- `export_peft` / `import_peft_into_run` (`tinylm.export.peft`): a LoRA run's adapter as a PEFT adapter folder
  (adapter_config.json, adapter_model.safetensors) for ``peft.PeftModel``, and a PEFT adapter on its base as a
  LoRA run.
- `export_run`: any of them, from a trained run directory (what `tinylm export` does).

Only configurations that GPT-2, Llama or one of its variants (Qwen3: QK-norm, Qwen2: q, k, v biases,
Mistral: a sliding window) compute exactly are exported
(`tinylm.export.weights.architecture_for` says which, or why not; its tensor rules serve both
formats). docs/export.md explains how each name maps, why GPT-2's matrices are transposed and why
llama.cpp's query and key rows are permuted for Llama but not for Qwen3.

Usage::

    export_run("runs/tiny-shakespeare", "out/hf", "hf")
    export_run("runs/tiny-shakespeare", "out/model.gguf", "gguf", dtype="f16")
    export_run("runs/tuned-lora", "out/adapter", "peft")
    import_hf_into_run("path/to/hf-checkpoint", "runs/imported")
    import_peft_into_run("path/to/adapter", "path/to/hf-checkpoint", "runs/adapted")
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from tinylm.config import build_config, load_config_file
from tinylm.errors import TinyLMError
from tinylm.export.gguf import LLAMA_CPP_PRE, GGUFDtype, export_gguf, gguf_rules
from tinylm.export.hf import export_hf, hf_config
from tinylm.export.hf_import import config_from_hf, import_hf, import_hf_into_run
from tinylm.export.peft import export_peft, import_peft_into_run, is_peft_adapter, read_peft
from tinylm.export.weights import architecture_for, hf_rules
from tinylm.run import CONFIG_FILE, load_run

FORMATS = ("hf", "gguf", "peft")


def export_run(
    run_dir: str | os.PathLike,
    out: str | os.PathLike,
    format: Literal["hf", "gguf", "peft"] = "hf",
    *,
    checkpoint: str = "best",
    overwrite: bool = False,
    dtype: GGUFDtype = "f32",
    pre_tokenizer: str | None = None,
) -> Path:
    """Export a trained run as a `transformers` folder ("hf", at ``out``), a GGUF file ("gguf", ``out`` the file) or,
    for a LoRA run, its adapter as a PEFT adapter folder ("peft", at ``out``; hf and gguf write it merged).

    ``checkpoint`` is "best" (falling back to "latest"), "latest" or a checkpoint folder, as for
    `tinylm.run.load_run`. ``dtype`` and ``pre_tokenizer`` are GGUF options (see `export_gguf`).
    A configuration neither format can express is refused before any weights are read.
    """
    if format not in FORMATS:
        raise TinyLMError(f"unknown export format {format!r}; expected one of {', '.join(FORMATS)}")
    if format != "gguf" and (dtype != "f32" or pre_tokenizer is not None):
        raise TinyLMError(f"dtype and pre_tokenizer are options of the gguf format; the {format} format writes the "
                          "model's own float32 weights" + (" and tokenizer.json" if format == "hf" else ""))
    config_path = Path(run_dir) / CONFIG_FILE
    if not config_path.is_file():
        raise TinyLMError(f"{run_dir} is not a tinylm run (no {CONFIG_FILE}); train one with `tinylm train`")
    architecture_for(build_config(load_config_file(config_path)).model)
    if format == "peft":  # the adapter alone: the base's weights are not read
        return export_peft(run_dir, out, checkpoint=checkpoint, overwrite=overwrite)
    run = load_run(run_dir, checkpoint=checkpoint)
    # the export's tokenizer puts before a text what tinylm puts before a prompt of this run
    if format == "hf":
        return export_hf(run.model, run.tokenizer, out, overwrite=overwrite, start_ids=run.start_ids)
    return export_gguf(run.model, run.tokenizer, out, dtype=dtype, name=Path(run_dir).resolve().name,
                       pre_tokenizer=pre_tokenizer, overwrite=overwrite, start_ids=run.start_ids)


__all__ = [
    "FORMATS", "architecture_for", "hf_rules", "hf_config", "config_from_hf",
    "export_hf", "import_hf", "import_hf_into_run", "export_run",
    "export_gguf", "gguf_rules", "LLAMA_CPP_PRE",
    "export_peft", "import_peft_into_run", "is_peft_adapter", "read_peft",
]
