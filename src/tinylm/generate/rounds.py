"""One speculative round, shared by `tinylm sample --draft` and the server: check drafts in one pass, keep some.

The cache holds a row's tokens but the last one ("pending"). A round feeds pending + the n
drafts to the `tinylm.generate.steps.Decoder` in one pass (``extend``), which gives the model's
logits after each prefix; `judge_round` applies the acceptance rule (`tinylm.generate.speculative`
explains it and why the output keeps the model's distribution), and the decoder is cut back to
pending + the drafts kept (``truncate``). `Pacer` decides how many drafts a round proposes, from
the acceptance and the measured speed.
"""

from __future__ import annotations

import statistics
from collections import deque

import torch
from torch import Tensor

from tinylm.generate.sampling import SamplingParams, draw, sampling_distribution
from tinylm.generate.steps import Decoder

# drafted rounds per comparison with plain steps; plain steps a pause lasts, first and at most
ROUNDS_PER_CHECK = 4
FIRST_PAUSE, LONGEST_PAUSE = 32, 512
PLAIN_STEPS_TIMED = 16  # the recent plain steps whose median time is the one to beat



def draw_one(probs: Tensor, generator: torch.Generator | None) -> int:
    """One id from probs (V,): the argmax without a generator (greedy), else a draw."""
    if generator is None:
        return int(probs.argmax())
    return int(draw(probs[None], [generator])[0])


class Pacer:
    """How many drafts to propose next (0: a plain step), from the acceptance and the measured speed (module docstring).

    ``adaptive=False`` always drafts (up to ``k``, adapted to the acceptance): the tests use it to
    check the acceptance rule on every round.
    """

    def __init__(self, k: int, adaptive: bool = True) -> None:
        self.k, self.k_now, self.adaptive = k, k, adaptive
        self.plain_seconds: deque[float] = deque(maxlen=PLAIN_STEPS_TIMED)
        self.rounds: list[tuple[int, float]] = []  # (tokens, seconds) of the drafted rounds since the last check
        self.pause = 0  # plain steps left before drafting again
        self.next_pause = FIRST_PAUSE
        self.untimed = {"plain", "drafted"}  # the first of each is not timed (a compiled graph is made then)

    def drafts(self) -> int:
        if not self.adaptive:
            return self.k_now
        if self.pause > 0 or len(self.plain_seconds) < 2:  # two plain steps timed before the first draft
            return 0
        return self.k_now

    def record(self, drafted: int, kept: int, seconds: float) -> None:
        """A plain step (``drafted`` 0) or a round that kept ``kept`` of ``drafted`` drafts took ``seconds``."""
        kind = "drafted" if drafted else "plain"
        timed = kind not in self.untimed
        self.untimed.discard(kind)
        if not drafted:
            if timed:
                self.plain_seconds.append(seconds)
            self.pause = max(0, self.pause - 1)
            return
        self.k_now = min(self.k, self.k_now + 1) if kept == drafted else max(1, kept + 1)
        if not (self.adaptive and timed):
            return
        self.rounds.append((kept + 1, seconds))
        if len(self.rounds) < ROUNDS_PER_CHECK:
            return
        tokens, spent = map(sum, zip(*self.rounds))
        self.rounds.clear()
        if tokens / spent < 1 / statistics.median(self.plain_seconds):  # drafting was slower: pause it
            self.pause = self.next_pause
            self.next_pause = min(2 * self.next_pause, LONGEST_PAUSE)
        else:
            self.next_pause = FIRST_PAUSE


def judge_round(logits: Tensor, excluded: Tensor | None, params: SamplingParams, drafts: list[int],
                q: Tensor | None, generator: torch.Generator | None) -> tuple[list[int], int, Tensor]:
    """A round's outcome from the model's logits (1 + n, V) after the pending token and the n drafts.

    Returns the new tokens (the drafts kept, then one drawn), how many drafts were kept, and the
    log-probabilities (new, V) of the rows that gave them, over the ids a sample may take (``excluded``
    left out, as the engine reports them). `check_drafts` uses it.
    """
    logits = logits.float()
    if excluded is not None:
        logits = logits.masked_fill(excluded, float("-inf"))
    new, kept = accept_drafts(sampling_distribution(logits, params), drafts, q, generator)
    return new, kept, torch.log_softmax(logits[:len(new)], dim=-1)


def accept_drafts(p: Tensor, drafts: list[int], q: Tensor | None,
                  generator: torch.Generator | None) -> tuple[list[int], int]:
    """The acceptance rule (module docstring): the new tokens (kept drafts + one drawn) and how many drafts were kept."""
    for i, d in enumerate(drafts):
        q_d = float(q[i, d]) if q is not None else 1.0
        ratio = float(p[i, d]) / q_d if q_d > 0 else 0.0
        # ratio >= 1 keeps the draft for sure: no draw needed (and none made when greedy, where ratio is 0 or 1)
        if ratio >= 1 or (ratio > 0 and generator is not None
                          and float(torch.rand((), generator=generator, device=p.device)) < ratio):
            continue
        q_i = q[i] if q is not None else torch.nn.functional.one_hot(torch.tensor(d), p.size(-1)).to(p)
        residual = (p[i] - q_i).clamp(min=0)  # (V,)
        if float(residual.sum()) <= 0:  # p == q up to rounding: the draft could not be rejected
            residual = p[i]
        return drafts[:i] + [draw_one(residual / residual.sum(), generator)], i
    return drafts + [draw_one(p[len(drafts)], generator)], len(drafts)


def check_drafts(decoder: Decoder, seq: list[int], drafts: list[int], q: Tensor | None, excluded: Tensor | None,
                 params: SamplingParams, generator: torch.Generator | None,
                 pad_to: int | None = None) -> tuple[list[int], int, Tensor]:
    """One round for a decoder of one row holding ``seq`` but its last token: `judge_round`'s outcome.

    ONE pass reads the pending token and the drafts (row i of the logits gives p after seq +
    drafts[:i]); the cache then keeps the pending token and the drafts kept. When judging fails
    (settings sampling cannot take) the cache is put back as it was and the error raised.
    """
    length = decoder.length
    fed = [seq[-1], *drafts]
    logits = decoder.extend(torch.tensor([fed], device=decoder.mask.device), pad_to=pad_to)  # (1, 1 + n, V)
    try:
        new, kept, logprobs = judge_round(logits[0], excluded, params, drafts, q, generator)
    except Exception:
        decoder.truncate(length, last_token=seq[-2] if len(seq) > 1 else None)
        raise
    decoder.truncate(length + 1 + kept, last_token=fed[kept])
    return new, kept, logprobs
