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

Benchmark tasks (`tinylm eval --task mc:cloze`, or a JSONL file of multiple-choice or generation items:
`tinylm.data.mc_tasks`) are scored as EleutherAI's lm-evaluation-harness scores them, on plain text with no chat
template, by any model family (`score_task`):

- multiple choice: each choice's summed log-likelihood as the continuation of the context
  (`tinylm.scoring.loglikelihoods`, the pair tokenized by `tinylm.scoring.encode_pair`). ``accuracy`` counts the
  items whose right choice has the largest sum (the harness's ``acc``); ``accuracy_norm`` divides each sum by the
  choice's length in UTF-8 bytes first, so a long choice is not penalised for its length (the harness's
  ``acc_norm`` divides by characters, its ``acc_bytes`` by bytes: the same for ASCII text). Ties go to the
  first choice, as numpy's argmax (and the harness) gives them.
- generation: a greedy answer up to the item's first stop string (default a newline), right when it equals the
  answer but for whitespace around both (`tinylm.data.tasks.exact_match`).

Few-shot prompts (``shots`` = K > 0) put K solved examples before each question, each followed by a blank line::

    <example 1 context><example 1 right choice>\n\n ... <example K ...>\n\n<question's context>

(a generation example is its prompt followed by its answer). The examples come from the task's train split (a
file's NAME.train.jsonl), or from the item's own solved examples where it has them (``icl:mapping``: each item
has its own mapping); `draw_shots` picks them with a generator seeded by ``seed`` and the item's index, drawing
one at a time, so K + 1 shots are K shots and one more. Contexts longer than the model's window lose their
oldest tokens (`tinylm.scoring`): the question stays whole, the earliest examples go first.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from tinylm.data.conversations import read_conversations
from tinylm.data.mc_tasks import (BUILTIN_TASKS, CHOICE, ChoiceItem, GenerationItem, Item, Task, load_task,
                                  task_file_kind)
from tinylm.data.tasks import TASK_PREFIX, exact_match, make_task, parse_task_spec
from tinylm.device import use_threads
from tinylm.errors import TinyLMError
from tinylm.generate.engine import Engine
from tinylm.generate.sampling import SamplingParams
from tinylm.run import Run, load_run
from tinylm.scoring import encode_pair, loglikelihoods
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


# ----- benchmark tasks: multiple choice by log-likelihood, generation by exact match -------------------------------

SHOT_SEED = 1234  # the few-shot examples drawn unless told otherwise (the harness's own default seed)
SHOT_SEPARATOR = "\n\n"  # after each solved example of a few-shot prompt
MAX_ANSWER_TOKENS = 64  # a generation task's answers are short; a model that never stops is cut here


def is_chat_task(spec: str) -> bool:
    """Whether ``--task`` names chat tasks (``tasks:NAME``, a file of conversations) rather than benchmark tasks."""
    if spec.startswith(TASK_PREFIX):
        return True
    return spec not in BUILTIN_TASKS and Path(spec).is_file() and task_file_kind(spec) == "chat"


@dataclass
class TaskResult:
    """A benchmark task's score at one number of shots."""

    task: str
    kind: str  # multiple choice or generation
    shots: int
    n: int  # items scored
    correct: int
    correct_norm: int | None  # multiple choice: right by log-likelihood per byte
    chance: float | None
    seconds: float
    tokens: int  # tokens the model read (multiple choice) or was prompted with (generation)

    @property
    def accuracy(self) -> float:
        return self.correct / self.n

    @property
    def accuracy_norm(self) -> float | None:
        return None if self.correct_norm is None else self.correct_norm / self.n

    def as_dict(self) -> dict:
        out = {"task": self.task, "kind": self.kind, "shots": self.shots, "n": self.n, "accuracy": self.accuracy}
        if self.accuracy_norm is not None:
            out["accuracy_norm"] = self.accuracy_norm
        return {**out, "chance": self.chance, "seconds": self.seconds, "tokens": self.tokens}


def few_shot_prompt(item: Item, shots: Sequence[Item]) -> str:
    """The text the model reads before the answer: each shot solved and followed by a blank line, then the question
    (the module docstring has the layout)."""
    return "".join(shot.solved + SHOT_SEPARATOR for shot in shots) + item.question


def draw_shots(task: Task, index: int, k: int, seed: int = SHOT_SEED) -> list[Item]:
    """``k`` distinct solved examples for the test item ``index`` of ``task``: from the item's own examples when it
    has them, else from the task's train split; drawn one at a time by a generator seeded by ``seed`` and ``index``,
    so the first k of k + 1 shots are the k shots."""
    if k == 0:
        return []
    item = task.test[index]
    pool = item.examples or task.train
    if not pool:
        raise TinyLMError(f"{task.name} has no train split to draw {k} shots from; give 0 shots, or write its solved "
                          "examples to NAME.train.jsonl beside the task file (or give --train-file)")
    if k > len(pool):
        raise TinyLMError(f"{task.name} has {len(pool)} solved examples to draw shots from, fewer than {k}")
    rng = random.Random(f"{seed}\0{index}")
    picked: list[int] = []
    while len(picked) < k:
        j = rng.randrange(len(pool))
        if j not in picked:
            picked.append(j)
    return [pool[j] for j in picked]


def score_task(model: nn.Module, tokenizer: Tokenizer, task: Task, *, shots: int = 0, seed: int = SHOT_SEED,
               start_ids: Sequence[int] = (), batch_size: int | None = None) -> TaskResult:
    """``task``'s accuracy for ``model`` (any family) with ``shots`` examples in each prompt (module docstring).
    ``start_ids`` come before every prompt (a run's `tinylm.run.Run.start_ids`); ``batch_size``: rows per forward
    pass of the log-likelihood scoring (`tinylm.scoring.loglikelihoods`)."""
    started = time.perf_counter()
    prompts = [few_shot_prompt(item, draw_shots(task, i, shots, seed)) for i, item in enumerate(task.test)]
    if task.kind == CHOICE:
        correct, correct_norm, tokens = _score_choices(model, tokenizer, task.test, prompts, start_ids, batch_size)
    else:
        correct, tokens = _score_generations(model, tokenizer, task.test, prompts, start_ids)
        correct_norm = None
    return TaskResult(task.name, task.kind, shots, len(task.test), correct, correct_norm, task.chance,
                      time.perf_counter() - started, tokens)


def _score_choices(model: nn.Module, tokenizer: Tokenizer, items: Sequence[ChoiceItem], prompts: list[str],
                   start_ids: Sequence[int], batch_size: int | None) -> tuple[int, int, int]:
    """(right by log-likelihood, right by log-likelihood per byte, tokens read) over multiple-choice items."""
    pairs = [encode_pair(tokenizer, prompt, choice, start_ids) for item, prompt in zip(items, prompts)
             for choice in item.choices]
    scores = iter(loglikelihoods(model, pairs, batch_size=batch_size))
    correct = correct_norm = 0
    for item in items:
        lls = np.array([next(scores)[0] for _ in item.choices])
        lengths = np.array([len(choice.encode("utf-8")) for choice in item.choices])
        correct += int(np.argmax(lls)) == item.answer
        correct_norm += int(np.argmax(lls / lengths)) == item.answer
    return correct, correct_norm, sum(len(c) + len(x) for c, x in pairs)


def _score_generations(model: nn.Module, tokenizer: Tokenizer, items: Sequence[GenerationItem], prompts: list[str],
                       start_ids: Sequence[int], batch_size: int = 50) -> tuple[int, int]:
    """(answers right, prompt tokens): greedy generations up to each item's stop strings, batch by batch."""
    new_tokens = min(MAX_ANSWER_TOKENS, max(len(tokenizer.encode(item.answer)) for item in items) + 8)
    room = model.config.block_size - new_tokens  # the prompt keeps its last tokens: the window never slides
    if room < 1:
        raise TinyLMError(f"the answers need up to {new_tokens} new tokens, more than the model's context holds")
    groups: dict[tuple[str, ...], list[int]] = {}
    for i, item in enumerate(items):
        groups.setdefault(item.stop, []).append(i)
    correct = tokens = 0
    for stop, members in groups.items():
        engine = Engine(model, SamplingParams(max_new_tokens=new_tokens, temperature=0.0, stop=stop), tokenizer,
                        long_prompts="cut")
        for first in range(0, len(members), batch_size):
            batch = members[first:first + batch_size]
            ids = [(list(start_ids) + tokenizer.encode(prompts[i]))[-room:] for i in batch]
            tokens += sum(len(x) for x in ids)
            for i, completion in zip(batch, engine.generate(ids)):
                correct += exact_match(completion.text, items[i].answer)
    return correct, tokens


def evaluate_run_task(run_dir: str | Run, spec: str, *, shots: Sequence[int] = (0,), items: int = 200,
                      seed: int = SHOT_SEED, train_file: str | None = None, checkpoint: str = "best",
                      device: str = "cpu", batch_size: int | None = None, threads: int | None = None,
                      log: Callable[[str], None] | None = None) -> list[TaskResult]:
    """`score_task` on a run folder's model (or a loaded `Run`) for each number of ``shots``: a built-in task
    (`tinylm.data.mc_tasks.BUILTIN_TASKS`) or a task file, its first ``items`` test items."""
    task = load_task(spec, n=items, train_file=train_file)  # a misspelt task or a bad file: refused before loading
    for k in shots:  # no train split, or too few examples: said before any scoring
        draw_shots(task, 0, k, seed)
    run = run_dir if isinstance(run_dir, Run) else load_run(run_dir, checkpoint, device=device)
    with use_threads(device, threads, log=log):
        return [score_task(run.model, run.tokenizer, task, shots=k, seed=seed, start_ids=run.start_ids,
                           batch_size=batch_size) for k in shots]


def format_task_results(run: str, results: Sequence[TaskResult]) -> str:
    """A run's scores on one task, one line per number of shots, for the terminal."""
    first = results[0]
    chance = "" if first.chance is None else f"; chance {100 * first.chance:.1f}%"
    lines = [f"{run} on {first.task} ({first.kind}, {first.n} test items{chance})"]
    norm = first.kind == CHOICE
    lines.append("  shots  accuracy" + ("  accuracy_norm" if norm else "") + "    time")
    for r in results:
        extra = f"  {100 * r.accuracy_norm:12.1f}%" if norm else ""
        lines.append(f"  {r.shots:5d}  {100 * r.accuracy:7.1f}%{extra}  {r.seconds:5.1f} s")
    return "\n".join(lines)
