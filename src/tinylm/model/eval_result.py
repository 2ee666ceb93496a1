"""What an evaluation measured: a language model's loss, perplexity and bits per byte on a text.

One result type for every model family. `tinylm.evaluate` fills it for a network scored in windows
(`tinylm.evaluate.evaluate_tokens`); an n-gram model fills it with its own scorer
(`tinylm.model.ngram.NGramModel.evaluate`), the whole text in one piece and no windows. It lives
beside the models so that the n-gram model, which sits below `tinylm.evaluate`, can return it too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class EvalResult:
    """Sums and their ratios for one evaluation; ``window_losses`` are the per-window sums (nats) over the
    ``window_tokens`` targets each window scored."""

    split: str
    loss_sum: float  # total -log p over every target, in nats (inf if some target had p = 0)
    tokens: int  # targets evaluated
    bytes: float  # UTF-8 bytes those targets stand for (prorated when not the whole split)
    prorated: bool  # True when only part of the split was evaluated
    window_starts: np.ndarray = field(repr=False)
    window_losses: np.ndarray = field(repr=False)
    window_tokens: np.ndarray = field(repr=False)
    seconds: float = 0.0  # how long the evaluation took
    unknown_tokens: int = 0  # <unk> targets among them
    unknown_bytes: float = 0.0  # the bytes those stand for, charged 8 bits each (prorated like bytes)
    block_size: int | None = None  # the windows' length; None: no windows (an n-gram model)
    stride: int | None = None  # targets from one window's start to the next; block_size: disjoint windows
    scope: str | None = None  # what was scored when it is not a text in windows ("the assistant's tokens of ...")

    @classmethod
    def without_windows(cls, split: str, loss_sum: float, tokens: int, n_bytes: float) -> EvalResult:
        """A whole text scored in one piece, as an n-gram model scores it: one span from target 0, no windows."""
        return cls(split, loss_sum, tokens, float(n_bytes), False, np.zeros(1, dtype=np.int64),
                   np.array([loss_sum]), np.array([tokens]))

    @property
    def loss(self) -> float:
        """Mean next-token cross-entropy, nats per token."""
        return self.loss_sum / self.tokens

    @property
    def perplexity(self) -> float:
        return math.inf if self.loss > 700 else math.exp(self.loss)  # exp overflows a float past ~709

    @property
    def bits_per_byte(self) -> float:
        """(loss_sum / ln 2 + 8 x unknown_bytes) / bytes: the text's code length per byte, tokenizer-independent
        (`tinylm.evaluate`'s docstring)."""
        return (self.loss_sum / math.log(2) + 8 * self.unknown_bytes) / self.bytes

    @property
    def windows(self) -> str:
        """How the text was cut: "disjoint" windows, "sliding" ones (stride < block_size), or "none" (n-gram)."""
        if self.block_size is None:
            return "none"
        return "disjoint" if self.stride == self.block_size else "sliding"

    def describe_windows(self) -> str:
        """The windows in words, for a report: "sliding windows of 32 tokens, stride 8"."""
        if self.scope is not None:
            return self.scope
        if self.windows == "none":
            return "an n-gram's own context, no windows"
        if self.windows == "disjoint":
            return f"disjoint windows of {self.block_size} tokens"
        return f"sliding windows of {self.block_size} tokens, stride {self.stride}"

    def report(self) -> dict[str, Any]:
        """Everything `tinylm eval --json` prints; an infinite loss is the string "inf" (JSON has no infinity)."""
        def number(x: float) -> float | str:
            return x if math.isfinite(x) else "inf"

        return {"text": self.split, "loss": number(self.loss), "perplexity": number(self.perplexity),
                "bits_per_byte": number(self.bits_per_byte), "tokens": self.tokens,
                "bytes": self.bytes if self.prorated else round(self.bytes),  # a count, unless prorated
                "prorated": self.prorated, "unknown_tokens": self.unknown_tokens,
                "unknown_bytes": self.unknown_bytes if self.prorated else round(self.unknown_bytes),
                "windows": self.windows, "block_size": self.block_size, "stride": self.stride,
                "seconds": self.seconds}

    def as_dict(self, prefix: str = "val_") -> dict[str, float | int | bool]:
        """The numbers for a metrics log line."""
        return {f"{prefix}loss": self.loss, f"{prefix}ppl": self.perplexity, f"{prefix}bpb": self.bits_per_byte,
                f"{prefix}tokens": self.tokens, f"{prefix}prorated": self.prorated}
