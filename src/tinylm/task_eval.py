"""Measuring what a model can do: built-in tasks scored by exact match (`tinylm eval --task tasks:NAME`), or a
file's conversations (`tinylm eval --task held_out.jsonl`: each asked up to its last message, which is the answer).

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
from pathlib import Path

import torch
from torch import nn

from tinylm.data.conversations import read_conversations
from tinylm.data.tasks import exact_match, make_task, parse_task_spec
from tinylm.device import use_threads
from tinylm.errors import TinyLMError
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
    examples: list[tuple[str, str, str]] = field(default_factory=list)  # (prompt, answer, reply): misses first

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


def prompt_ids(tokenizer: Tokenizer, question: str | list[dict]) -> list[int]:
    """A chat asking ``question`` (a user message, or the messages so far), through the tokenizer's template (ChatML
    spelled as text without one), ready for the assistant's reply."""
    messages = [{"role": "user", "content": question}] if isinstance(question, str) else question
    if tokenizer.chat_template is not None:
        return chat_prompt_ids(tokenizer, messages)
    return tokenizer.encode_ordinary(render_chat(CHATML_TEMPLATE, messages, special_token_variables(tokenizer)))


@torch.inference_mode()
def evaluate_tasks(model: nn.Module, tokenizer: Tokenizer, spec: str, *, items: int = 200, batch_size: int = 50,
                   examples: int = 3) -> list[TaskScore]:
    """Score ``model`` on the held-out items of each task in ``spec`` (``tasks:add``, ``tasks:add+spell``): the first
    ``items`` of each task's test split, greedy replies, exact match (module docstring)."""
    turn_end = tokenizer.special_tokens.get(CHAT_END) if CHAT_END in tokenizer.special_tokens else None
    scores = []
    for name, asked in asked_items(spec, items):
        score = TaskScore(name, len(asked), 0, 0)
        hits: list[tuple[str, str, str]] = []
        for first in range(0, len(asked), batch_size):
            batch = asked[first:first + batch_size]
            prompts = [prompt_ids(tokenizer, question) for question, _ in batch]
            params = SamplingParams(max_new_tokens=reply_tokens(model, prompts), temperature=0.0)
            completions = Engine(model, params, tokenizer, long_prompts="cut").generate(prompts)
            for (question, answer), completion in zip(batch, completions):
                right = exact_match(completion.text, answer)
                score.exact += right
                score.ended += turn_end is not None and completion.stop == turn_end
                shown = (question if isinstance(question, str) else question[-1]["content"], answer, completion.text)
                (hits if right else score.examples).append(shown)
        score.examples = (score.examples + hits)[:examples]  # the misses say the most
        scores.append(score)
    return scores


def reply_tokens(model: nn.Module, prompts: list[list[int]]) -> int:
    """How many tokens a reply may take: `MAX_REPLY_TOKENS`, or what the context leaves after the longest prompt
    (a small model's context would otherwise slide over its own prompt)."""
    return max(1, min(MAX_REPLY_TOKENS, model.config.block_size - max(len(p) for p in prompts)))


def asked_items(spec: str, items: int) -> list[tuple[str, list]]:
    """(name, [(question, answer), ...]) per task: a built-in task's first ``items`` held-out items, or a JSONL file's
    conversations, each asked up to its last message (the assistant's, whose text is the answer)."""
    if spec.startswith("tasks:"):
        return [(name, [(item.prompt, item.answer) for item in make_task(name, items, TASK_SEED, "test")])
                for name in parse_task_spec(spec)]
    asked = []
    for number, conversation in enumerate(read_conversations(spec)[:items], start=1):
        if conversation[-1]["role"] != "assistant":
            raise TinyLMError(f"{spec}: conversation {number} does not end with the assistant's message, the "
                              "answer to score the reply against")
        asked.append((conversation[:-1], conversation[-1]["content"]))
    return [(Path(spec).name, asked)]


def evaluate_run_tasks(run_dir: str, spec: str, *, items: int = 200, checkpoint: str = "best", device: str = "cpu",
                       threads: int | None = None, log=None) -> list[TaskScore]:
    """`evaluate_tasks` on a run folder's model (its best checkpoint unless ``checkpoint`` says otherwise)."""
    asked_items(spec, 1)  # a misspelt task or a bad file is refused before the model loads
    run = load_run(run_dir, checkpoint, device=device)
    with use_threads(device, threads, log=log):
        return evaluate_tasks(run.model, run.tokenizer, spec, items=items)
