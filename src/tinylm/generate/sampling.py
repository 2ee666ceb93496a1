"""Sampling: from the model's next-token logits to one token: temperature, top-k, top-p, min-p, greedy.

The model gives, for the last position, logits u (one per token of V) and the distribution
p = softmax(u). Decoding strategies reshape p before drawing from it; tinylm applies them in
this order, always, everywhere (the engine, the reference generator, `tinylm next-token`):

1. **temperature** tau: p_tau = softmax(u / tau). tau < 1 sharpens the distribution, tau > 1
   flattens it, tau -> 0 tends to the argmax; tau = 0 *is* the argmax (greedy decoding, and then
   the filters below change nothing, since the argmax survives all of them).
2. **top-k**: keep the k tokens with the largest logits, drop the rest (ties with the k-th
   largest are all kept, so the result never depends on how tied tokens happen to be ordered).
3. **top-p** (nucleus): keep the smallest set of most likely tokens whose probability reaches p,
   always keeping the token that crosses the threshold (with p = 0.9 and probabilities 0.5,
   0.3, 0.15, ... the set is {0.5, 0.3, 0.15}: 0.8 < 0.9, then 0.95 >= 0.9). Tokens tied with the
   crossing token are kept too. The probabilities are those left after steps 1-2.
4. **min-p**: keep the tokens whose probability is at least min_p times the most likely one's
   (the cut scales with the model's confidence). Again on what steps 1-3 left.

A dropped token gets the logit -inf, so the final softmax renormalises over what is left.

Randomness comes from `torch.Generator` objects made for each call (`make_generators`), never
from torch's global generator: the same seed gives the same tokens whatever ran before, and
each sample of a batch has its own stream, so samples in one batch differ.

The log-probability reported for a sampled token (`token_logprobs`) is the *model's*,
log softmax(u)[x] at temperature 1 without filters: what the model thinks of the token,
whatever strategy picked it. Beam search scores paths with the same numbers.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from tinylm.errors import TinyLMError
from tinylm.tokenizers.base import Tokenizer, generation_excluded

# top-p compares a cumulative sum of float probabilities with p; a sum that misses p by rounding
# (0.5 + 0.4 = 0.8999999 in float32) must still count as reaching it
TOP_P_TOLERANCE = 1e-6


@dataclass
class SamplingParams:
    """How to decode: the strategy, its knobs, when to stop, and the seed.

    - ``max_new_tokens``: the most tokens to generate per sample (finish reason "length").
    - ``temperature``: 0 is greedy decoding; otherwise the logits are divided by it.
    - ``top_k``, ``top_p``, ``min_p``: the filters, applied after temperature in this order;
      None (or 0 for top_k and min_p, 1 for top_p) leaves that filter off.
    - ``seed``: makes sampling reproducible; None draws a fresh seed for every call.
    - ``num_samples``: samples per prompt (with beam search: the best ``num_samples`` beams).
    - ``stop``: strings that end a sample; the text is cut before the stop string.
    - ``stop_ids``: token ids that end a sample; None means the tokenizer's EOS and end-of-turn tokens
      (`tinylm.tokenizers.base.default_stop_ids`).
    - ``num_beams``: more than 1 runs beam search (deterministic; the sampling knobs do not
      apply) with ``length_penalty`` alpha: a finished path is ranked by
      sum(log p) / (number of tokens)^alpha (0 = no normalisation, 1 = mean log-probability).
    - ``window_keep``: when a sequence outgrows the model's context, how many of its most recent
      tokens to keep (see `tinylm.generate.engine.context_start`); None: half the context.
    """

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    num_samples: int = 1
    stop: Sequence[str] = field(default_factory=tuple)
    stop_ids: Sequence[int] | None = None
    num_beams: int = 1
    length_penalty: float = 1.0
    window_keep: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = (self.stop,)  # a lone string is one stop string, not a set of characters
        self.stop = tuple(self.stop)
        if self.stop_ids is not None:
            self.stop_ids = tuple(int(i) for i in self.stop_ids)
        _check_int("max_new_tokens", self.max_new_tokens, minimum=0)
        _check_int("num_samples", self.num_samples, minimum=1)
        _check_int("num_beams", self.num_beams, minimum=1)
        t = self.temperature
        if not (isinstance(t, (int, float)) and math.isfinite(t) and t >= 0):
            raise TinyLMError(f"temperature must be 0 (greedy) or a positive number, got {self.temperature!r}")
        if self.top_k is not None:
            _check_int("top_k", self.top_k, minimum=0)
        if self.top_p is not None and not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise TinyLMError(f"top_p is a probability in (0, 1] (1 keeps everything), got {self.top_p!r}")
        if self.min_p is not None and not (isinstance(self.min_p, (int, float)) and 0.0 <= self.min_p <= 1.0):
            raise TinyLMError(f"min_p is a fraction in [0, 1] (0 keeps everything), got {self.min_p!r}")
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=0)
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise TinyLMError(f"stop strings must be non-empty strings, got {list(self.stop)!r}")
        if self.stop_ids is not None and any(i < 0 for i in self.stop_ids):
            raise TinyLMError(f"stop_ids must be token ids (0 or more), got {list(self.stop_ids)!r}")
        if not (isinstance(self.length_penalty, (int, float)) and math.isfinite(self.length_penalty)):
            raise TinyLMError(f"length_penalty must be a number, got {self.length_penalty!r}")
        if self.num_beams > 1 and self.num_samples > self.num_beams:
            raise TinyLMError(f"beam search returns at most num_beams paths: num_samples ({self.num_samples}) "
                              f"must be <= num_beams ({self.num_beams})")
        if self.window_keep is not None:
            _check_int("window_keep", self.window_keep, minimum=1)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise TinyLMError(f"{name} must be an integer >= {minimum}, got {value!r}")


# ----- the filters, each (B, V) logits -> (B, V) logits with dropped tokens at -inf --------------


def apply_temperature(logits: Tensor, temperature: float) -> Tensor:
    """(u - max u) / tau: softmax of the result is p_tau. (tau = 0 is greedy, handled by `sample`, not here.)

    Subtracting each row's largest logit first changes no probability (softmax ignores a shift)
    and keeps a tiny tau from overflowing: the top token lands at 0 and the others at large
    negative numbers or -inf, never at +inf, so p_tau tends to greedy instead of becoming NaN.
    """
    if temperature <= 0:
        raise TinyLMError("temperature 0 means greedy decoding: take the argmax instead of dividing by 0")
    top = logits.amax(dim=-1, keepdim=True)  # (B, 1)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # a row of all -inf stays as it is
    return (logits - top) / temperature


def top_k_filter(logits: Tensor, k: int | None) -> Tensor:
    """Keep the k largest logits of each row (and any tied with the k-th); the rest become -inf."""
    if not k or k >= logits.size(-1):
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # (B, 1): the k-th largest logit of each row
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: Tensor, p: float | None) -> Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches p (nucleus sampling).

    Sort the probabilities in decreasing order; a token is kept if the tokens strictly more likely
    than it (before it in the order) do not reach p yet. So the token that crosses p is kept, and
    the most likely token always is. Every token as likely as the last kept one is kept too.
    """
    if p is None or p >= 1.0:
        return logits
    probs = torch.softmax(logits.double(), dim=-1)  # (B, V); float64 so the sums below are exact enough
    sorted_probs, _ = torch.sort(probs, dim=-1, descending=True)  # (B, V)
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # (B, V): mass of the tokens ranked higher
    # the most likely token is always kept, however small p is (p below the tolerance included)
    n_keep = (before < p - TOP_P_TOLERANCE).sum(dim=-1, keepdim=True).clamp(min=1)  # (B, 1)
    threshold = sorted_probs.gather(-1, n_keep - 1)  # (B, 1): the probability of the crossing token
    return logits.masked_fill(probs < threshold, float("-inf"))


def min_p_filter(logits: Tensor, min_p: float | None) -> Tensor:
    """Keep the tokens with probability >= min_p * (the largest probability); the rest become -inf."""
    if not min_p:
        return logits
    # p_i >= min_p * p_max  <=>  u_i - u_max >= log(min_p): no softmax needed
    u_max = logits.max(dim=-1, keepdim=True).values  # (B, 1)
    return logits.masked_fill(logits - u_max < math.log(min_p), float("-inf"))


def filter_logits(logits: Tensor, params: SamplingParams) -> Tensor:
    """Temperature, then top-k, then top-p, then min-p: the logits (B, V) sampling draws from.

    Computed in float32 (or float64 if given), whatever the model's dtype.
    """
    logits = logits.float() if logits.dtype not in (torch.float32, torch.float64) else logits
    if params.temperature > 0:
        logits = apply_temperature(logits, params.temperature)
    logits = top_k_filter(logits, params.top_k)
    logits = top_p_filter(logits, params.top_p)
    return min_p_filter(logits, params.min_p)


def sampling_distribution(logits: Tensor, params: SamplingParams) -> Tensor:
    """The distribution (B, V) that `sample` draws from; one-hot on the argmax when greedy."""
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.size(-1)).to(torch.float32)
    return torch.softmax(filter_logits(logits, params), dim=-1)


# ----- drawing -----------------------------------------------------------------------------------


def excluded_mask(tokenizer: Tokenizer | None, width: int, stop_ids: Collection[int] = (),
                  device: torch.device | str = "cpu", limit: int | None = None) -> Tensor | None:
    """(width,) bool over a model's output ids: True for the ids no sample may take, or None for none.

    Those are the ids from ``limit`` on (default: the tokenizer's vocabulary size; an output layer
    padded to a multiple of 64 has ids the tokenizer cannot decode) and the ones the tokenizer has
    no text for (`tinylm.tokenizers.base.generation_excluded`: padding, BOS, reserved ids,
    ``<unk>``), unless they are ``stop_ids``. Every sampler sets their logits to -inf, so the
    engine, beam search, the naive reference and the server draw alike.
    """
    if limit is None:
        limit = tokenizer.vocab_size if tokenizer is not None else width
    mask = torch.zeros(width, dtype=torch.bool)
    mask[limit:] = True
    if tokenizer is not None:
        mask[[i for i in generation_excluded(tokenizer) if i < width and i not in stop_ids]] = True
    return mask.to(device) if bool(mask.any()) else None


def make_generators(seed: int | None, n: int, device: torch.device | str = "cpu",
                    key: Sequence[int] = ()) -> list[torch.Generator]:
    """One random generator per sample, seeded from (seed, key, sample index); a fresh seed when ``seed`` is None.

    numpy's SeedSequence mixes them into well-separated seeds, so seed 1 sample 1 does not
    repeat seed 2 sample 0 (as seed + index would). ``key``: more words to mix in (`prompt_key`).
    """
    if seed is None:
        seed = int(np.random.SeedSequence().entropy % (2**63))  # fresh OS entropy, for this call only
    states = np.random.SeedSequence([seed, *key]).spawn(n)
    gens = []
    for s in states:
        g = torch.Generator(device=device)
        g.manual_seed(int(s.generate_state(1, dtype=np.uint64)[0] % (2**63)))
        gens.append(g)
    return gens


def prompt_generators(seed: int | None, n_prompts: int, n_samples: int,
                      device: torch.device | str = "cpu",
                      prompts: Sequence[Sequence[int]] | None = None) -> list[torch.Generator]:
    """The generators of ``n_prompts`` prompts x ``n_samples`` samples, row ``p * n_samples + s``.

    With a seed, sample s of a prompt is seeded from (seed, the prompt's token ids, s) alone, so a
    prompt's text does not depend on which other prompts came with it (or in which order): ``sample
    --seed 1`` of a prompt gives the same text alone or second in a list, as the server does for each
    request. The prompt's ids take part so that two prompts do not share their random draws (their
    samples would pick alike from their distributions, the same rare word in both); without
    ``prompts`` every prompt gets the draws of (seed, s). Without a seed, every row gets fresh
    randomness of its own.
    """
    if seed is None:
        return make_generators(None, n_prompts * n_samples, device)
    if prompts is None:
        return [g for _ in range(n_prompts) for g in make_generators(seed, n_samples, device)]
    if len(prompts) != n_prompts:
        raise TinyLMError(f"prompt_generators: {len(prompts)} prompts given for n_prompts={n_prompts}")
    return [g for prompt in prompts for g in make_generators(seed, n_samples, device, key=prompt_key(prompt))]


def prompt_key(prompt: Sequence[int]) -> list[int]:
    """A prompt's token ids as four 32-bit words (a BLAKE2b digest), for a seed that differs by prompt."""
    digest = hashlib.blake2b(np.asarray(list(prompt), dtype="<i8").tobytes(), digest_size=16).digest()
    return [int.from_bytes(digest[i:i + 4], "little") for i in range(0, 16, 4)]


def sample(logits: Tensor, params: SamplingParams, generators: Sequence[torch.Generator] | None = None) -> Tensor:
    """Next token ids (B,) from last-position logits (B, V): greedy, or one draw per row.

    Row b draws with ``generators[b]``, so a row's tokens depend only on its own generator and
    logits, not on the other rows of the batch.
    """
    if params.greedy:
        return logits.argmax(dim=-1)  # (B,); the first index wins a tie
    if generators is None or len(generators) != logits.size(0):
        raise TinyLMError(f"sampling needs one generator per row ({logits.size(0)}); use make_generators")
    return draw(torch.softmax(filter_logits(logits, params), dim=-1), generators)  # (B,)


def draw(probs: Tensor, generators: Sequence[torch.Generator]) -> Tensor:
    """One id per row of probs (B, V), row b drawn with ``generators[b]`` alone: ids (B,).

    Inverse transform sampling: one uniform u per row, and the first id whose cumulative probability
    exceeds u times the row's total (an id of probability 0 is never the first). One random number
    per row, where ``torch.multinomial`` draws one per id (an exponential each, the Gumbel trick): on
    a CPU those V draws cost more than the rest of a batched step's sampling together.
    """
    cdf = probs.double().cumsum(dim=-1)  # (B, V)
    total = cdf[:, -1]  # (B,)
    if not bool((torch.isfinite(total) & (total > 0)).all() & (probs.amin() >= 0)):
        raise RuntimeError("probability tensor contains either inf, nan or element < 0, or sums to 0")
    u = torch.stack([torch.rand((), dtype=torch.float64, generator=g, device=probs.device) for g in generators])
    # u < 1, so x < total and some cumulative probability exceeds it: never past the last id
    x = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))  # (B,)
    return torch.searchsorted(cdf, x[:, None], right=True)[:, 0]  # (B,)


def token_logprobs(logits: Tensor, tokens: Tensor) -> Tensor:
    """log p(token) under the model's own distribution softmax(logits) (B, V), for tokens (B,): (B,)."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # (B, V)
    return logp.gather(-1, tokens[:, None].long())[:, 0]  # (B,)
