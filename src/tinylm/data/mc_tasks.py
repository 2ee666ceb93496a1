"""Benchmark tasks as lm-evaluation-harness scores them: multiple choice by log-likelihood, generation by exact match.

A *multiple-choice* item is a context and its choices, one of them right; the model scores each choice as the
continuation of the context (`tinylm.scoring`) and picks the likeliest. A *generation* item is a prompt and its
answer; the model writes greedily up to a stop string and is right when the text is the answer. Both come from
JSONL files, one item a line, the format told by its keys::

    {"context": "To be, or not to", "choices": [" be", " see", " go", " sleep"], "answer": 0}
    {"prompt": "dax wug ->", "answer": " dax wug", "stop": ["\\n"]}         (stop: optional, default a newline)

A choice is scored exactly as written, so it usually starts with the space that joins it to the context. (A
file of conversations, ``{"messages": ...}`` and the other chat formats of `tinylm.data.conversations`, is a chat
task instead, which `tinylm.task_eval` asks as chats.) A task file ``NAME.jsonl`` may have a train split beside
it, ``NAME.train.jsonl``, the solved examples few-shot prompts draw from.

Built-in tasks (`BUILTIN_TASKS`), made on this machine from a seed, each with a train and a test split, a
chance level and a line saying what it measures:

- ``mc:cloze``, ``mc:next-line``, ``mc:speaker``: from the Shakespeare plays that `tinylm train`'s default split
  holds out for validation (`held_out_plays`: documents chosen as `tinylm.data.shards.prepare` chooses them, with
  its default val_fraction 0.1 and seed 0), so a model trained on the default shards has never read them. Train
  and test never share a line: the side an item falls on depends on its line alone, through a hash
  (`tinylm.data.tasks.is_test_item`, half of the items test).
- ``icl:mapping``, ``icl:copy``: made-up words (`made_up_words`: syllables that are no word of the corpus), so
  nothing a model learned before the prompt helps. In ``icl:mapping`` each item has a mapping of its own from
  four words to four colours, shown only in that item's own solved examples (`ChoiceItem.examples`): with no
  examples the model can only guess (chance, 25%); each example it is shown can reveal the answer.

The same name, split, number and seed give the same items.
"""

from __future__ import annotations

import difflib
import functools
import itertools
import json
import os
import random
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tinylm.errors import TinyLMError
from tinylm.data.tasks import SPLITS, is_group, is_test_item, speeches, words

CHOICE, GENERATION = "multiple choice", "generation"
DEFAULT_STOP = ("\n",)
TRAIN_SUFFIX = ".train.jsonl"
DEFAULT_VAL_FRACTION, DEFAULT_SPLIT_SEED = 0.1, 0  # how `tinylm train` splits its shards unless told otherwise
HELD_OUT_TEST_FRACTION = 0.5  # the train split of a corpus task only feeds few-shot prompts: half is plenty


@dataclass(frozen=True)
class ChoiceItem:
    """A multiple-choice item: the context, its choices (each scored as the context's continuation), the right one;
    ``examples``: solved items that belong to this item alone (an in-context task's own mapping), which few-shot
    prompts draw from instead of the task's train split."""

    context: str
    choices: tuple[str, ...]
    answer: int
    examples: tuple[ChoiceItem, ...] = field(default=(), repr=False)

    @property
    def question(self) -> str:
        return self.context

    @property
    def solved(self) -> str:
        """The item with its answer, as a few-shot example shows it."""
        return self.context + self.choices[self.answer]


@dataclass(frozen=True)
class GenerationItem:
    """A generation item: the prompt, the answer a greedy generation must equal (whitespace around both aside),
    and the strings that end the generation."""

    prompt: str
    answer: str
    stop: tuple[str, ...] = DEFAULT_STOP
    examples: tuple[GenerationItem, ...] = field(default=(), repr=False)

    @property
    def question(self) -> str:
        return self.prompt

    @property
    def solved(self) -> str:
        return self.prompt + self.answer


Item = ChoiceItem | GenerationItem


@dataclass
class Task:
    """A task to score: its items (test split), the solved examples shots come from (train split, or None), and
    what chance scores."""

    name: str
    kind: str  # CHOICE or GENERATION
    test: list[Item]
    train: list[Item] | None
    chance: float | None = None  # the accuracy of guessing (None: not known, as for a file)
    description: str = ""


# ----- task files --------------------------------------------------------------------------------------------


def task_file_kind(path: str | os.PathLike) -> str:
    """CHOICE or GENERATION for a task file, or "chat" for a file of conversations, told by its first item's keys."""
    for lineno, record in _records(Path(path)):
        return _kind_of(record, Path(path), lineno)
    raise TinyLMError(f"{path} holds no items (it is empty or all blank lines)")


def read_task_file(path: str | os.PathLike) -> tuple[str, list[Item]]:
    """(kind, items) of a multiple-choice or generation task file; every line is checked, an error names the line."""
    path = Path(path)
    kind, items = None, []
    for lineno, record in _records(path):
        found = _kind_of(record, path, lineno)
        if kind is None:
            kind = found
            if kind == "chat":
                raise TinyLMError(f"{path} holds conversations, a chat task: `tinylm eval --task` asks them as chats")
        elif found != kind:
            raise TinyLMError(f"{path} line {lineno} is a {found} item, but the file's first item made it a {kind} "
                              "task; keep one kind of item per file")
        items.append(_choice_item(record, path, lineno) if kind == CHOICE else _generation_item(record, path, lineno))
    if kind is None:
        raise TinyLMError(f"{path} holds no items (it is empty or all blank lines)")
    return kind, items


def train_file_for(path: str | os.PathLike) -> Path:
    """Where a task file's train split is by default: NAME.train.jsonl beside NAME.jsonl."""
    path = Path(path)
    stem = path.name[:-len(".jsonl")] if path.name.endswith(".jsonl") else path.stem
    return path.with_name(stem + TRAIN_SUFFIX)


def _records(path: Path):
    """(line number, JSON object) for every non-blank line of a JSONL file."""
    if not path.is_file():
        raise TinyLMError(f"task file {path} does not exist; give a .jsonl file, one item a line, or a built-in "
                          f"task ({', '.join(BUILTIN_TASKS)})")
    try:
        text = path.read_bytes().removeprefix(b"\xef\xbb\xbf").decode("utf-8")
    except UnicodeDecodeError as e:
        lineno = e.object[:e.start].count(b"\n") + 1
        raise TinyLMError(f"{path} line {lineno} is not valid UTF-8; convert the file to UTF-8") from None
    except OSError as e:
        raise TinyLMError(f"cannot read {path}: {e.strerror or e}") from None
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as e:
            what = f"{e.msg} at column {e.pos + 1}" if isinstance(e, json.JSONDecodeError) else "nested too deeply"
            raise TinyLMError(f"{path} line {lineno} is not valid JSON ({what}); fix or remove that line") from None
        if not isinstance(record, dict):
            raise TinyLMError(f"{path} line {lineno} is not a JSON object; write one item a line, "
                              '{"context", "choices", "answer"} or {"prompt", "answer"}')
        yield lineno, record


def _kind_of(record: dict, path: Path, lineno: int) -> str:
    if "choices" in record or "context" in record:
        return CHOICE
    if "messages" in record or "completion" in record or "instruction" in record:
        return "chat"
    if "prompt" in record:
        return GENERATION
    raise TinyLMError(f"{path} line {lineno} has the keys {', '.join(sorted(record)) or 'none'}; a task item is "
                      '{"context", "choices", "answer"} (multiple choice) or {"prompt", "answer"} (generation)')


def _choice_item(record: dict, path: Path, lineno: int) -> ChoiceItem:
    where = f"{path} line {lineno}"
    context, choices, answer = record.get("context"), record.get("choices"), record.get("answer")
    if not isinstance(context, str):
        raise TinyLMError(f'{where}: "context" must be a string, the text the choices continue')
    if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
        raise TinyLMError(f'{where}: "choices" must be a list of at least two non-empty strings')
    if isinstance(answer, bool) or not isinstance(answer, int) or not 0 <= answer < len(choices):
        raise TinyLMError(f'{where}: "answer" must be the index of the right choice, 0 to {len(choices) - 1}, '
                          f"not {answer!r}")
    return ChoiceItem(context, tuple(choices), answer)


def _generation_item(record: dict, path: Path, lineno: int) -> GenerationItem:
    where = f"{path} line {lineno}"
    prompt, answer, stop = record.get("prompt"), record.get("answer"), record.get("stop", list(DEFAULT_STOP))
    if not isinstance(prompt, str) or not isinstance(answer, str):
        raise TinyLMError(f'{where}: "prompt" and "answer" must both be strings')
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise TinyLMError(f'{where}: "stop" must be a list of non-empty strings (default: a newline)')
    return GenerationItem(prompt, answer, tuple(stop))


def load_task(spec: str, *, n: int = 200, seed: int = 0, train_file: str | os.PathLike | None = None) -> Task:
    """A built-in task by name (its first ``n`` test items, made with ``seed``), or a task file's first ``n`` items
    with its train split: ``train_file``, else NAME.train.jsonl beside it when there is one (else none)."""
    if spec in BUILTIN_TASKS:
        if train_file is not None:
            raise TinyLMError(f"{spec} is a built-in task with its own train split; --train-file is for task files")
        return builtin_task(spec, n, seed)
    if spec.split(":")[0] in ("mc", "icl") and not Path(spec).exists():
        close = difflib.get_close_matches(spec, BUILTIN_TASKS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise TinyLMError(f"unknown task {spec!r}{hint}; the built-in tasks are {', '.join(BUILTIN_TASKS)}")
    kind, items = read_task_file(spec)
    train_path = Path(train_file) if train_file is not None else train_file_for(spec)
    train = None
    if train_file is not None or train_path.is_file():
        train_kind, train = read_task_file(train_path)
        if train_kind != kind:
            raise TinyLMError(f"{train_path} holds {train_kind} items, but {spec} is a {kind} task; give its train "
                              "split of the same kind")
    return Task(Path(spec).name, kind, items[:n], train)


# ----- built-in tasks ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BuiltinTask:
    kind: str
    chance: float
    description: str
    make: Callable[[str, int, int], list[Item]]  # (split, n, seed) -> items


def make_builtin(name: str, split: str, n: int, seed: int = 0) -> list[Item]:
    """``n`` items of a built-in task's ``split`` (fewer when a corpus task's split has fewer), the same for the
    same arguments."""
    if name not in BUILTIN_TASKS:
        raise TinyLMError(f"unknown task {name!r}; the built-in tasks are {', '.join(BUILTIN_TASKS)}")
    if split not in SPLITS:
        raise TinyLMError(f"the split must be one of {', '.join(SPLITS)}, got {split!r}")
    return BUILTIN_TASKS[name].make(split, n, seed)


def builtin_task(name: str, n: int, seed: int = 0, train_items: int = 1000) -> Task:
    """A built-in task with ``n`` test items and up to ``train_items`` train items to draw shots from."""
    spec = BUILTIN_TASKS.get(name)
    if spec is None:
        raise TinyLMError(f"unknown task {name!r}; the built-in tasks are {', '.join(BUILTIN_TASKS)}")
    return Task(name, spec.kind, make_builtin(name, "test", n, seed), make_builtin(name, "train", train_items, seed),
                spec.chance, spec.description)


def _sample(pool: list[Item], n: int, split: str, name: str, seed: int) -> list[Item]:
    """``n`` items of a corpus task's pool (all of them if it has fewer), in an order the seed fixes."""
    order = list(pool)
    random.Random(f"{name}\0{split}\0{seed}").shuffle(order)
    return order[:n]


# -- the held-out plays

@functools.cache
def held_out_plays() -> tuple[str, ...]:
    """The texts of the Shakespeare documents that `tinylm train`'s default shards hold out for validation."""
    from tinylm.data.corpora import load_corpus
    from tinylm.data.shards import _plan  # the very rule prepare uses to choose them

    corpus = load_corpus("shakespeare")
    is_val = _plan(corpus, DEFAULT_VAL_FRACTION, DEFAULT_SPLIT_SEED, progress=False).is_val
    return tuple(doc.text for doc, val in zip(corpus.documents(), is_val) if val)


_MIN_LINE_WORDS = 5
_BLANKABLE = re.compile(r"[a-z]{3,8}")


@functools.cache
def _held_out_speeches() -> tuple[tuple[tuple[str, tuple[str, ...]], ...], ...]:
    """Per held-out play, its speeches in order: (speaker, lines)."""
    return tuple(tuple((speaker, tuple(lines)) for speaker, lines in speeches(text)) for text in held_out_plays())


@functools.cache
def _askable_lines() -> frozenset[str]:
    """Lines that can be asked about: said once in the held-out plays, at least `_MIN_LINE_WORDS` words, no stage
    direction in brackets (so each has one place, one speaker, one next line)."""
    counts = Counter(line for play in _held_out_speeches() for _, lines in play for line in lines)
    return frozenset(line for line, count in counts.items()
                     if count == 1 and len(line.split()) >= _MIN_LINE_WORDS and not any(c in line for c in "[]"))


def _on_side(key: str, split: str) -> bool:
    return is_test_item(key, HELD_OUT_TEST_FRACTION) == (split == "test")


@functools.cache
def _cloze_pool(split: str) -> tuple[ChoiceItem, ...]:
    by_length: dict[int, list[str]] = {}
    for word in words():
        by_length.setdefault(len(word), []).append(word)
    askable, items = _askable_lines(), []
    for play in _held_out_speeches():
        for speaker, lines in play:
            for i, line in enumerate(lines):
                if line not in askable or not _on_side(line, split):
                    continue
                rng = random.Random(f"cloze\0{line}")
                # a whole word between a space and a space or punctuation: not "mouth-filling", not "thee's"
                blanks = [m for m in re.finditer(r"(?<= )[a-z]+(?=$|[ ,.;:!?])", line)
                          if _BLANKABLE.fullmatch(m.group()) and m.group() in _vocabulary()
                          and len(by_length[len(m.group())]) > 3]
                if not blanks:
                    continue
                blank = rng.choice(blanks)
                word = blank.group()
                distractors = rng.sample([w for w in by_length[len(word)] if w != word], 3)
                choices = [word, *distractors]
                rng.shuffle(choices)
                before = lines[i - 1] if i > 0 else f"{speaker}."
                context = f"{before}\n{line[:blank.start()].rstrip(' ')}"
                rest = line[blank.end():]
                items.append(ChoiceItem(context, tuple(f" {w}{rest}" for w in choices), choices.index(word)))
    return tuple(items)


@functools.cache
def _vocabulary() -> frozenset[str]:
    return frozenset(words())


@functools.cache
def _next_line_pool(split: str) -> tuple[ChoiceItem, ...]:
    askable = _askable_lines()
    every_line = sorted(askable)
    items = []
    for play in _held_out_speeches():
        for speaker, lines in play:
            for line, following in zip(lines, lines[1:]):
                if line not in askable or following not in askable or not _on_side(line, split):
                    continue
                rng = random.Random(f"next-line\0{line}")
                choices = [following, *[x for x in rng.sample(every_line, 5) if x not in (line, following)][:3]]
                rng.shuffle(choices)
                items.append(ChoiceItem(f"{speaker}.\n{line}", tuple(f"\n{x}" for x in choices),
                                        choices.index(following)))
    return tuple(items)


_PREVIOUS_LINES = 3  # the speech before, cut to its last lines: the context says who was speaking, and to whom


@functools.cache
def _speaker_pool(split: str) -> tuple[ChoiceItem, ...]:
    askable, items = _askable_lines(), []
    for play in _held_out_speeches():
        cast = sorted({speaker for speaker, _ in play if not is_group(speaker)})
        for (before, said), (speaker, lines) in zip(play, play[1:]):
            line = lines[0]
            if line not in askable or is_group(speaker) or not _on_side(line, split):
                continue
            rng = random.Random(f"speaker\0{line}")
            others = [name for name in cast if name not in (speaker, before)]
            if len(others) < 3:
                continue
            names = [speaker, *rng.sample(others, 3)]
            rng.shuffle(names)
            context = f"{before}.\n" + "\n".join(said[-_PREVIOUS_LINES:])
            items.append(ChoiceItem(context, tuple(f"\n\n{name}.\n{line}" for name in names), names.index(speaker)))
    return tuple(items)


def _corpus_task(pool: Callable[[str], tuple[ChoiceItem, ...]], name: str) -> Callable[[str, int, int], list[Item]]:
    return lambda split, n, seed: _sample(list(pool(split)), n, split, name, seed)


# -- made-up words

_ONSETS = ("b", "bl", "br", "d", "dr", "f", "fl", "g", "gl", "gr", "k", "l", "m", "n", "p", "pl", "r", "s", "sk",
           "sn", "t", "tr", "v", "w", "z")
_VOWELS = ("a", "e", "i", "o", "u")
_CODAS = ("b", "ck", "d", "f", "g", "k", "m", "n", "p", "rp", "sk", "t", "x", "z")
COLOURS = ("red", "blue", "green", "yellow")
_EXAMPLES_PER_ITEM = 16  # an in-context item's own solved examples: more than any --shots asks for


@functools.cache
def made_up_words() -> tuple[str, ...]:
    """One-syllable words (onset, vowel, coda: "blick", "dax") that are no word of the Shakespeare corpus."""
    known = _vocabulary()
    return tuple(w for w in ("".join(p) for p in itertools.product(_ONSETS, _VOWELS, _CODAS)) if w not in known)


def _episodes(split: str, n: int, seed: int, name: str, make: Callable[[random.Random], tuple[str, Item]]
              ) -> list[Item]:
    """``n`` items drawn afresh by ``make`` (key, item), each kept when its key is on the split's side, none twice."""
    rng = random.Random(f"{name}\0{split}\0{seed}")
    items, seen = [], set()
    while len(items) < n:
        key, item = make(rng)
        if key in seen or is_test_item(key, HELD_OUT_TEST_FRACTION) != (split == "test"):
            continue
        seen.add(key)
        items.append(item)
    return items


def _mapping_item(rng: random.Random) -> tuple[str, ChoiceItem]:
    chosen = rng.sample(made_up_words(), len(COLOURS))
    colour = dict(zip(chosen, rng.sample(range(len(COLOURS)), len(COLOURS))))  # word -> index of its colour
    choices = tuple(f" {c}" for c in COLOURS)

    def ask(word: str, examples: tuple[ChoiceItem, ...] = ()) -> ChoiceItem:
        return ChoiceItem(f"{word} ->", choices, colour[word], examples)

    query = rng.choice(chosen)
    examples = tuple(ask(rng.choice(chosen)) for _ in range(_EXAMPLES_PER_ITEM))  # with repeats, as a text would
    return f"{sorted(colour.items())}\0{query}", ask(query, examples)


def _copy_item(rng: random.Random) -> tuple[str, GenerationItem]:
    text = " ".join(rng.sample(made_up_words(), rng.randint(1, 3)))
    return text, GenerationItem(f"{text} ->", f" {text}")


BUILTIN_TASKS: dict[str, BuiltinTask] = {
    "mc:cloze": BuiltinTask(CHOICE, 0.25, "a held-out line of Shakespeare with one word blanked: which of 4 words of "
                            "that length fills it (each choice is the word and the rest of the line)",
                            _corpus_task(_cloze_pool, "mc:cloze")),
    "mc:next-line": BuiltinTask(CHOICE, 0.25, "which of 4 held-out lines follows a line of a speech (the others "
                                "from elsewhere in the held-out plays)", _corpus_task(_next_line_pool, "mc:next-line")),
    "mc:speaker": BuiltinTask(CHOICE, 0.25, "which of 4 characters of the play speaks a line, after the end of the "
                              "speech before it", _corpus_task(_speaker_pool, "mc:speaker")),
    "icl:mapping": BuiltinTask(CHOICE, 0.25, "made-up words mapped to colours, a new mapping every item shown only by "
                               "the prompt's examples: 0-shot is chance, each shot may reveal the answer",
                               lambda split, n, seed: _episodes(split, n, seed, "icl:mapping", _mapping_item)),
    "icl:copy": BuiltinTask(GENERATION, 0.0, "repeat one to three made-up words after '->' (greedy, exact match): a "
                            "format only the prompt's examples teach",
                            lambda split, n, seed: _episodes(split, n, seed, "icl:copy", _copy_item)),
}
"""The built-in tasks by name: their kind, chance level, what they measure, and how they are made."""
