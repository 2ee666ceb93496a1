"""Serving LoRA adapters beside their base model: ``tinylm serve --run BASE --adapter NAME=DIR ...``.

Each adapter is served as a model of its own name (in ``/v1/models``, and as ``model`` in the completion
and chat requests), while the base is loaded once: every adapter adds only its A and B matrices, stacked
on the base's matrices (`tinylm.model.lora_multi.MultiLoRA`). Requests for the base and for any adapters
decode in one batch: the scheduler chooses, before each forward pass, which adapter each row reads
(`ServedAdapters.choose`), and each matrix adds each row's own correction.

**What an adapter folder is.** A LoRA run folder (`tinylm finetune --lora-rank 8`, `tinylm train
--init-from RUN --lora-rank 8`), read from its best checkpoint (else its latest), or one of its
checkpoint folders. A folder that holds a whole model (a fine-tune without ``--lora-rank``) is refused:
serve it on its own.

**Which base.** An adapter names the checkpoint it was trained on (`tinylm.checkpoint.Checkpoint.base`);
the served model must be that one: the same [model] settings, the same weights (the SHA-256 of its
weights file) and the same tokenizer, so the chat template and the ids are the adapter's too. ``--run``
may be the base's run folder (its best checkpoint, or ``--checkpoint latest``) or the base's checkpoint
folder itself. A chat fine-tune of a tinylm model adapts the model with its chat tokens added, saved in
the fine-tune's data folder (``data/chats-.../init``): not the run it started from. Without ``--run`` the
adapters' own base is served (they must share one), so ``tinylm serve --adapter chat=runs/chat-lora`` is
enough. A mismatch, a name taken twice (or the base's), or a flag that is not NAME=DIR is one line,
before the server starts.

**The decoding layout.** A GPT decodes through `tinylm.generate.fast.DecodeWeights`, a copy of its
matrices laid out for one-token steps (q, k and v side by side, a gated MLP's W_1 and W_3 too), not
through its modules. `adapt_layout` puts the corrections there as well, joined the same way (one
correction per fused product: `MultiLoRA.joined`), the output head's included, and has the layout look
tokens up in the model's stacked embedding, so adapted rows keep the fast path, adapters of the embedding
and the head (`tinylm finetune --lora-rank` on a model with an untied head) too; a batch of base rows
alone computes exactly what it did without adapters. An adapter that trains new tokens' rows of its own
(``lora_new_tokens``: a tied head, or targets without E and lm_head) is refused: those rows replace the
base's, which several adapters cannot do at once.

**What it costs** (`benchmarks/serve_adapters.py --direct`, the tiny preset with two rank-8 adapters on
every matrix, 8 and 32 concurrent clients; tokens/s against a server of the base alone): base requests
on the server carrying the adapters, 0.93-1.03x on 4 CPU threads and 0.99-1.05x on an H200 (the
GPT-2-sized preset); requests alternating between the two adapters, 0.87-0.89x on the CPU (their rank-8
products are a tenth more arithmetic for a model this narrow) and 0.63-0.65x on the GPU, whose steps
at these sizes are bound by launching kernels, and an adapted product launches two or three more.
Requests for one adapter alone cost about the same as for two mixed (0.86-0.87x, 0.65-0.67x): mixing
adapters in a batch costs nothing more than using one.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from tinylm.checkpoint import STATE_FILE, Checkpoint, weights_fingerprint
from tinylm.device import resolve_device
from tinylm.errors import TinyLMError
from tinylm.generate.fast import DecodeWeights, decode_weights, supports
from tinylm.model.lora import LoraSettings
from tinylm.model.lora_multi import Adapter, MultiLoRA, add_low_rank
from tinylm.run import (
    CHECKPOINT_NAMES,
    CHECKPOINTS,
    RUN_FILE,
    Run,
    checkpoint_path,
    has_checkpoint,
    load_checkpoint,
    read_metrics,
)
from tinylm.tokenizers.base import check_same_tokenizer

NAME = re.compile(r"[^\s=]+")  # a model id clients can send: no spaces, no '='
BASE_NAME = "base"  # the base's name when it is no run's checkpoint and no --model-name names it


@dataclass
class LoraAdapter:
    """An adapter to serve: the name clients ask for, the folder it was given as, and its checkpoint."""

    name: str
    source: str
    checkpoint: Checkpoint

    @property
    def base(self) -> Checkpoint:
        """The checkpoint the adapter was trained on (found and checked when the adapter was read)."""
        return self.checkpoint.base()

    @property
    def scale(self) -> float:
        return LoraSettings.of(self.checkpoint.config.train).scale

    def tensors(self) -> dict[str, Tensor]:
        return self.checkpoint.adapter_state()


def parse_adapter_flags(flags: Sequence[str]) -> dict[str, str]:
    """``--adapter NAME=DIR`` flags as {name: folder}; a flag of another form, or a name given twice, is refused."""
    adapters: dict[str, str] = {}
    for flag in flags:
        name, eq, folder = flag.partition("=")
        if not eq or not name or not folder:
            raise TinyLMError(f"--adapter {flag!r} is not NAME=DIR: give the model name clients will ask for, '=', "
                              "and a LoRA run folder (e.g. --adapter poems=runs/poems-lora)")
        check_name(name)
        if name in adapters:
            raise TinyLMError(f"--adapter {name}= is given twice ({adapters[name]} and {folder}); give each adapter a "
                              "name of its own")
        adapters[name] = folder
    return adapters


def check_name(name: str) -> None:
    if not NAME.fullmatch(name):
        raise TinyLMError(f"--adapter {name!r}=...: a model name has no spaces and no '='; choose another")


def find_adapters(adapters: Mapping[str, str | os.PathLike] | Sequence[str]) -> list[LoraAdapter]:
    """Read each adapter ({name: folder}, or ``NAME=DIR`` flags) and the base it names, each checked (module
    docstring); a folder that is not a LoRA adapter, or whose base is missing or changed, is one line."""
    if not isinstance(adapters, Mapping):
        adapters = parse_adapter_flags(adapters)
    found = []
    for name, source in adapters.items():
        check_name(name)
        checkpoint = adapter_checkpoint(name, Path(source))
        try:
            checkpoint.base()
        except TinyLMError as e:
            raise TinyLMError(f"--adapter {name}: {e}") from None
        found.append(LoraAdapter(name, str(source), checkpoint))
    return found


def adapter_checkpoint(name: str, path: Path) -> Checkpoint:
    """The checkpoint of the adapter folder ``path``: a LoRA run's best (else latest) or a checkpoint folder."""
    given = f"--adapter {name}={path}"
    if (path / RUN_FILE).is_file():
        best = checkpoint_path(path, "best")
        folder = best if has_checkpoint(best) else checkpoint_path(path, "latest")
        if not has_checkpoint(folder):
            raise TinyLMError(f"{given}: the run has no checkpoint yet; train it first")
    elif (path / STATE_FILE).is_file():
        folder = path
    else:
        what = "does not exist" if not path.exists() else "is neither a run folder nor a checkpoint folder"
        raise TinyLMError(f"{given}: {path} {what}; give a LoRA run folder (tinylm finetune --lora-rank 8 writes "
                          "one) or one of its checkpoints")
    checkpoint = load_checkpoint(folder)
    if not checkpoint.is_adapter or LoraSettings.of(checkpoint.config.train) is None:
        raise TinyLMError(f"{given}: {folder} holds a whole model, not a LoRA adapter; serve it on its own "
                          f"(tinylm serve --run {path}), or train an adapter (--lora-rank 8)")
    if checkpoint.config.train.lora_new_tokens:
        raise TinyLMError(f"{given}: {folder} also trains the rows of {checkpoint.config.train.lora_new_tokens} new "
                          "tokens, which a shared base cannot hold for several adapters at once; serve it on its own "
                          f"(tinylm serve --run {folder})")
    return checkpoint


def adapters_base(found: Sequence[LoraAdapter]) -> Path:
    """The checkpoint folder every adapter of ``found`` adapts (served when ``--run`` is left out)."""
    first = found[0]
    for other in found[1:]:
        if not same_model(first.base, other.base):
            raise TinyLMError(f"the adapters adapt different models ('{first.name}': {first.base.path}, "
                              f"'{other.name}': {other.base.path}); a server serves one base: give --run and only "
                              "its adapters, or serve each base on a server of its own")
    return first.base.path


def same_model(a: Checkpoint, b: Checkpoint) -> bool:
    """Whether two checkpoints hold one model: the same [model] settings and the same weights file."""
    return a.config.model == b.config.model and weights_fingerprint(a.path) == weights_fingerprint(b.path)


def check_adapters(found: Sequence[LoraAdapter], base: Checkpoint, base_name: str) -> None:
    """Refuse, in one line, an adapter named as the base is (``base_name``), or trained on another model than
    ``base`` (the checkpoint served) or with another tokenizer."""
    for adapter in found:
        if adapter.name == base_name:
            raise TinyLMError(f"--adapter {adapter.name}=...: '{base_name}' is the base model's name; give the "
                              "adapter another (or the base another with --model-name)")
        if not same_model(adapter.base, base):
            grown = adapter.base.config.model.vocab_size > base.config.model.vocab_size
            why = (" (a chat fine-tune adapts its base with the chat tokens added, saved beside its data)"
                   if grown else "")
            raise TinyLMError(f"--adapter {adapter.name}={adapter.source} adapts the model in {adapter.base.path}, "
                              f"not the one served ({base.path}){why}: serve it with --run {adapter.base.path}, or "
                              "leave out --run to serve the adapters' own base")
        check_same_tokenizer(base.tokenizer, adapter.checkpoint.tokenizer,
                             f"--adapter {adapter.name}: its tokenizer is not the served model's",
                             "serve it with the base it was trained on")


def is_checkpoint_folder(path: Path) -> bool:
    """Whether ``path`` is a checkpoint folder given as the run to serve (an adapter's base), not a run folder."""
    return (path / STATE_FILE).is_file() and not (path / RUN_FILE).is_file()


def served_checkpoint(run_dir: Path, checkpoint: str = "best") -> Path | None:
    """The checkpoint folder ``tinylm serve --run run_dir`` serves, without loading it (`load_run`'s choice:
    best, falling back to latest); ``run_dir`` itself where it is a checkpoint folder; None for a run without
    checkpoints (an n-gram run, or one not trained yet: loading it says which)."""
    if is_checkpoint_folder(run_dir):
        return run_dir
    if checkpoint not in CHECKPOINT_NAMES:
        return Path(checkpoint)
    names = [checkpoint] + (["latest"] if checkpoint == "best" else [])
    return next((checkpoint_path(run_dir, n) for n in names if has_checkpoint(checkpoint_path(run_dir, n))), None)


def checkpoint_run(folder: Path, device: Any = "cpu") -> Run:
    """A checkpoint folder loaded as a run to serve (as `load_run` loads a run folder's checkpoint)."""
    ckpt = load_checkpoint(folder)
    model = ckpt.build_model(resolve_device(str(device)))
    return Run(folder, ckpt.config, ckpt.tokenizer, model, ckpt, {}, read_metrics(folder))


def base_name(run_dir: Path | None, served: Path) -> str:
    """The base's model name when no --model-name gives one: the run folder's name (as without adapters); for
    a checkpoint folder, the name of the run it belongs to, or `BASE_NAME`."""
    if run_dir is not None and (run_dir / RUN_FILE).is_file():
        return run_dir.name
    if served.parent.name == CHECKPOINTS and (served.parent.parent / RUN_FILE).is_file():
        return served.parent.parent.name
    return run_dir.name if run_dir is not None else BASE_NAME


class ServedAdapters:
    """The adapters a server serves beside its base: their names (index 1..n; 0 is the base) and their
    corrections stacked on ``model`` (`MultiLoRA`), in its modules and in its decoding layout."""

    def __init__(self, model: nn.Module, found: Sequence[LoraAdapter]) -> None:
        self.names = [a.name for a in found]
        self.stack = MultiLoRA(model, [Adapter(a.name, a.tensors(), a.scale) for a in found])
        if supports(model):
            adapt_layout(decode_weights(model), self.stack)

    def __len__(self) -> int:
        return len(self.names)

    def index(self, name: str) -> int | None:
        """The adapter's index (1..n), or None where no adapter has this name."""
        return self.names.index(name) + 1 if name in self.names else None

    def choose(self, decoder: Any, adapters: Sequence[int]) -> None:
        """Before ``decoder`` runs: row b reads adapter ``adapters[b]`` (0: the base). A decoder through the
        decoding layout (`StaticDecoder`) gets the layout's corrections, should the layout have been made anew."""
        weights = getattr(decoder, "weights", None)
        if isinstance(weights, DecodeWeights):
            adapt_layout(weights, self.stack)
        self.stack.choose(adapters)

    @contextmanager
    def chosen(self, adapter: int) -> Iterator[None]:
        """The model's own forward passes in this thread read ``adapter`` inside the block (/next_token)."""
        with self.stack.chosen(adapter):
            yield


def adapt_layout(weights: DecodeWeights, stack: MultiLoRA) -> None:
    """Make the decoding layout ``weights`` add each row's correction to the products the adapters correct
    (once per layout): its product function is wrapped, the correction found by the matrix it multiplies by
    (the output head's too), and its embedding is the model's, which looks up the corrected rows itself."""
    if weights.__dict__.get("adapted_by") is stack:
        return
    gated = weights.config.gated
    weights.E = stack.model.E  # a layout made before the adapters were stacked holds the plain embedding
    fixes: dict[int, tuple[Tensor, Tensor]] = {}
    head = stack.joined((stack.model.lm_head,))
    if head is not None:
        fixes[id(weights.head)] = head
    for layer, block in zip(weights.layers, stack.model.blocks):
        attn, mlp = block.attn, block.mlp
        groups = {"qkv": (attn.W_q, attn.W_k, attn.W_v), "o": (attn.W_o,),
                  "up": (mlp.W_1, mlp.W_3) if gated else (mlp.W_1,), "down": (mlp.W_2,)}  # as the layout fuses them
        for key, linears in groups.items():
            fix = stack.joined(linears)
            if fix is not None:
                fixes[id(layer[key][0])] = fix
    plain = weights.__dict__.setdefault("plain_product", weights.product)
    n = stack.n

    def product(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        y = plain(x, weight, bias)
        rows = stack.rows
        if rows is None:
            return y
        fix = fixes.get(id(weight))
        return y if fix is None else add_low_rank(y, x, fix[0], fix[1], rows, n)

    weights.product = product
    weights.adapted_by = stack


__all__ = ["LoraAdapter", "ServedAdapters", "adapt_layout", "adapter_checkpoint", "adapters_base", "base_name",
           "check_adapters", "checkpoint_run", "find_adapters", "is_checkpoint_folder", "parse_adapter_flags",
           "same_model", "served_checkpoint"]
