"""Measuring what a model can do: built-in tasks scored by exact match (`tinylm eval --task tasks:NAME`).

Each held-out item of a task (`tinylm.data.tasks`: arithmetic, spelling, counting letters, lines of
Shakespeare) is asked as a one-message chat, written out by the model's chat template, and the
model's greedy reply is compared with the answer (`exact_match`: equal but for surrounding
whitespace). A reply ends where the model ends its turn (the end-of-turn token, or EOS) or after
`MAX_REPLY_TOKENS`; how many ended with the end-of-turn token is the second figure, since a model that
answers right and then rambles on is not yet following the format.

A model without a chat template (one pretrained on text alone: the "before" of fine-tuning) reads
the same ChatML text with its markers spelled out as plain text: it has never seen them, which is
the point of the comparison.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from tinylm.data.tasks import exact_match, make_task, parse_task_spec
from tinylm.device import use_threads
from tinylm.generate.engine import Engine
from tinylm.generate.sampling import SamplingParams
from tinylm.run import load_run
from tinylm.tokenizers.base import CHAT_END, Tokenizer
from tinylm.tokenizers.chat_template import (
    CHATML_TEMPLATE,
    chat_prompt_ids,
    render_chat,
    special_token_variables,
)

MAX_REPLY_TOKENS = 32  # every built-in task's answer is far shorter
TASK_SEED = 0  # the held-out items are the same for every run


@dataclass
class TaskScore:
    """One task's result: items asked, exact answers, replies that ended with the end-of-turn token, a few examples."""

    task: str
    items: int
    exact: int
    ended: int
    examples: list[tuple[str, str, str]] = field(default_factory=list)  # (prompt, answer, reply)

    @property
    def accuracy(self) -> float:
        return self.exact / self.items

    @property
    def ended_share(self) -> float:
        return self.ended / self.items

    def as_dict(self) -> dict:
        return {"task": self.task, "items": self.items, "exact_match": self.accuracy,
                "ended_with_end_of_turn": self.ended_share,
                "examples": [{"prompt": p, "answer": a, "reply": r} for p, a, r in self.examples]}


def prompt_ids(tokenizer: Tokenizer, question: str) -> list[int]:
    """A one-message chat asking ``question``, through the tokenizer's template (ChatML spelled as text without one)."""
    messages = [{"role": "user", "content": question}]
    if tokenizer.chat_template is not None:
        return chat_prompt_ids(tokenizer, messages)
    return tokenizer.encode_ordinary(render_chat(CHATML_TEMPLATE, messages, special_token_variables(tokenizer)))


@torch.inference_mode()
def evaluate_tasks(model: nn.Module, tokenizer: Tokenizer, spec: str, *, items: int = 200, batch_size: int = 50,
                   examples: int = 3) -> list[TaskScore]:
    """Score ``model`` on the held-out items of each task in ``spec`` (``tasks:add``, ``tasks:add+spell``): the first
    ``items`` of each task's test split, greedy replies, exact match (module docstring)."""
    turn_end = tokenizer.special_tokens.get(CHAT_END) if CHAT_END in tokenizer.special_tokens else None
    params = SamplingParams(max_new_tokens=MAX_REPLY_TOKENS, temperature=0.0)
    scores = []
    for name in parse_task_spec(spec):
        asked = make_task(name, items, TASK_SEED, "test")
        score = TaskScore(name, len(asked), 0, 0)
        for first in range(0, len(asked), batch_size):
            batch = asked[first:first + batch_size]
            prompts = [prompt_ids(tokenizer, item.prompt) for item in batch]
            completions = Engine(model, params, tokenizer, long_prompts="cut").generate(prompts)
            for item, completion in zip(batch, completions):
                right = exact_match(completion.text, item.answer)
                score.exact += right
                score.ended += turn_end is not None and completion.stop == turn_end
                if len(score.examples) < examples:
                    score.examples.append((item.prompt, item.answer, completion.text))
        scores.append(score)
    return scores


def evaluate_run_tasks(run_dir: str, spec: str, *, items: int = 200, checkpoint: str = "best", device: str = "cpu",
                       threads: int | None = None, log=None) -> list[TaskScore]:
    """`evaluate_tasks` on a run folder's model (its best checkpoint unless ``checkpoint`` says otherwise)."""
    parse_task_spec(spec)  # a misspelt task is refused before the model loads
    run = load_run(run_dir, checkpoint, device=device)
    with use_threads(device, threads, log=log):
        return evaluate_tasks(run.model, run.tokenizer, spec, items=items)
