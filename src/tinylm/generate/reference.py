"""The reference generator: recompute everything at every step, one prompt at a time, no cache.

This is the definition of what the engine must produce, written to be obviously right rather
than fast. To generate one token: run the model on the whole window (`context_start` decides
where the window begins, exactly as in the engine), take the last position's logits, and draw
with the same `sample` function. Stop strings are found the plain way: decode all new tokens
and look for the stop string in the text.

Each new token costs a forward pass over the whole window, so n tokens cost O(n) passes of
growing length (O(n^2) position-steps); the engine's KV cache makes it one position per token.
The tests run both and require the same tokens (and logits within 1e-5): this file is the
oracle for the cache, for batching with padding and for the window policy.

`reference_generate` samples row ``r`` of a call with the same generator the engine gives that
row (`prompt_generators(seed, prompts, n)[r]`), so sampled tokens can be compared too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from tinylm.generate.sampling import SamplingParams, excluded_mask, prompt_generators, sample, token_logprobs
from tinylm.generate.steps import Completion, context_start, warn_window, window_keep
from tinylm.tokenizers.base import Tokenizer, default_stop_ids


@torch.inference_mode()
def reference_generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    tokenizer: Tokenizer | None = None,
) -> list[Completion]:
    """Completions for token-id prompts (``num_samples`` each), as the engine would give them, naively."""
    n_rows = len(prompts) * params.num_samples
    generators = None if params.greedy else prompt_generators(params.seed, len(prompts), params.num_samples,
                                                              next(model.parameters()).device, prompts=prompts)
    out = []
    for r in range(n_rows):
        prompt = prompts[r // params.num_samples]
        generator = [generators[r]] if generators is not None else None
        completion = _one(model, list(prompt), params, tokenizer, generator)
        completion.prompt_index, completion.sample_index = divmod(r, params.num_samples)
        out.append(completion)
    return out


def _one(model: nn.Module, seq: list[int], params: SamplingParams, tokenizer: Tokenizer | None,
         generator: list[torch.Generator] | None) -> Completion:
    block_size = model.config.block_size
    keep = window_keep(params, block_size)
    device = next(model.parameters()).device
    stop_ids = set(params.stop_ids) if params.stop_ids is not None else default_stop_ids(tokenizer)
    excluded = excluded_mask(tokenizer, model.config.vocab_size, stop_ids, device)  # ids no sample takes
    was_training = model.training
    model.eval()
    tokens: list[int] = []
    logprobs: list[float] = []
    warned = False
    try:
        for _ in range(params.max_new_tokens):
            start = context_start(len(seq), block_size, keep)
            if start > 0 and not warned:
                warn_window(block_size, keep)
                warned = True
            idx = torch.tensor([seq[start:]], dtype=torch.long, device=device)  # (1, T): the whole window
            logits, _ = model(idx)
            logits = logits[:, -1]  # (1, V)
            if excluded is not None:
                logits.masked_fill_(excluded, float("-inf"))
            token = sample(logits, params, generator)  # (1,)
            tokens.append(int(token))
            logprobs.append(float(token_logprobs(logits, token)))
            seq.append(int(token))
            if int(token) in stop_ids:
                text = tokenizer.decode(tokens[:-1]) if tokenizer is not None else ""
                return Completion(text, tokens, logprobs, "stop", stop=int(token))
            if tokenizer is not None and params.stop:
                text = tokenizer.decode(tokens)
                found = [(text.find(s), s) for s in params.stop if s in text]
                if found:
                    position, stop = min(found)
                    return Completion(text[:position], tokens, logprobs, "stop", stop=stop)
    finally:
        model.train(was_training)
    text = tokenizer.decode(tokens) if tokenizer is not None else ""
    return Completion(text, tokens, logprobs, "length")
