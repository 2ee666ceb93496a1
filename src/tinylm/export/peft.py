"""LoRA adapters in PEFT's layout: a tinylm LoRA run's adapter for ``peft.PeftModel``, and a PEFT adapter as a run.

A LoRA run's checkpoint holds each corrected matrix's A (r x d_in) and B (d_out x r) under tinylm's names
(``blocks.0.attn.W_q.lora_A``, see `tinylm.model.lora`). PEFT keeps the same two matrices per module of the
`transformers` model, in a folder of two files::

    adapter_config.json          r, lora_alpha, lora_dropout, the modules (target_modules), per-module ranks
                                 and alphas where they differ (rank_pattern, alpha_pattern), ...
    adapter_model.safetensors    base_model.model.<module>.lora_A.weight and .lora_B.weight for each module

The module of a matrix is the one `tinylm.export.weights.hf_rules` writes it to, so the adapter fits the
model ``tinylm export --format hf`` writes (or the one the base was imported from). Most modules are one
tinylm matrix. A fused one stacks several along its rows (GPT-2's c_attn: q, k and v; Phi-3's qkv_proj
and gate_up_proj): its A is the parts' A one below the other (k r x d_in) and its B the parts' B on a
block diagonal, so B A is the parts' B A one below the other, exactly the parts' corrections stacked as
the weights are. Its rank is k r, and its alpha k alpha keeps the scale alpha / r: both go in
rank_pattern and alpha_pattern under the module's full name. PEFT reads those keys as regular expressions
that must match the end of a module name after a dot; a full name from the model's root matches that
module alone. Parts that share one A (an adapter that came from a fused module) keep it once, with their
B one below the other: the module's rank stays r.

The token embedding and an untied output head (lora_targets ``outer``: E and lm_head) map too. The head is
an ordinary Linear to PEFT (``lm_head.lora_A.weight``, ``lm_head.lora_B.weight``). The embedding is PEFT's
Embedding layer, which keeps its two matrices the other way round: it looks up column x of
``lora_embedding_A`` (r x |V|) and multiplies by ``lora_embedding_B`` (d x r), so row x gains
scale * (B_emb A_emb)^T[x]. tinylm's row x gains scale * B[x] A with B (|V| x r) and A (r x d), hence
lora_embedding_A = B^T and lora_embedding_B = A^T. A tied head is one table for both, which a
correction of either would split: tinylm trains no such adapter and refuses one on import.

Reading goes the other way (`read_peft`): a fused module's A is each part's A, and each part's B its
rows of B (exact: row block i of B A is B_i A). tinylm has one rank and one alpha per adapter, so
modules of other ranks are padded with zero rows of A and zero columns of B (which add nothing), and
each module's own scale is folded into its B, so that one alpha / r applies to all. A matrix the
adapter leaves out, of a kind it corrects elsewhere, gets zero A and B (no correction), so the run's
adapter is whole for its lora_targets.

PEFT also saves its own copy of a table an adapter corrects (``embed_tokens.base_layer.weight``), or of one
whose vocabulary was resized; on import that copy must be the base's own (else the adapter was trained on
another table, which is refused), and it is not written on export.

What tinylm does not compute is refused in one line: DoRA, LoRA on the position embeddings or on a
tied head, biases, extra trained modules (modules_to_save) or rows (trainable_token_indices), aLoRA and
the other variants that change the computation, and adapters trained on a modified copy of their base
(PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA initialisations). Rank-stabilised scaling (use_rslora:
alpha / sqrt(r)) is folded like any other scale.

Usage::

    export_peft("runs/tuned", "out/adapter")                 # a LoRA run -> adapter_config.json + weights
    import_peft_into_run("out/adapter", "runs/base", "runs/tuned-again")
    adapter, settings = read_peft("out/adapter", config.model)
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from tinylm.atomic import atomic_write_text, disk_writes
from tinylm.config import GPTConfig
from tinylm.errors import TinyLMError
from tinylm.export.weights import TensorRule, architecture_for, hf_rules
from tinylm.jsonfile import read_json_object
from tinylm.lock import folder_lock
from tinylm.model import build_model
from tinylm.config.training import LORA_OUTER as OUTER
from tinylm.model.lora import LORA_A, LORA_B, TARGET_GROUPS, LoraSettings, adapter_pairs
from tinylm.checkpoint import STATE_FILE
from tinylm.run import (CHECKPOINT_NAMES, CONFIG_FILE, LORA_BASE, RUN_FILE, Checkpoint, check_new_run_folder,
                        checkpoint_path, clear_run_folder, copy_checkpoint, has_checkpoint, load_checkpoint,
                        lora_base_record, save_checkpoint, save_safetensors, write_run_files, write_run_info)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."  # before each module's name in PEFT's file (a PeftModel's own name for the model)
PROJECTIONS = TARGET_GROUPS["all"]  # W_q, W_k, W_v, W_o, W_1, W_2, W_3
EMBEDDING_A, EMBEDDING_B = "lora_embedding_A", "lora_embedding_B"  # PEFT's names on an nn.Embedding
TABLES = {name: f"{name}.weight" for name in OUTER}  # E, lm_head: the weight each outer target corrects
# a tensor of PEFT's file: one of a module's LoRA matrices (an adapter's own name may follow it), or a module's
# weight itself (a copy of a table, ``base_layer`` where the module is wrapped)
LINEAR_NAME = re.compile(rf"{re.escape(PREFIX)}(.+)\.({LORA_A}|{LORA_B})(?:\.[^.]+)?\.weight")
EMBEDDING_NAME = re.compile(rf"{re.escape(PREFIX)}(.+)\.({EMBEDDING_A}|{EMBEDDING_B})(?:\.[^.]+)?")
COPY_NAME = re.compile(rf"{re.escape(PREFIX)}(.+?)(?:\.base_layer)?\.weight")

# adapter_config.json keys of PEFT variants that compute something else than W + alpha / r B A on the base's
# matrices: refused when set, with what they are
VARIANTS = {
    "use_dora": "DoRA (a learned magnitude per output row)",
    "lora_bias": "a trained bias on lora_B",
    "modules_to_save": "whole modules trained beside the adapter (modules_to_save)",
    "trainable_token_indices": "trained embedding rows (trainable_token_indices)",
    "target_parameters": "LoRA on parameters rather than on linear modules (target_parameters)",
    "layer_replication": "repeated layers (layer_replication)",
    "alora_invocation_tokens": "aLoRA (the adapter acts only after its invocation tokens)",
    "use_qalora": "QALoRA (pooled inputs)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "kasa_config": "KaSA (singular values between A and B, on a truncated base)",
    "monteclora_config": "MonteCLoRA (sampled adapters)",
    "arrow_config": "Arrow routing among adapters",
}
# initialisations that change the base's weights too: the adapter corrects that changed copy, not the base
MUTATING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")


# ----- the map between tinylm's matrices and PEFT's modules -----------------------------------------------


def matrix_modules(config: GPTConfig) -> dict[str, TensorRule]:
    """The `transformers` modules that hold the blocks' matrices LoRA corrects, by module name
    (``model.layers.0.self_attn.q_proj``), each with the rule that says which tinylm matrices it stacks."""
    modules = {}
    for rule in hf_rules(config):
        parts = [name.split(".") for name in rule.ours]
        if rule.theirs.endswith(".weight") and all(
                len(p) == 5 and p[0] == "blocks" and p[3] in PROJECTIONS and p[4] == "weight" for p in parts):
            if rule.transform not in ("copy", "conv1d"):  # those two keep each matrix's rows as they are
                raise TinyLMError(f"{rule.theirs} is laid out by {rule.transform!r}, which a LoRA adapter cannot "
                                  "follow")
            modules[rule.theirs.removesuffix(".weight")] = rule
    return modules


def table_modules(config: GPTConfig) -> dict[str, str]:
    """The `transformers` modules of the token embedding and of an untied output head (``model.embed_tokens``,
    ``lm_head``), each with the tinylm weight it holds (``E.weight``, ``lm_head.weight``)."""
    tables = {}
    for rule in hf_rules(config):
        if rule.ours[0] in TABLES.values() and len(rule.ours) == 1 and rule.theirs.endswith(".weight"):
            if rule.transform != "copy":
                raise TinyLMError(f"{rule.theirs} is laid out by {rule.transform!r}, which a LoRA adapter cannot "
                                  "follow")
            tables[rule.theirs.removesuffix(".weight")] = rule.ours[0]
    return tables


def embedding_module(config: GPTConfig) -> str:
    """The `transformers` module of the token embedding (``model.embed_tokens``, GPT-2's ``transformer.wte``)."""
    return next(module for module, weight in table_modules(config).items() if weight == TABLES["E"])


def weight_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Each weight's shape in a model of ``config``, from PyTorch's meta device (nothing allocated)."""
    with torch.device("meta"), torch.random.fork_rng(devices=[]):
        return {name: tuple(t.shape) for name, t in build_model(config).state_dict().items()}


def peft_adapter(adapter: Mapping[str, Tensor], config: GPTConfig, settings: LoraSettings,
                 base_name: str) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """A tinylm adapter (``blocks.0.attn.W_q.lora_A``, ...) in PEFT's layout: its tensors by PEFT's names and the
    adapter_config.json object. A fused module takes its parts' A stacked and their B on a block diagonal (a part
    without an adapter is left out of A and has zero rows in B), with its rank and alpha in the patterns."""
    arch = architecture_for(config)
    pairs = adapter_pairs(adapter)
    shapes = weight_shapes(config)
    tensors: dict[str, Tensor] = {}
    targets, ranks, alphas = [], {}, {}
    for module, rule in matrix_modules(config).items():
        present = [(i, pairs.pop(name)) for i, name in enumerate(rule.ours) if name in pairs]
        if not present:
            continue
        a, b = fuse(present, [shapes[name][0] for name in rule.ours])
        tensors[f"{PREFIX}{module}.{LORA_A}.weight"] = a
        tensors[f"{PREFIX}{module}.{LORA_B}.weight"] = b
        targets.append(module)
        k = a.shape[0] // settings.rank
        if k > 1:  # k parts: rank k r, and alpha k alpha for the same alpha / r
            ranks[module], alphas[module] = k * settings.rank, _number(k * settings.alpha)
    for module, weight in table_modules(config).items():
        if weight in pairs:
            a, b = pairs.pop(weight)
            tensors.update(peft_tensors(module, a, b, embedding=weight == TABLES["E"]))
            targets.append(module)
    if pairs:
        raise TinyLMError(f"the adapter corrects {next(iter(pairs))}, which no {arch} module holds")
    peft_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_name, "revision": None,
        "r": settings.rank, "lora_alpha": _number(settings.alpha), "lora_dropout": settings.dropout,
        "target_modules": targets, "rank_pattern": ranks, "alpha_pattern": alphas,
        "fan_in_fan_out": arch == "gpt2",  # GPT-2's Conv1D stores its weight as (in, out)
        "bias": "none", "lora_bias": False, "use_rslora": False, "use_dora": False, "inference_mode": True,
        "init_lora_weights": True, "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
        "exclude_modules": None, "target_parameters": None, "trainable_token_indices": None,
    }
    return tensors, peft_config


def peft_tensors(module: str, a: Tensor, b: Tensor, *, embedding: bool) -> dict[str, Tensor]:
    """A table's A (r x d) and B (|V| x r) by PEFT's names: the head's as lora_A and lora_B, the embedding's as
    lora_embedding_A = B^T (r x |V|) and lora_embedding_B = A^T (d x r), PEFT's order for a lookup (module
    docstring)."""
    if embedding:
        return {f"{PREFIX}{module}.{EMBEDDING_A}": b.float().T.contiguous(),
                f"{PREFIX}{module}.{EMBEDDING_B}": a.float().T.contiguous()}
    return {f"{PREFIX}{module}.{LORA_A}.weight": a.float().contiguous(),
            f"{PREFIX}{module}.{LORA_B}.weight": b.float().contiguous()}


def fuse(present: list[tuple[int, tuple[Tensor, Tensor]]], rows: list[int]) -> tuple[Tensor, Tensor]:
    """One module's (A, B) from the (A, B) of the parts ``present`` (by their index among the module's parts, whose
    output sizes are ``rows``): the A one below the other and the B on a block diagonal, or, where the parts share
    one A (an adapter read from a fused module), that A and the B one below the other (the same rank, no pattern).
    A part left out has zero rows in B."""
    shared = all(torch.equal(pa, present[0][1][0]) for _, (pa, _) in present)
    a = present[0][1][0].float() if shared else torch.cat([pa.float() for _, (pa, _) in present])
    b = torch.zeros(sum(rows), a.shape[0])
    col = 0
    for i, (pa, pb) in present:
        width = pa.shape[0]
        b[sum(rows[:i]):sum(rows[:i + 1]), col:col + width] = pb.float()
        col += 0 if shared else width
    return a.contiguous(), b.contiguous()


def _number(x: float) -> int | float:
    """An int where the value is whole (PEFT writes r and lora_alpha as ints)."""
    return int(x) if float(x).is_integer() else float(x)


# ----- writing ------------------------------------------------------------------------------------------


def export_peft(run_or_checkpoint: str | os.PathLike, out_dir: str | os.PathLike, *, checkpoint: str = "best",
                overwrite: bool = False) -> Path:
    """Write a LoRA run's adapter as a PEFT adapter folder (adapter_config.json, adapter_model.safetensors) at
    ``out_dir``, for ``PeftModel.from_pretrained(model, out_dir)`` on the model its base exports as; returns it.

    ``run_or_checkpoint`` is a run folder (``checkpoint``: "best", falling back to "latest", "latest" or a
    checkpoint folder) or a checkpoint folder. A run that trained every weight has no adapter: it is refused,
    pointing at --format hf and gguf. An existing non-empty ``out_dir`` is written into only with ``overwrite``.
    """
    ckpt = _checkpoint_of(Path(run_or_checkpoint), checkpoint)
    settings = LoraSettings.of(ckpt.config.train)
    if not ckpt.is_adapter or settings is None:
        raise TinyLMError(f"{run_or_checkpoint} is not a LoRA run (its checkpoint holds a whole model, not an "
                          "adapter); export it with --format hf or --format gguf")
    if settings.new_tokens:
        raise TinyLMError(f"{run_or_checkpoint} also trains the rows of {settings.new_tokens} new tokens (the chat "
                          "markers), which this export does not write in PEFT's layout; export the merged model with "
                          "--format hf or --format gguf")
    architecture_for(ckpt.config.model)
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise TinyLMError(f"{out_dir} exists and is not a folder; choose another --out")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise TinyLMError(f"{out_dir} already exists and is not empty; choose another --out or overwrite it "
                          "explicitly (--force)")
    tensors, peft_config = peft_adapter(ckpt.adapter_state(), ckpt.config.model, settings, _base_name(ckpt))
    made = not out_dir.exists()
    with disk_writes(f"the export to {out_dir}", "nothing half-written is left" if made else
                     "nothing was replaced in it", retry="export again"):
        out_dir.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".export.", suffix=".tmp", dir=out_dir))
        try:
            save_safetensors(tensors, staging / ADAPTER_WEIGHTS, metadata={"format": "pt"})
            atomic_write_text(staging / ADAPTER_CONFIG, json.dumps(peft_config, indent=2, sort_keys=True) + "\n")
            for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG):  # the config last: it is what makes a folder an adapter
                os.replace(staging / name, out_dir / name)
        except BaseException:
            shutil.rmtree(out_dir if made else staging, ignore_errors=True)
            raise
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def _checkpoint_of(path: Path, which: str) -> Checkpoint:
    """The checkpoint a run folder's ``which`` names ("best" falling back to "latest", "latest", or a checkpoint
    folder), or the checkpoint folder ``path`` itself."""
    if (path / STATE_FILE).is_file() or (path.with_name(f".{path.name}.old") / STATE_FILE).is_file():
        return load_checkpoint(path)
    if not (path / CONFIG_FILE).is_file():
        raise TinyLMError(f"{path} is not a tinylm run (no {CONFIG_FILE}) nor a checkpoint folder (no {STATE_FILE}); "
                          "give the folder of a LoRA run (tinylm finetune --lora-rank, or tinylm import --base)")
    if which not in CHECKPOINT_NAMES:
        return load_checkpoint(which)
    names = [which] + (["latest"] if which == "best" else [])
    found = [checkpoint_path(path, n) for n in names if has_checkpoint(checkpoint_path(path, n))]
    if not found:
        raise TinyLMError(f"{path} has no {which} checkpoint yet; train (or --resume) it first")
    return load_checkpoint(found[0])


def _base_name(ckpt: Checkpoint) -> str:
    """What adapter_config.json names as the base model: the Hugging Face folder the base was imported from, else
    the base's run folder (export it with --format hf for transformers)."""
    record = ckpt.state.get(LORA_BASE)
    if not isinstance(record, dict) or not isinstance(record.get("path"), str):
        return ""
    base = Path(record["path"])
    try:
        source = read_json_object(base / STATE_FILE).get("imported_from")
    except TinyLMError:
        source = None
    if isinstance(source, dict) and source.get("format") == "huggingface" and isinstance(source.get("path"), str):
        return source["path"]
    return str(base.parent.parent if base.parent.name == "checkpoints" else base)


# ----- reading ------------------------------------------------------------------------------------------


def is_peft_adapter(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` is a PEFT adapter folder (it has adapter_config.json)."""
    return (Path(folder) / ADAPTER_CONFIG).is_file()


def read_peft_config(adapter_dir: str | os.PathLike) -> dict[str, Any]:
    """adapter_config.json of ``adapter_dir``, once checked to describe a plain LoRA adapter tinylm computes."""
    adapter_dir = Path(adapter_dir)
    path = adapter_dir / ADAPTER_CONFIG
    if not adapter_dir.is_dir():
        raise TinyLMError(f"{adapter_dir} is not a folder; give the folder that holds {ADAPTER_CONFIG} and "
                          f"{ADAPTER_WEIGHTS}")
    if not path.is_file():
        what = (f"it holds a model (config.json), which tinylm import --from {adapter_dir} imports without --base"
                if (adapter_dir / "config.json").is_file() else "it is not a PEFT adapter")
        raise TinyLMError(f"{adapter_dir} has no {ADAPTER_CONFIG}: {what}")
    config = read_json_object(path)
    kind = config.get("peft_type")
    if kind != "LORA":
        raise TinyLMError(f"{path} describes a {kind or 'untyped'} adapter; tinylm reads LoRA adapters only")
    if config.get("task_type") not in (None, "CAUSAL_LM"):
        raise TinyLMError(f"{path} is an adapter for {config['task_type']}; tinylm reads causal language models' "
                          "adapters (task_type CAUSAL_LM)")
    for key, what in VARIANTS.items():
        if config.get(key):
            raise TinyLMError(f"{path} sets {key}: {what}, which tinylm's LoRA does not compute; merge it into the "
                              "model with PEFT (merge_and_unload) and import that model instead")
    if config.get("bias", "none") != "none":
        raise TinyLMError(f"{path} trains biases (bias = {config['bias']!r}), which tinylm's LoRA does not; merge it "
                          "into the model with PEFT (merge_and_unload) and import that model instead")
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(MUTATING_INITS):
        raise TinyLMError(f"{path} was initialised with {init!r}, which changes the base's weights too: the adapter "
                          "corrects that changed copy; save it with PEFT's conversion to a plain LoRA adapter "
                          "(path_initial_model_for_weight_conversion) and import that")
    for key, kind in (("rank_pattern", int), ("alpha_pattern", (int, float))):
        patterns = config.get(key) or {}
        if not isinstance(patterns, dict) or not all(isinstance(v, kind) and v > 0 for v in patterns.values()):
            raise TinyLMError(f"{path}: {key} is not an object of module patterns and positive "
                              f"{'ranks' if kind is int else 'alphas'}")
    return config


def read_adapter_tensors(adapter_dir: Path) -> dict[str, Tensor]:
    """The tensors of adapter_model.safetensors (never a pickle file), by PEFT's names."""
    path = adapter_dir / ADAPTER_WEIGHTS
    if not path.is_file():
        pickled = (adapter_dir / "adapter_model.bin").is_file()
        hint = (" It has adapter_model.bin, a pickle file, which can run code when loaded and which tinylm does "
                "not open; save the adapter again with safe_serialization=True") if pickled else ""
        raise TinyLMError(f"{adapter_dir} has no {ADAPTER_WEIGHTS}: the adapter is incomplete.{hint}")
    try:
        with safe_open(path, framework="pt") as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    except Exception as e:  # safetensors has its own error types for a damaged file
        raise TinyLMError(f"{path} is not a readable safetensors file ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:120]})") from None


def pattern_value(patterns: Mapping[str, Any], module: str, default: Any, source: Path) -> Any:
    """The value of the first of ``patterns`` that matches ``module``, as PEFT matches them (a regular expression
    that must match the end of the name, after a dot or from its start), else ``default``."""
    for key, value in patterns.items():
        try:
            if re.match(rf"(.*\.)?({key})$", module):
                return value
        except re.error as e:
            raise TinyLMError(f"{source}: the pattern {key!r} is not a regular expression ({e})") from None
    return default


def saved_tables(tensors: Mapping[str, Tensor], config: GPTConfig, base: Mapping[str, Tensor] | None,
                 source: Path) -> dict[str, Tensor]:
    """``tensors`` less PEFT's copies of the embedding and the head (``model.embed_tokens.base_layer.weight``, or
    the module's own weight where the vocabulary was resized), each checked, when ``base`` (the base's weights)
    is given, to be the base's own table: a copy of another shape or other numbers means the adapter was made
    for another table, which is refused in one line."""
    tables = table_modules(config)
    if config.tie_embeddings:
        tables["lm_head"] = TABLES["E"]  # the head's table is the embedding's
    rest: dict[str, Tensor] = {}
    for name, t in tensors.items():
        m = COPY_NAME.fullmatch(name)
        weight = tables.get(m[1]) if m is not None else None
        if weight is None:
            rest[name] = t
        elif base is not None and not _same_table(t, base[weight]):
            why = (f"{tuple(t.shape)} where the base's is {tuple(base[weight].shape)}: its vocabulary was resized"
                   if t.shape != base[weight].shape else "other numbers than the base's: the table was trained too")
            raise TinyLMError(f"{source} holds its own {m[1]} ({why}), which a LoRA adapter of this base cannot "
                              "carry; merge it into the model with PEFT (merge_and_unload) and import that model "
                              "instead")
    return rest


def _same_table(theirs: Tensor, ours: Tensor) -> bool:
    """Whether two copies of a table hold the same numbers (to bfloat16's rounding, should one have been cast)."""
    return theirs.shape == ours.shape and torch.allclose(theirs.float(), ours.float(), rtol=2 ** -8, atol=1e-6)


def peft_modules(tensors: Mapping[str, Tensor], modules: Mapping[str, tuple[str, ...]], embedding: str,
                 tied: set[str], source: Path) -> dict[str, tuple[Tensor, Tensor]]:
    """(A, B) of each module the adapter's tensors name, in tinylm's orientation (``embedding``'s
    lora_embedding_A and lora_embedding_B are its B^T and A^T: module docstring). ``modules``: the modules tinylm
    corrects, with the tinylm weights each holds. A correction of a table in ``tied`` (a head that is the
    embedding), or a name that is no LoRA matrix of those modules (the position embeddings, a bias, DoRA's
    magnitudes), is refused in one line."""
    found: dict[str, dict[str, Tensor]] = {}
    for name, t in tensors.items():
        m = LINEAR_NAME.fullmatch(name) or EMBEDDING_NAME.fullmatch(name)
        module = m[1] if m is not None else None
        if module in tied:
            raise TinyLMError(f"{source} has {name}, a correction of {module}, but this base's output head is its "
                              "embedding (tied): one table, which tinylm cannot correct for one use and not the "
                              "other; use an adapter of the blocks' projections")
        looked_up = m is not None and m[2] in (EMBEDDING_A, EMBEDDING_B)
        if module not in modules or looked_up != (module == embedding):
            raise TinyLMError(f"{source} has {name}, which is no LoRA matrix of a module of this base model that "
                              "tinylm's LoRA corrects (a block's projection, the token embedding, an untied output "
                              "head); is the adapter another model's?")
        if t.dim() != 2 or not t.is_floating_point():
            raise TinyLMError(f"{source}: {name} is not a matrix of floating-point numbers")
        if looked_up:  # PEFT's embedding keeps B^T as its A and A^T as its B
            found.setdefault(module, {})[LORA_B if m[2] == EMBEDDING_A else LORA_A] = t.T
        else:
            found.setdefault(module, {})[m[2]] = t
    for module, pair in found.items():
        if set(pair) != {LORA_A, LORA_B}:
            missing = LORA_B if LORA_A in pair else LORA_A
            raise TinyLMError(f"{source} has {module}'s {next(iter(pair))} but not its {missing}: the file is "
                              "incomplete")
    if not found:
        raise TinyLMError(f"{source} holds no LoRA matrices")
    return {module: (pair[LORA_A], pair[LORA_B]) for module, pair in found.items()}


def read_peft(adapter_dir: str | os.PathLike, config: GPTConfig,
              base: Mapping[str, Tensor] | None = None) -> tuple[dict[str, Tensor], LoraSettings]:
    """A PEFT LoRA adapter as a tinylm adapter for a model of ``config`` (what it computes the same, in float32),
    and the settings it is merged with (see the module docstring: fused modules split, ranks padded, scales
    folded into B). ``base``: the base's weights, to check PEFT's copies of the embedding and the head against
    (`saved_tables`); without it those copies are not read."""
    adapter_dir = Path(adapter_dir)
    peft_config = read_peft_config(adapter_dir)
    source = adapter_dir / ADAPTER_WEIGHTS
    modules = {module: rule.ours for module, rule in matrix_modules(config).items()}
    tables = table_modules(config)
    tied = set(tables) | {"lm_head"} if config.tie_embeddings else set()
    if not tied:
        modules.update({module: (weight,) for module, weight in tables.items()})
    shapes = weight_shapes(config)
    r, alpha = peft_config.get("r", 8), peft_config.get("lora_alpha", 8)
    if not (isinstance(r, int) and r > 0 and isinstance(alpha, (int, float)) and alpha > 0):
        raise TinyLMError(f"{adapter_dir / ADAPTER_CONFIG}: r must be a positive integer and lora_alpha a positive "
                          f"number, got r = {r!r}, lora_alpha = {alpha!r}")
    rslora = bool(peft_config.get("use_rslora"))
    tensors = saved_tables(read_adapter_tensors(adapter_dir), config, base, source)
    parts: dict[str, tuple[Tensor, Tensor, float]] = {}  # tinylm weight -> (A, B, scale)
    for module, (a, b) in peft_modules(tensors, modules, embedding_module(config), tied, source).items():
        rank = pattern_value(peft_config.get("rank_pattern") or {}, module, r, source)
        module_alpha = pattern_value(peft_config.get("alpha_pattern") or {}, module, alpha, source)
        ours = modules[module]
        rows = [shapes[name][0] for name in ours]
        d_in = shapes[ours[0]][1]
        if a.shape != (rank, d_in) or b.shape != (sum(rows), rank):
            raise TinyLMError(f"{source}: {module}'s A is {tuple(a.shape)} and B {tuple(b.shape)}, but the base model "
                              f"and {ADAPTER_CONFIG} make them {(rank, d_in)} and {(sum(rows), rank)}: the adapter "
                              "was made for another model (or its config does not go with its weights)")
        scale = module_alpha / (math.sqrt(rank) if rslora else rank)
        for name, part in zip(ours, torch.split(b.float(), rows)):
            parts[name] = (a.float(), part, scale)
    rank = max(a.shape[0] for a, _, _ in parts.values())
    scale = alpha / (math.sqrt(r) if rslora else r)  # the adapter's own, folded out of every module's B
    settings_alpha = alpha if rank == r and not rslora else scale * rank
    adapter = _uniform(parts, rank, scale, shapes)
    targets = _targets_setting({kind_of(name) for name in parts}, shapes)
    dropout = float(peft_config.get("lora_dropout") or 0.0)
    return adapter, LoraSettings(rank, float(settings_alpha), dropout, targets)


def kind_of(weight: str) -> str | None:
    """The lora_targets name of a weight: its projection's (W_q, ..., in a block), E or lm_head; else None."""
    p = weight.split(".")
    if len(p) == 5 and p[0] == "blocks" and p[3] in PROJECTIONS and p[4] == "weight":
        return p[3]
    return p[0] if weight in TABLES.values() else None


def _uniform(parts: Mapping[str, tuple[Tensor, Tensor, float]], rank: int, scale: float,
             shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Tensor]:
    """Every part at ``rank`` (zero rows of A, zero columns of B) with its scale folded into B for ``scale``, and
    zeros for the matrices of the corrected kinds the adapter leaves out, by tinylm's adapter names."""
    kinds = {kind_of(name) for name in parts}
    adapter: dict[str, Tensor] = {}
    for name, shape in shapes.items():
        if kind_of(name) not in kinds:
            continue
        module = name.removesuffix(".weight")
        a, b = torch.zeros(rank, shape[1]), torch.zeros(shape[0], rank)
        if name in parts:
            pa, pb, s = parts[name]
            a[:pa.shape[0]] = pa
            b[:, :pb.shape[1]] = pb if s == scale else pb * (s / scale)
        adapter[f"{module}.{LORA_A}"], adapter[f"{module}.{LORA_B}"] = a, b
    return adapter


def _targets_setting(kinds: set[str | None], shapes: Mapping[str, tuple[int, ...]]) -> str:
    """lora_targets for ``kinds`` (projection names, E, lm_head): "all" for every projection the model has, and
    "outer" for both tables ("all,outer", "W_q,W_v", "all,E", ...)."""
    has = {kind_of(name) for name in shapes} & set(PROJECTIONS)
    projections = kinds & set(PROJECTIONS)
    words = ["all"] if projections == has else [n for n in PROJECTIONS if n in projections]
    tables = [n for n in OUTER if n in kinds]
    words += ["outer"] if len(tables) == len(OUTER) else tables
    return ",".join(words)


# ----- a LoRA run from a PEFT adapter -----------------------------------------------------------------------


def import_peft_into_run(adapter_dir: str | os.PathLike, base: str | os.PathLike, out_dir: str | os.PathLike, *,
                         force: bool = False, roles: dict[str, str] | None = None) -> Path:
    """Make a LoRA run at ``out_dir`` of the PEFT adapter ``adapter_dir`` on ``base`` (a tinylm run, a checkpoint
    folder, or a Hugging Face model folder, imported first into ``<out_dir>.base``); returns ``out_dir``.

    The run is what a LoRA run's training writes: config.toml (the base's, with the adapter's lora settings),
    tokenizer.json, run.json and checkpoints latest and best at step 0 that hold the adapter and name the base
    by path and weights' SHA-256, so sample, eval, serve and export merge it into the base as they load it.
    An existing non-empty folder is replaced only with ``force``, and only if it is a tinylm run. ``roles``: the
    special tokens of a Hugging Face base's tokenizer, as for `tinylm.export.import_hf_into_run`.
    """
    adapter_dir, out_dir = Path(adapter_dir), Path(out_dir)
    peft_config = read_peft_config(adapter_dir)  # a folder that is no adapter is refused before anything is written
    check_new_run_folder(out_dir, force, resumable=False, folder_arg="out_dir")
    with folder_lock(out_dir, "import"):
        check_new_run_folder(out_dir, force, resumable=False, folder_arg="out_dir")
        base_ckpt = base_checkpoint(Path(base), out_dir, force=force, roles=roles)
        adapter, settings = read_peft(adapter_dir, base_ckpt.config.model, base_ckpt.model_state())
        train = dataclasses.replace(base_ckpt.config.train, lora_rank=settings.rank, lora_alpha=settings.alpha,
                                    lora_dropout=settings.dropout, lora_targets=settings.targets)
        config = dataclasses.replace(base_ckpt.config, train=train)
        source = {"format": "peft", "path": str(adapter_dir.resolve()), "base": str(base_ckpt.path),
                  "base_model_name_or_path": peft_config.get("base_model_name_or_path")}
        clear_run_folder(out_dir)
        write_run_files(out_dir, config, base_ckpt.tokenizer, {"status": "importing", "step": 0,
                                                               "imported_from": source})
        latest = checkpoint_path(out_dir, "latest")
        state = {"step": 0, "tokens": 0, "elapsed": 0.0, "best_val_loss": None, "imported_from": source,
                 LORA_BASE: lora_base_record(base_ckpt, latest)}
        save_checkpoint(latest, model_state=adapter, optimizer_state=None, rng_state={}, state=state, config=config,
                        tokenizer=base_ckpt.tokenizer)
        copy_checkpoint(latest, checkpoint_path(out_dir, "best"))
        write_run_info(out_dir, {"status": "complete", "step": 0, "imported_from": source})
    return out_dir


def base_checkpoint(base: Path, out_dir: Path, *, force: bool, roles: dict[str, str] | None) -> Checkpoint:
    """The checkpoint an imported adapter adapts: a run's best (else latest), a checkpoint folder, or a Hugging Face
    model folder imported into ``<out_dir>.base`` first; it must be a Transformer that exports."""
    if not base.exists():
        raise TinyLMError(f"--base {base}: no such run, checkpoint or Hugging Face model folder (the model the "
                          "adapter was trained on)")
    if (base / "config.json").is_file() and not (base / RUN_FILE).exists():
        from tinylm.export.hf_import import import_hf_into_run

        base = import_hf_into_run(base, out_dir.with_name(out_dir.name + ".base"), force=force, roles=roles)
    if (base / RUN_FILE).exists():
        best = checkpoint_path(base, "best")
        base = best if has_checkpoint(best) else checkpoint_path(base, "latest")
    ckpt = load_checkpoint(base)
    if ckpt.config.model.family != "gpt":
        raise TinyLMError(f"--base {base} is not a Transformer: a LoRA adapter corrects a Transformer's matrices")
    architecture_for(ckpt.config.model)
    return ckpt


__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "matrix_modules", "table_modules", "peft_adapter", "export_peft",
           "is_peft_adapter", "read_peft_config", "read_peft", "import_peft_into_run", "base_checkpoint"]
