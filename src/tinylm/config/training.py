"""The [train] table: `TrainConfig`, how a model is trained.

Data, optimizer, schedule, budget, evaluation, logging and device, one field each with its help
beside it (what `tinylm train --help` prints for its flag):

    TrainConfig(lr=2e-3, max_tokens=20_000_000, optimizer="muon")
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from tinylm.config.fields import check_fields, did_you_mean, setting
from tinylm.errors import TinyLMError

TokenizerKind = Literal["bpe", "char", "word"]
DecodeErrors = Literal["strict", "replace", "ignore"]
BatchMode = Literal["packed", "documents", "chats"]
OptimizerKind = Literal["adamw", "sgd", "muon"]
DecayKind = Literal["cosine", "linear", "constant", "wsd"]
DecayShape = Literal["linear", "1-sqrt"]
MuonAdjustLR = Literal["original", "match_rms_adamw"]
DtypeKind = Literal["auto", "float32", "bfloat16"]
ParallelKind = Literal["ddp", "fsdp"]
WandbMode = Literal["offline", "online"]
# where [train] log_to may send the metrics rows; metrics.jsonl ("jsonl") is always written
LOG_BACKENDS = ("jsonl", "tensorboard", "wandb")

# the matrices LoRA may correct (`tinylm.model.lora`), by their names in a Transformer's blocks, and the groups
LORA_ATTENTION = ("W_q", "W_k", "W_v", "W_o")
LORA_MLP = ("W_1", "W_2", "W_3")
LORA_OUTER = ("E", "lm_head")  # the token embedding and the output head, outside the blocks
LORA_TARGET_GROUPS = {"attention": LORA_ATTENTION, "mlp": LORA_MLP, "all": LORA_ATTENTION + LORA_MLP,
                      "outer": LORA_OUTER}


def lora_target_names(targets: str) -> tuple[str, ...]:
    """The projection names a lora_targets setting means, in a fixed order ("attention,W_1" -> W_q, W_k, W_v, W_o,
    W_1)."""
    known = LORA_ATTENTION + LORA_MLP + LORA_OUTER
    wanted: set[str] = set()
    for word in (w.strip() for w in targets.split(",")):
        if word in LORA_TARGET_GROUPS:
            wanted.update(LORA_TARGET_GROUPS[word])
        elif word in known:
            wanted.add(word)
        else:
            raise TinyLMError(f"lora_targets: unknown target {word!r}{did_you_mean(word, [*LORA_TARGET_GROUPS, *known])}; "
                              f"use attention, mlp, all, or projection names ({', '.join(known)}), comma-separated")
    return tuple(n for n in known if n in wanted)


@dataclass
class TrainConfig:
    """How a model is trained: data, optimizer, schedule, budget, evaluation, device.

    Each field's help is beside it (it is also what `tinylm train --help` prints). A field that may
    be unset (``X | None``) defaults to None, because TOML has no null: the saved configuration
    leaves such a field out, and reading it back must give None again.

    The batch is counted in sequences of ``model.block_size`` tokens: one optimizer step sees
    ``batch_size * grad_accum`` sequences, whatever the number of processes (with ``torchrun``,
    each of W processes takes ``batch_size / W`` rows of every micro-batch). With ``short_block_size``
    (packed batches), the steps before the last ``long_fraction`` of them see ``block_size /
    short_block_size`` times as many sequences of ``short_block_size`` tokens: the same tokens a step.
    """

    # -- data
    corpus: str = setting("shakespeare",
        "a built-in corpus (shakespeare, stdlib) or a path to a text file, a folder or a .jsonl file")
    glob: str | None = setting(None,
        "for a folder corpus: which files to read (default **/*.txt)")
    text_field: str = setting("text", "for a JSONL corpus: the field that holds the text")
    encoding: str = setting("utf-8",
        "the text encoding of a local corpus's files, any Python codec name (latin-1, cp1252, utf-16, ...); "
        "the built-in corpora are UTF-8")
    errors: DecodeErrors = setting("strict",
        "corpus bytes that are not valid in the encoding: stop naming the file and offset (strict), replace "
        "them with U+FFFD, or drop them (ignore)")
    tokenizer: str | None = setting(None,
        "a tinylm tokenizer JSON file to use; unset: train one on the corpus (see tokenizer_kind)")
    tokenizer_kind: TokenizerKind = setting("bpe", "the tokenizer to train when none is given")
    tokenizer_vocab_size: int = setting(2048,
        "|V| of the tokenizer to train (bpe, word; a char tokenizer takes every character it sees)")
    tokenizer_pattern: str = setting("gpt4", "bpe split pattern: gpt2, gpt4 or a regex")
    data_dir: str | None = setting(None,
        "where the token shards go; unset: data/<corpus>-<tokenizer> (reused on the next run)")
    val_fraction: float = setting(0.1, "share of the corpus's documents held out for validation")
    batch_mode: BatchMode = setting("packed",
        "packed: random windows of the token stream; documents: one document per row, truncated or padded; "
        "chats: one conversation per row, the loss on what the assistant writes (`tinylm finetune` sets it)")
    # -- batch and budget
    batch_size: int = setting(32, "sequences per micro-batch, summed over all processes")
    grad_accum: int = setting(1, "micro-batches per optimizer step (gradient accumulation)")
    max_steps: int | None = setting(None,
        "optimizer steps to train; with max_tokens too, whichever budget is smaller wins")
    max_tokens: int | None = setting(None,
        "training tokens to see, rounded up to whole steps of batch_size * grad_accum * block_size")
    # -- sequence-length schedule
    short_block_size: int = setting(0,
        "packed batches: train on windows of this many tokens (it must divide block_size), block_size / "
        "short_block_size times as many rows so that a step's tokens stay the same, except in the last long_fraction "
        "of the steps, which train at the model's block_size; 0: every step at block_size")
    long_fraction: float = setting(0.2,
        "with short_block_size: the share of all steps, at the end, that train on windows of block_size")
    # -- optimizer and schedule
    optimizer: OptimizerKind = setting("adamw",
        "adamw, sgd (with momentum), or muon (torch.optim.Muon for the blocks' weight matrices, AdamW for the "
        "rest: embeddings, head, norms)")
    lr: float = setting(1e-3,
        "the peak learning rate, reached at the end of warmup (with muon: of the AdamW groups)")
    muon_lr: float = setting(0.02,
        "with muon: the peak learning rate of the blocks' weight matrices")
    muon_momentum: float = setting(0.95, "with muon: Muon's (Nesterov) momentum")
    muon_momentum_warmup: int = setting(0,
        "with muon: steps over which Muon's momentum rises linearly from 0.85 to muon_momentum (0: none)")
    muon_adjust_lr: MuonAdjustLR = setting("original",
        "with muon: how the update is scaled for a matrix's shape: original (sqrt(max(1, rows/cols)), Keller "
        "Jordan's) or match_rms_adamw (0.2 sqrt(max(rows, cols)), Moonshot's)")
    muon_weight_decay: float | None = setting(None,
        "with muon: the Muon matrices' decoupled weight decay; unset: weight_decay")
    embed_lr: float | None = setting(None,
        "the peak learning rate of the embedding tables (token, position, value and bigram embeddings); "
        "unset: lr")
    head_lr: float | None = setting(None,
        "the peak learning rate of an untied output head; unset: lr")
    min_lr: float | None = setting(None, "the learning rate at the last step; unset: lr / 10")
    warmup_steps: int = setting(100, "steps of linear warmup from lr / warmup_steps to lr")
    decay: DecayKind = setting("cosine",
        "after warmup, from lr down to min_lr at the last step: cosine, linear, constant, or wsd (warmup-stable-"
        "decay: lr held, then decay_shape down to min_lr over the last decay_fraction of the steps)")
    decay_fraction: float = setting(0.2,
        "with wsd: the share of all steps, at the end, over which the rate decays")
    decay_shape: DecayShape = setting("linear",
        "with wsd: the decay's shape, linear or 1-sqrt (lr * (1 - sqrt(p)), which drops fastest at first)")
    weight_decay: float = setting(0.1,
        "decoupled weight decay (AdamW) or L2 (SGD), on matrices and embeddings only, never on norms and biases")
    beta1: float = setting(0.9, "AdamW's first-moment decay")
    beta2: float = setting(0.95, "AdamW's second-moment decay")
    momentum: float = setting(0.9, "SGD's momentum")
    grad_clip: float = setting(1.0,
        "clip the gradient's global norm to this; 0 turns clipping off")
    seed: int = setting(1337, "seeds the initial weights, the batches and dropout")
    # -- LoRA: train a low-rank correction to some matrices, the rest frozen (fine-tuning from --init-from)
    lora_rank: int = setting(0,
        "LoRA's rank r: train A (r x d_in) and B (d_out x r) beside each target matrix W, computing with "
        "W + (lora_alpha / r) B A, every other weight frozen; 0: train every weight")
    lora_alpha: float | None = setting(None,
        "LoRA's alpha: the correction is scaled by lora_alpha / lora_rank; unset: 2 * lora_rank")
    lora_dropout: float = setting(0.0, "dropout on the input of LoRA's correction (training only)")
    lora_new_tokens: int = setting(0,
        "with lora_rank: the last this many token ids (chat tokens fine-tuning added) train their embedding and "
        "output-head rows too, as the adapter's; tinylm finetune sets it")
    lora_targets: str = setting("all",
        "the matrices LoRA corrects: attention (W_q, W_k, W_v, W_o), mlp (W_1, W_2, W_3), all (both), outer (the "
        "token embedding E and the untied head lm_head), or names, comma-separated (e.g. W_q,W_v or all,outer); "
        "tinylm finetune makes it all,outer unless given")
    lora_b_lr_ratio: float = setting(1.0,
        "with lora_rank: B's learning rate over A's (LoRA+, Hayou et al. 2024, suggest 16: B starts at zero and "
        "learns slowly at A's rate); 1: one rate for both")
    # -- evaluation, checkpoints, logging
    eval_interval: int = setting(250, "evaluate on the validation split every this many steps")
    eval_tokens: int = setting(65536,
        "tokens per periodic evaluation (evenly spaced windows of the split); 0: the whole split")
    final_eval_tokens: int = setting(0,
        "tokens for the evaluation at the end; 0: the whole validation split")
    eval_batch_size: int | None = setting(None,
        "sequences per evaluation batch; unset: batch_size")
    checkpoint_interval: int | None = setting(None,
        "save checkpoints/latest every this many steps; unset: at every evaluation (and always at the end)")
    log_interval: int = setting(10,
        "steps between metrics.jsonl lines (and progress lines when the output is not a terminal)")
    # log_to, not log: torchrun reads a prefix of its own --log-dir in `--log`, so `torchrun ... -m tinylm train
    # --log X` would stop at torchrun's "ambiguous option" before tinylm saw it
    log_to: str = setting("jsonl",
        "where the metrics go besides metrics.jsonl (always written): jsonl (nowhere else), tensorboard (event files "
        "in the run's tensorboard/), wandb (a Weights & Biases run), or several comma-separated, e.g. "
        "tensorboard,wandb; each needs its extra: pip install -e '.[tensorboard]' or '.[wandb]'")
    wandb_project: str = setting("tinylm", "with --log-to wandb: the W&B project")
    wandb_mode: WandbMode = setting("offline",
        "with --log-to wandb: offline (written under the run's wandb/, no account or network; `wandb sync` uploads it "
        "later) or online")
    # -- hardware
    device: str = setting("auto",
        "auto (cuda when there is a GPU, else cpu), cpu, cuda, cuda:N or mps")
    dtype: DtypeKind = setting("auto",
        "auto: bfloat16 autocast where the hardware multiplies bfloat16 natively (a GPU that has it, a CPU with "
        "AVX512-BF16 or AMX), float32 elsewhere; or float32, bfloat16")
    compile: bool = setting(False, "torch.compile the model (worth it on a GPU)")
    threads: int | None = setting(None,
        "CPU threads per process; unset: the cores free now (busy ones left out), divided among the processes "
        "of this machine")
    parallel: ParallelKind = setting("ddp",
        "under torchrun: ddp (replicate the model) or fsdp (shard weights, gradients and optimizer state)")
    # -- the sample printed at the end
    sample_tokens: int = setting(200, "tokens of text to generate at the end (0: none)")
    sample_temperature: float = setting(0.8, "temperature of that sample (0: greedy)")
    sample_top_k: int = setting(40, "sample from the k most likely tokens only; 0: from all")

    def __post_init__(self) -> None:
        check_fields(self)
        for name in ("tokenizer_vocab_size", "batch_size", "grad_accum", "eval_interval", "log_interval"):
            if getattr(self, name) <= 0:
                raise TinyLMError(f"{name} must be a positive integer, got {getattr(self, name)}")
        for name in ("max_steps", "max_tokens", "eval_batch_size", "checkpoint_interval", "threads"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise TinyLMError(f"{name} must be a positive integer (or left unset), got {getattr(self, name)}")
        for name in ("warmup_steps", "eval_tokens", "final_eval_tokens", "sample_tokens", "sample_top_k"):
            if getattr(self, name) < 0:
                raise TinyLMError(f"{name} must be 0 or more, got {getattr(self, name)}")
        if not 0 <= self.seed < 2**63:  # numpy's and torch's generators take no negative seeds
            raise TinyLMError(f"seed must be an integer from 0 to 2**63 - 1, got {self.seed}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise TinyLMError(f"lr must be a positive number, got {self.lr}")
        if self.min_lr is not None and not 0 <= self.min_lr <= self.lr:
            raise TinyLMError(f"min_lr must be between 0 and lr ({self.lr}), got {self.min_lr}")
        for name in ("muon_lr", "embed_lr", "head_lr"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise TinyLMError(f"{name} must be a positive number, got {value}")
        if not 0.0 < self.decay_fraction <= 1.0:
            raise TinyLMError(f"decay_fraction is a share of the steps in (0, 1], got {self.decay_fraction}")
        if self.short_block_size < 0:
            raise TinyLMError(f"short_block_size must be 0 (no schedule) or a number of tokens that divides "
                              f"block_size, got {self.short_block_size}")
        if not 0.0 <= self.long_fraction <= 1.0:
            raise TinyLMError(f"long_fraction is a share of the steps in [0, 1], got {self.long_fraction}")
        if self.muon_momentum_warmup < 0:
            raise TinyLMError(f"muon_momentum_warmup must be 0 or more, got {self.muon_momentum_warmup}")
        for name in ("beta1", "beta2", "momentum", "muon_momentum"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise TinyLMError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.muon_weight_decay is not None and not (math.isfinite(self.muon_weight_decay)
                                                       and self.muon_weight_decay >= 0):
            raise TinyLMError(f"muon_weight_decay must be 0 or a positive number, got {self.muon_weight_decay}")
        for name in ("weight_decay", "grad_clip", "sample_temperature"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise TinyLMError(f"{name} must be 0 or a positive number, got {getattr(self, name)}")
        if not 0.0 < self.val_fraction < 1.0:
            raise TinyLMError(f"val_fraction must be strictly between 0 and 1 (training needs a validation split), "
                              f"got {self.val_fraction}")
        if self.lora_rank < 0:
            raise TinyLMError(f"lora_rank must be 0 (train every weight) or a positive rank, got {self.lora_rank}")
        if self.lora_new_tokens < 0:
            raise TinyLMError(f"lora_new_tokens must be 0 or more, got {self.lora_new_tokens}")
        if self.lora_alpha is not None and not (math.isfinite(self.lora_alpha) and self.lora_alpha > 0):
            raise TinyLMError(f"lora_alpha must be a positive number, got {self.lora_alpha}")
        if not (math.isfinite(self.lora_b_lr_ratio) and self.lora_b_lr_ratio > 0):
            raise TinyLMError(f"lora_b_lr_ratio must be a positive number, got {self.lora_b_lr_ratio}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise TinyLMError(f"lora_dropout must be in [0, 1), got {self.lora_dropout}")
        lora_target_names(self.lora_targets)  # an unknown target is an error now, not when training starts
        self.log_backends  # an unknown name is an error now, not when the run starts

    @property
    def final_lr(self) -> float:
        """min_lr, or lr / 10 when it is unset."""
        return self.lr / 10 if self.min_lr is None else self.min_lr

    def check_windows(self, block_size: int) -> None:
        """Refuse a sequence-length schedule that does not fit the model's ``block_size`` (packed batches only:
        document and chat rows are one document or conversation each, always ``block_size`` long)."""
        short = self.short_block_size
        if not short or self.batch_mode != "packed":
            return
        if short > block_size:
            raise TinyLMError(f"short_block_size {short} is longer than block_size {block_size}: the short windows "
                              f"must be at most block_size (e.g. {block_size // 4 or 1}), or 0 for every step at "
                              "block_size")
        if block_size % short:
            divisors = [d for d in (block_size // 8, block_size // 4, block_size // 2) if d and block_size % d == 0]
            hint = f" (e.g. {' or '.join(map(str, divisors))})" if divisors else ""
            raise TinyLMError(f"short_block_size {short} must divide block_size {block_size}, so that a short step's "
                              f"rows hold the same tokens as a long step's{hint}; 0 trains every step at block_size")

    @property
    def log_backends(self) -> tuple[str, ...]:
        """The backends ``log_to`` names, each once, "jsonl" first: ``"wandb, tensorboard"`` gives
        ``("jsonl", "wandb", "tensorboard")``, and ``""`` just ``("jsonl",)``."""
        names = [name.strip() for name in self.log_to.split(",") if name.strip()]
        for name in names:
            if name not in LOG_BACKENDS:
                raise TinyLMError(f"log_to: unknown backend {name!r}{did_you_mean(name, LOG_BACKENDS)}; choose from "
                                  f"{', '.join(LOG_BACKENDS)}, several comma-separated (e.g. tensorboard,wandb)")
        return tuple(dict.fromkeys(["jsonl", *names]))
