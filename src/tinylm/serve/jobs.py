r"""What the scheduler is asked and what it answers: a `Job` in, lists of events out.

The HTTP layer (`tinylm.serve.app`) builds a `Job` from a request (token-id prompts, sampling settings,
what to report) and submits it to the `tinylm.serve.scheduler.Scheduler`, which calls the job's
``on_event`` from its own thread with the events of each decoding step:

- `ChoiceEvent`: one row's progress (the text that became certain, the tokens released with it as
  `TokenLogprob`\s, the finish reason on its last event);
- `PromptEvent`: a prompt's own log-probabilities (``echo`` with ``logprobs``);
- `JobFailed`: the job failed, with the message and the HTTP status to report;
- `JobDone`: every row has finished.

These are plain data, so the protocol layer can turn them into OpenAI's JSON without importing the
scheduler's machinery.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tinylm.errors import TinyLMError
from tinylm.generate.request import PreparedRequest
from tinylm.generate.sampling import SamplingParams
from tinylm.generate.steps import FinishReason


# ----- what a job sends back -----------------------------------------------------------------------


@dataclass(frozen=True)
class TokenLogprob:
    """One token with the model's log-probability of it (temperature 1, no filters, over the ids a sample may
    take).

    ``offset``: characters of the text decoded before this token (for the legacy ``text_offset``);
    ``top``: the most likely tokens at that position as (id, logprob), most likely first, when asked.
    """

    id: int
    logprob: float | None
    offset: int = 0
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class ChoiceEvent:
    """A row's progress in one step: the text that became certain and the tokens released with it.

    ``tokens``: the tokens whose text begins in the text released so far and that no earlier event
    listed (see "Text and logprobs in step" in `tinylm.serve.release`): often one, none while text is held
    back, several when held-back text is released. ``generated``: tokens drawn in this step (1; 0 for a row
    asked for 0 new tokens), listed or not. ``finish_reason`` is set on the row's last event.
    """

    index: int
    text: str
    tokens: tuple[TokenLogprob, ...] = ()
    generated: int = 0
    finish_reason: FinishReason | None = None


@dataclass(frozen=True)
class PromptEvent:
    """The log-probabilities of a prompt's own tokens (after the start ids), for ``echo`` with ``logprobs``."""

    prompt_index: int
    tokens: tuple[TokenLogprob, ...]


@dataclass(frozen=True)
class JobFailed:
    """The job failed (a bug, the device ran out of memory, settings sampling could not handle): the message to
    report, and the HTTP status that fits (400: the library refused the request's settings; 500: anything else)."""

    message: str
    status: int = 500


class JobDone:
    """The last event of a job: every row has finished."""


def is_crash(error: BaseException) -> bool:
    """Whether an exception is a failure to report and survive, not a request to stop.

    Every Exception is, and so are the BaseExceptions that are failures all the same: pyo3's
    PanicException, which a panic in a Rust tokenizer (tiktoken) raises, derives from BaseException
    alone. Ctrl+C, ``sys.exit``, a cancelled task and a closed generator are requests to stop.
    """
    return not isinstance(error, (KeyboardInterrupt, SystemExit, GeneratorExit, asyncio.CancelledError))


# ----- what a job asks for ---------------------------------------------------------------------------


class Job:
    """One request as the scheduler sees it: ``len(prompts) x n`` rows sharing one set of sampling settings.

    ``prompts`` are token ids (the start ids included); ``params`` the settings (``num_samples``
    is n); ``logprobs`` how many alternatives to report per token (None: no alternatives);
    ``prompt_logprobs`` whether to report the prompt's tokens' log-probabilities, from index
    ``echo_from`` of each prompt on; ``on_event`` receives lists of events, from the
    scheduler's thread. ``adapter``: the LoRA adapter its rows read (`tinylm.serve.adapters`; 0: the base).
    """

    def __init__(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                 on_event: Callable[[list], None], logprobs: int | None = None, prompt_logprobs: bool = False,
                 echo_from: int = 0, adapter: int = 0) -> None:
        if params.num_beams != 1:
            raise TinyLMError("the server samples; beam search is not offered")
        self.prompts = [list(map(int, p)) for p in prompts]
        self.params = params
        self.n = params.num_samples
        self.logprobs = logprobs
        self.prompt_logprobs = prompt_logprobs
        self.echo_from = echo_from
        self.adapter = adapter
        self.on_event = on_event
        self.cancelled = False  # set by `Scheduler.cancel`, from any thread
        self.failed = False
        self.failure: JobFailed | None = None  # a failure in this step, not yet sent (see `Scheduler._fail_job`)
        self.rows_left = len(self.prompts) * self.n
        # one generator per row, as `Engine` makes them (same seed, same tokens as the library); made by
        # `Scheduler.submit` on the model's device
        self.generators: list[torch.Generator] | None = None
        self.pending: deque[int] = deque(range(self.rows_left))  # rows not yet admitted, in order
        self.sampling_key = (params.temperature, params.top_k, params.top_p, params.min_p)
        # the request's rules (`tinylm.generate.request`): its checked prompts, stop ids and excluded mask; made by
        # `Scheduler.submit`
        self.request: PreparedRequest | None = None
