"""Fine-tuning on conversations: a trained model taught to answer (`tinylm finetune`).

Pretraining teaches a model to continue text. Supervised fine-tuning teaches it a conversation's
turns: it reads chats written out by a chat template and learns to write the assistant's messages,
the loss counting only those tokens and the end-of-turn token that closes each (so the model learns
to stop), never what the user or system wrote. `finetune` does it in four steps:

1. **The starting model**: a tinylm run (its best checkpoint) or a checkpoint folder, or a Hugging
   Face model folder, imported first into ``<out>.base`` (`tinylm.export.import_hf_into_run`).
2. **The chat tokens**: a model made by tinylm gets ChatML's two markers as special tokens and the
   ChatML template (`tinylm.tokenizers.chat_template.with_chat_tokens`); its embeddings and head grow
   by those rows, each new row the mean of the learned ones (`tinylm.model.grow.grow_vocabulary`). An
   imported chat model keeps its own template and tokens.
3. **The data**: conversations from a JSONL file (OpenAI chats, prompt/completion pairs or Alpaca
   instructions: `tinylm.data.conversations`) or built-in tasks (``tasks:add``, ``tasks:add+spell``:
   `tinylm.data.tasks`), held out by a seed or given (``val_data``), tokenized once into conversation
   shards with the trained tokens marked (`tinylm.data.chat_shards`), beside the starting weights.
4. **Training**: `tinylm.train.train` on those shards, conversations packed several to a row without
   attending to each other (``batch_mode = "chats"``), from the grown weights. The run folder is an
   ordinary one: `sample`, `eval`, `serve`, `export` and `explain` take it, and ``resume`` continues it
   exactly after an interruption.

The recipe starts from the base run's own [train] settings, learning rates included, with a short
warmup, evaluation a few times per run, and a budget of two epochs (every training conversation twice)
but at least `MIN_STEPS` steps, unless a budget is given. Fine-tuning large pretrained models usually takes a tenth of pretraining's
rates; on tinylm's own small runs a tenth left new skills half learned (echoing the user's words, an
epoch or several: `benchmarks/finetune.py` and the README say how it was measured), so ``--lr`` and
its siblings are the way to go lower. A LoRA fine-tuning (``--lora-rank``) has its own rate and corrects
the embedding and the head too unless told otherwise (`lora_recipe`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from tinylm.config import Config, GPTConfig, TrainConfig, load_config_file
from tinylm.config.tables import apply_overrides, build_config, override_keys
from tinylm.config.training import LORA_OUTER, lora_target_names
from tinylm.data.chat_shards import chats_fingerprint, prepare_chats
from tinylm.data.conversations import read_conversations, split_conversations
from tinylm.data.shards import ShardSet
from tinylm.data.tasks import make_task, parse_task_spec
from tinylm.errors import TinyLMError
from tinylm.model.grow import grow_vocabulary
from tinylm.checkpoint import save_checkpoint
from tinylm.run import ADAPTER_FOLDER, CONFIG_FILE, RUN_FILE, Checkpoint, RunResult, checkpoint_path, has_checkpoint, load_checkpoint
from tinylm.tokenizers.chat_template import with_chat_tokens
from tinylm.train import BatchSource, train

TASK_ITEMS = {"train": 20_000, "val": 200}  # items made per built-in task, per split
INIT_FOLDER = "init"  # in the data folder: the starting weights with the chat tokens' rows
# The default budget: two epochs, and no fewer than MIN_STEPS optimizer steps (a few thousand short chats pack
# into a few dozen rows of steps an epoch). Measured on the default run (README, `benchmarks/finetune.py`).
DEFAULT_EPOCHS = 2.0
MIN_STEPS = 250
LORA_LR = 3e-3  # a LoRA fine-tuning's rate unless --lr is given (`lora_recipe`)
LORA_STEPS = 2  # LoRA learns a new skill in more steps than full fine-tuning: this many times the budget


def finetune(source: str | os.PathLike | None, data: str | None, out: str | os.PathLike, *,
             val_data: str | None = None, val_fraction: float = 0.05, epochs: float | None = None,
             overrides: Mapping[str, Any] | None = None, data_dir: str | os.PathLike | None = None,
             resume: bool | str = False, force: bool = False, stop_after: int | None = None,
             progress: bool | None = None, log: Callable[[str], None] = print) -> RunResult:
    """Fine-tune ``source`` on the conversations ``data`` into the run folder ``out`` (see the module docstring).

    ``overrides``: [train] settings (``max_steps``, ``lr``, ``batch_size``, ...) over the recipe; ``epochs``:
    the budget in passes over the training conversations (default one, when no budget is given).
    ``data_dir``: where the conversation shards and starting weights go (default data/chats-<out's name>).
    ``resume`` continues ``out`` from its own checkpoint, with its own data and settings.
    """
    out = Path(out)
    if resume:
        if source is not None or data is not None:
            raise TinyLMError("--resume continues the fine-tuning run in --out with its own data and settings; "
                              "drop --from and --data")
        return with_adapter_folder(train(None, out, resume=resume, stop_after=stop_after, progress=progress, log=log),
                                   log)
    overrides = dict(overrides or {})
    text = data is None and "corpus" in {name for _, name in override_keys(overrides)}
    if source is None or (data is None and not text):
        raise TinyLMError("fine-tuning needs a model to start from (--from RUN) and what to learn: conversations "
                          "(--data FILE or --data tasks:NAME) or text (--corpus)")
    check_settings(overrides, epochs, text=text)  # before anything is read or imported
    base = starting_checkpoint(source, out, force=force, log=log)
    if text:  # continued pretraining on a corpus, read with the model's own tokenizer
        config = text_recipe(base.config, overrides)
        return with_adapter_folder(train(config, out, init_from=base.path, force=force, stop_after=stop_after,
                                         progress=progress, log=log), log)
    tokenizer = with_chat_tokens(base.tokenizer)
    train_part, val_part, name = conversations_of(data, val_data, val_fraction, base.config.train.seed)
    splits = {"train": train_part, "val": val_part}
    folder = Path(data_dir) if data_dir is not None else Path("data") / f"chats-{out.name}-{chats_fingerprint(splits)[:8]}"
    shards = prepare_chats(splits, tokenizer, folder, block_size=base.config.model.block_size, source=name)
    config = recipe(base.config, tokenizer.vocab_size, epoch_rows(shards, base.config), folder, epochs,
                    overrides or {})
    if needs_new_rows(config.train) and tokenizer.vocab_size > base.tokenizer.vocab_size:  # the chat markers' rows
        config = dataclasses.replace(config, train=dataclasses.replace(
            config.train, lora_new_tokens=tokenizer.vocab_size - base.tokenizer.vocab_size))
    cut = sum(shards.meta["chats"][s]["cut"] for s in ("train", "val"))
    log(f"conversations: {len(splits['train']):,} to train on, {len(splits['val']):,} held out ({name}); "
        f"{shards.meta['chats']['train']['trained_tokens']:,} of {shards.num_tokens('train'):,} training tokens are "
        f"the assistant's (the rest are read, not learned)"
        + (f"; {cut} longer than the context were cut to {config.model.block_size + 1} tokens" if cut else ""))
    if tokenizer.vocab_size == base.tokenizer.vocab_size and config.train.lora_rank:
        init = base.path  # nothing to grow: the adapter's base is the model itself, not a copy of it
    else:
        init = grown_init(base, tokenizer, config, folder / INIT_FOLDER)
    return with_adapter_folder(train(config, out, init_from=init, force=force, stop_after=stop_after, progress=progress,
                                     log=log), log)


def with_adapter_folder(result: RunResult, log: Callable[[str], None]) -> RunResult:
    """A LoRA run's adapter also in PEFT's layout, in the run folder's ``adapter/`` (its best checkpoint's, else its
    latest's), for ``PeftModel.from_pretrained`` on the base's Hugging Face export; ``result`` as it was."""
    from tinylm.export.peft import export_peft

    folder = Path(result.run_dir)
    if not (folder / CONFIG_FILE).is_file() or not build_config(load_config_file(folder / CONFIG_FILE)).train.lora_rank:
        return result
    try:
        where = export_peft(folder, folder / ADAPTER_FOLDER, overwrite=True)
        log(f"adapter, in PEFT's layout: {where} (PeftModel.from_pretrained on the base's Hugging Face export)")
    except TinyLMError as e:  # a model no Hugging Face architecture computes: the run itself is fine
        log(f"no PEFT copy of the adapter: {e}")
    return result


def starting_checkpoint(source: str | os.PathLike, out: Path, *, force: bool, log: Callable[[str], None]) -> Checkpoint:
    """The checkpoint fine-tuning starts from: a run's best (else latest), a checkpoint folder, or a Hugging Face
    model folder imported into ``<out>.base`` first."""
    path = Path(source)
    if not path.exists():
        raise TinyLMError(f"--from {path}: no such run, checkpoint or model folder")
    if (path / "config.json").is_file() and not (path / RUN_FILE).exists():
        from tinylm.export import import_hf_into_run

        imported = out.with_name(out.name + ".base")
        log(f"importing the Hugging Face model {path} into {imported}")
        path = import_hf_into_run(path, imported, force=force)
    if (path / RUN_FILE).exists():
        best = checkpoint_path(path, "best")
        path = best if has_checkpoint(best) else checkpoint_path(path, "latest")
    checkpoint = load_checkpoint(path)
    if checkpoint.config.model.family == "ngram":
        raise TinyLMError(f"--from {source} is an n-gram model: it counts, it cannot be fine-tuned; start from a "
                          "network's run")
    return checkpoint


def conversations_of(data: str, val_data: str | None, val_fraction: float, seed: int) -> tuple[list, list, str]:
    """(training conversations, held-out ones, a name for them): a JSONL file split by ``seed`` (or ``val_data``
    held out), or built-in tasks with their own held-out items."""
    if data.startswith("tasks:"):
        names = parse_task_spec(data)
        train_items = [item.conversation() for n in names for item in make_task(n, TASK_ITEMS["train"], seed, "train")]
        val_items = [item.conversation() for n in names for item in make_task(n, TASK_ITEMS["val"], seed, "test")]
        if val_data is not None:
            val_items = read_conversations(val_data)
        return train_items, val_items, data
    conversations = read_conversations(data)
    if val_data is not None:
        return conversations, read_conversations(val_data), Path(data).name
    train_part, val_part = split_conversations(conversations, val_fraction, seed)
    return train_part, val_part, Path(data).name


def epoch_rows(shards: ShardSet, config: Config) -> float:
    """How many rows of ``block_size`` positions one epoch of the training conversations packs into (the first
    epoch's; the others differ by their order's last few rows): a step's worth is batch_size * grad_accum."""
    block_size = config.model.block_size
    source = BatchSource(shards, mode="chats", batch_size=1, block_size=block_size,
                         seed=config.train.seed, bos_id=0, pad_id=0, pack=config.model.family == "gpt")
    return len(source.packed_epoch(0)) * source.chat_width / block_size


def recipe(base: Config, vocab_size: int, n_rows: float, data_dir: Path, epochs: float | None,
           overrides: Mapping[str, Any]) -> Config:
    """The fine-tuning configuration: the base model with ``vocab_size`` ids, its [train] settings with the
    fine-tuning changes (module docstring), then ``overrides`` ([train] settings, values or text as flags give
    them: parsed and checked as `tinylm train` checks its flags)."""
    cfg = base.to_dict()
    cfg["model"]["vocab_size"] = vocab_size
    cfg["train"].update({"batch_mode": "chats", "data_dir": str(data_dir), "final_eval_tokens": 0})
    for key in ("tokenizer", "max_tokens", "max_steps"):
        cfg["train"].pop(key, None)
    given = check_settings(overrides, epochs)
    config = build_config(apply_overrides(cfg, overrides))
    tc = config.train
    if not given & {"max_steps", "max_tokens"}:
        per_epoch = n_rows / (tc.batch_size * tc.grad_accum)
        if epochs is None:
            steps = max(math.ceil(DEFAULT_EPOCHS * per_epoch), MIN_STEPS) * (LORA_STEPS if tc.lora_rank else 1)
        else:
            steps = max(1, math.ceil(epochs * per_epoch))
        tc = dataclasses.replace(tc, max_steps=steps)
    if "eval_interval" not in given:
        tc = dataclasses.replace(tc, eval_interval=max(1, (tc.max_steps or 100) // 4))
    if "warmup_steps" not in given:  # a short warmup: the weights are trained already, the new rows are averages
        tc = dataclasses.replace(tc, warmup_steps=min(10, max(1, (tc.max_steps or 100) // 10)))
    return dataclasses.replace(config, train=lora_recipe(tc, config.model, given))


def lora_recipe(tc: TrainConfig, model: GPTConfig, given: set[str]) -> TrainConfig:
    """A LoRA fine-tuning's own defaults where the user gave none: `LORA_LR`, `LORA_STEPS` times the steps (set
    with the budget), and the embedding and the head among the targets (``all,outer``) when they are two tables (a tied head is left out: one correction to
    it would split the two).

    Measured with ``benchmarks/lora_tasks.py`` on the built-in tasks: with the embedding and head frozen, no
    rank or rate passed 10% exact match on tasks:add (rank 128 included, the loss stuck near 0.8) where full
    fine-tuning reached 100%, since numbers and letters are tokens a Shakespeare model's tables never learnt;
    with them, rank 64 reached 99.5%. The base's own rate (3e-2 for the default run) and 1e-2 sent the head's
    correction off (no reply ended); 1e-3 learnt more slowly. At rank 32 the default 250 steps reached 43%,
    500 94%. A LoRA step of the default model costs about what a full one does on a CPU (its embedding and
    head, a third of it, still run backward), so there this budget takes about twice full fine-tuning's
    time; at GPT-2's shape a LoRA step costs 0.55-0.69x of a full one (benchmarks/lora_memory.py)."""
    if not tc.lora_rank:
        return tc
    if "lr" not in given:
        tc = dataclasses.replace(tc, lr=LORA_LR)
    if "lora_targets" not in given and not model.tie_embeddings:
        tc = dataclasses.replace(tc, lora_targets="all,outer")
    return tc


def needs_new_rows(tc: TrainConfig) -> bool:
    """Whether a LoRA run must train the rows of the tokens fine-tuning adds (`tinylm.model.lora.NewRows`): yes
    unless its targets correct the embedding and the head already, whose low-rank corrections reach every row."""
    return bool(tc.lora_rank) and not set(LORA_OUTER) <= set(lora_target_names(tc.lora_targets))


def text_recipe(base: Config, overrides: Mapping[str, Any]) -> Config:
    """Fine-tuning on text (``--corpus``): the base's own settings, its tokenizer, a short warmup and `MIN_STEPS`
    steps unless a budget is given, then ``overrides``."""
    cfg = base.to_dict()
    for key in ("tokenizer", "max_tokens", "max_steps", "data_dir"):
        cfg["train"].pop(key, None)
    if cfg["train"].get("batch_mode") == "chats":
        cfg["train"]["batch_mode"] = "packed"
    given = check_settings(overrides, None, text=True)
    config = build_config(apply_overrides(cfg, overrides))
    tc = config.train
    if not given & {"max_steps", "max_tokens"}:
        tc = dataclasses.replace(tc, max_steps=MIN_STEPS * (LORA_STEPS if tc.lora_rank else 1))
    if "warmup_steps" not in given:
        tc = dataclasses.replace(tc, warmup_steps=min(10, max(1, (tc.max_steps or 100) // 10)))
    if "eval_interval" not in given:
        tc = dataclasses.replace(tc, eval_interval=max(1, (tc.max_steps or 100) // 4))
    return dataclasses.replace(config, train=lora_recipe(tc, config.model, given))


def check_settings(overrides: Mapping[str, Any], epochs: float | None, *, text: bool = False) -> set[str]:
    """The [train] settings ``overrides`` names, refusing those fine-tuning sets itself (its data, its tokenizer)
    and a budget given two ways. ``text``: fine-tuning on a corpus, whose settings are then the user's."""
    given = {name for _, name in override_keys(overrides)}
    if epochs is not None and given & {"max_steps", "max_tokens"}:
        raise TinyLMError("give the budget one way: --epochs, --max-steps or --max-tokens")
    if text:
        if epochs is not None:
            raise TinyLMError("--epochs counts passes over conversations; for a corpus give --max-steps or --max-tokens")
        own = given & {"tokenizer", "tokenizer_kind", "tokenizer_vocab_size", "tokenizer_pattern"}
        if own:
            raise TinyLMError(f"fine-tuning reads the corpus with the model's own tokenizer: drop "
                              f"{', '.join('--' + k.replace('_', '-') for k in sorted(own))}")
        return given
    corpus = given & {"batch_mode", "tokenizer", "corpus", "glob", "text_field", "encoding", "errors", "tokenizer_kind",
                      "tokenizer_vocab_size", "tokenizer_pattern", "data_dir", "val_fraction"}
    if corpus:
        raise TinyLMError(f"fine-tuning reads conversations (--data) with the model's own tokenizer: drop "
                          f"{', '.join('--' + k.replace('_', '-') for k in sorted(corpus))}")
    return given


def grown_init(base: Checkpoint, tokenizer: Any, config: Config, path: Path) -> Path:
    """The starting weights with a row for each new token id (`grow_vocabulary`), saved as a checkpoint at ``path``
    with the chat tokenizer, for `train`'s ``init_from``."""
    state = grow_vocabulary(base.model_state(), tokenizer.vocab_size)
    if has_checkpoint(path):  # made before from the same data: keep it (a LoRA run's base may be this very folder)
        try:
            made = load_checkpoint(path)
            kept = made.model_state()
            if (made.tokenizer.fingerprint() == tokenizer.fingerprint() and made.config.model == config.model
                    and kept.keys() == state.keys() and all(torch.equal(kept[k], state[k]) for k in state)):
                return path
        except TinyLMError:
            pass  # damaged or another model's: written again below
    return save_checkpoint(path, model_state=state, optimizer_state=None, rng_state={}, state={"step": 0},
                           config=config, tokenizer=tokenizer)


__all__ = ["finetune", "recipe", "starting_checkpoint", "conversations_of"]
