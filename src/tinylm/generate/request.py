"""One request's rules, the same whoever decodes it: the engine (`generate`, `stream`, `Engine`), speculative
decoding (`speculative_events`) and the server's scheduler all read them from a `RequestRules`.

- **The prompts.** Token ids: every prompt at least one, every id in the vocabulary (the model's output ids; in
  the server the tokenizer's, since it turns prompts back into text). A prompt longer than the context is, by
  the caller's ``long_prompts``: read whole (``"slide"``: the engine's window slides as it generates), cut to
  its last block_size tokens with one warning line (``"cut"``: `tinylm.generate.steps.fit_prompt`, in
  `generate`, `stream` and speculative decoding), or refused unless it holds its ``max_new_tokens`` beside it
  (``"refuse"``: the server's batches never slide; its API cut the prompt to fit beforehand).
- **The stop ids.** The request's own (``SamplingParams.stop_ids``), else the tokenizer's
  (`tinylm.tokenizers.base.default_stop_ids`: EOS and the end-of-turn tokens). Stop strings need a tokenizer.
- **The excluded mask** (`tinylm.generate.sampling.excluded_mask`): the ids no sample draws (past the
  vocabulary, padding, BOS, reserved ids, <unk>), never a stop id. One per set of stop ids, kept: the server's
  rows of requests with the same stop ids share one tensor, so a step masks the whole batch at once.

    rules = RequestRules(model, tokenizer)
    request = rules.prepare([ids], params, long_prompts="cut")  # .prompts, .warnings, .stop_ids, .excluded
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor, nn

from tinylm.errors import TinyLMError
from tinylm.generate.sampling import SamplingParams, excluded_mask
from tinylm.generate.steps import fit_prompt
from tinylm.tokenizers.base import Tokenizer, default_stop_ids

LongPrompts = Literal["slide", "cut", "refuse"]


@dataclass(frozen=True)
class PreparedRequest:
    """A request as the rules read it: its prompts, the warning lines of the ones cut to fit, its stop ids."""

    prompts: list[list[int]]
    warnings: list[str]
    stop_ids: frozenset[int]
    rules: RequestRules = field(repr=False)

    @property
    def excluded(self) -> Tensor | None:
        """(V,) True at the ids no sample draws, or None where there are none (made on first use, then kept)."""
        return self.rules.excluded(self.stop_ids)

    def draft_mask(self) -> Tensor:
        """`excluded` as a tensor even where it leaves nothing out: a draft fits its logits to its width."""
        excluded = self.excluded
        if excluded is None:
            return torch.zeros(self.rules.width, dtype=torch.bool, device=self.rules.device)
        return excluded


class RequestRules:
    """The rules of the requests to one model (module docstring).

    ``prompt_vocab``: the vocabulary prompt ids must lie in, the model's output ids or the tokenizer's;
    ``limit``: the ids from which on no sample draws (default: the tokenizer's vocabulary, `excluded_mask`).
    """

    def __init__(self, model: nn.Module, tokenizer: Tokenizer | None, *,
                 prompt_vocab: Literal["model", "tokenizer"] = "model", limit: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.block_size: int = model.config.block_size
        self.width: int = model.config.vocab_size  # the model's output ids
        self.device = next(model.parameters()).device
        self.limit = limit
        if prompt_vocab == "tokenizer":
            self.vocab_size, self._vocab_name = tokenizer.vocab_size, "the vocabulary"
        else:
            self.vocab_size, self._vocab_name = self.width, "the model's vocabulary"
        self._masks: dict[frozenset[int], Tensor | None] = {}

    def prepare(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                long_prompts: LongPrompts = "slide") -> PreparedRequest:
        """The request's stop ids and its prompts, checked and fitted to the context; the mask on first use."""
        stop_ids = self.stop_ids(params)
        kept, warnings = self.prompts(prompts, long_prompts, params.max_new_tokens)
        return PreparedRequest(kept, warnings, stop_ids, self)

    def prompts(self, prompts: Sequence[Sequence[int]], long_prompts: LongPrompts = "slide",
                max_new_tokens: int = 0) -> tuple[list[list[int]], list[str]]:
        """Each prompt's ids as the model reads them, and a warning line for each prompt cut to fit."""
        kept, warnings = [], []
        for i, prompt in enumerate(prompts):
            ids = [int(t) for t in prompt]
            if not ids:
                raise TinyLMError(f"prompt {i} is empty: give at least one token (e.g. a run's start_ids)")
            if any(not 0 <= t < self.vocab_size for t in ids):
                raise TinyLMError(f"prompt {i} holds ids outside {self._vocab_name} 0..{self.vocab_size - 1}")
            if long_prompts == "refuse" and len(ids) + max_new_tokens > self.block_size:
                raise TinyLMError(f"prompt {i} has {len(ids)} tokens; with {max_new_tokens} new ones it "
                                  f"exceeds the model's context of {self.block_size}")
            if long_prompts == "cut":
                ids, warning = fit_prompt(ids, self.block_size)
                if warning is not None:
                    warnings.append(warning)
            kept.append(ids)
        return kept, warnings

    def stop_ids(self, params: SamplingParams) -> frozenset[int]:
        """The ids that end a sample: the request's own, else the tokenizer's."""
        if params.stop and self.tokenizer is None:
            raise TinyLMError("stop strings need a tokenizer to turn tokens into text")
        return frozenset(params.stop_ids if params.stop_ids is not None else default_stop_ids(self.tokenizer))

    def excluded(self, stop_ids: frozenset[int]) -> Tensor | None:
        """(V,) True at the ids no sample draws beside these stop ids, or None; one tensor per set of stop ids
        (any thread may ask: the first one kept is the one every later request gets)."""
        if stop_ids not in self._masks:
            mask = excluded_mask(self.tokenizer, self.width, stop_ids, self.device, self.limit)
            self._masks.setdefault(stop_ids, mask)
        return self._masks[stop_ids]
