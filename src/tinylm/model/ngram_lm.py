"""An n-gram model behind the neural models' interface, so one engine samples and serves all three.

`tinylm.model.ngram.NGramModel` is numpy through and through: counts, a smoothing chain,
vectorised scoring. Generation in tinylm (the engine, its samplers, streaming, stop strings,
batches, beam search, the server) speaks to a model through ``model(idx, kv_cache=...) ->
(logits, loss)``. `NGramLM` is that adapter: the "logits" at position t are the n-gram's
log-probabilities ``log p(. | the n-1 tokens up to t)``, and its "cache" is each row's token
history (`TokenHistory`), of which only the last n-1 tokens are ever read.

Two differences from the raw distributions, both for generating text:

- BOS gets log-probability -inf, and so do the ids in ``never`` (a run passes every special
  token but EOS: PAD, reserved ids): they are padding and markers, never text. (Smoothing gives
  them a sliver of the uniform share; scoring with `NGramModel.score` keeps it.)
- There is no context window: the model reads only the last n-1 tokens, so its ``block_size``
  is unbounded (`NGRAM_CONTEXT`), and the engine never cuts a long text and restarts it.
- A token the model gives probability 0 (pure maximum likelihood) has logit -inf, and a
  sampler never draws it.

Cost: a prompt of T tokens gives T x |V| log-probabilities, as a network's logits do (the server
reads them all for ``echo`` with ``logprobs``); a prompt of 50,000 tokens at |V| = 4096 takes
about 0.8 GB. Generation itself reads only the last n-1 tokens.

Evaluation does not go through this adapter: `NGramModel.evaluate` scores a whole split in a few
vectorised passes, with the context restarting after each EOS exactly as in counting.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor, nn

from tinylm.config import GPTConfig
from tinylm.model.cursor import CacheCursor
from tinylm.model.head_loss import next_token_loss
from tinylm.model.ngram import NGramModel


NGRAM_CONTEXT = 1 << 30  # the "context window" of an n-gram for the engine: never reached


class TokenHistory(CacheCursor):
    """The n-gram's "KV cache": the tokens each row has read (the engine's cache interface)."""

    def __init__(self, batch: int, max_len: int) -> None:
        super().__init__(max_len)
        self.rows: list[list[int]] = [[] for _ in range(batch)]

    @property
    def nbytes(self) -> int:
        return 0

    def advance(self, steps: int) -> None:
        self._advance(steps)

    def reorder(self, rows: Tensor) -> None:
        self.rows = [list(self.rows[int(r)]) for r in rows.tolist()]

    def reset(self) -> None:
        self.rows = [[] for _ in self.rows]
        self._rewind()


class NGramLM(nn.Module):
    """``NGramModel`` as a module with `GPT`'s forward signature: log-probabilities as logits."""

    def __init__(self, ngram: NGramModel, config: GPTConfig, never: Sequence[int] = ()) -> None:
        super().__init__()
        self.ngram = ngram
        self.config = dataclasses.replace(config, block_size=NGRAM_CONTEXT)
        self.never = sorted({ngram.bos_id, *never})
        # no trainable weights; an empty buffer-like parameter tells callers the device and dtype
        self.anchor = nn.Parameter(torch.zeros(0), requires_grad=False)

    def new_cache(self, batch: int, max_len: int) -> TokenHistory:
        return TokenHistory(batch, max_len)

    def forward(
        self,
        idx: Tensor,
        targets: Tensor | None = None,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        kv_cache: TokenHistory | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Log-probabilities (B, T, |V|) of the token after each position; padding (mask False) is skipped."""
        B, T = idx.shape
        history = kv_cache.rows if kv_cache is not None else [[] for _ in range(B)]
        mask = attention_mask.bool()[:, -T:].tolist() if attention_mask is not None else None
        n_ctx = self.ngram.order - 1
        logp = np.zeros((B, T, self.ngram.vocab_size), dtype=np.float32)
        tokens = idx.tolist()
        with np.errstate(divide="ignore"):
            for b in range(B):
                for t in range(T):
                    if mask is not None and not mask[b][t]:
                        continue
                    history[b].append(tokens[b][t])
                    context = history[b][len(history[b]) - n_ctx:] if n_ctx else []
                    logp[b, t] = np.log(self.ngram.next_token_distribution(context))
        logp[:, :, self.never] = -np.inf
        if kv_cache is not None:
            kv_cache.advance(T)
        logits = torch.from_numpy(logp).to(self.anchor.device)
        loss = None
        if targets is not None:
            loss = next_token_loss(logits, targets)
        return logits, loss
