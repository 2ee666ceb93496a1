"""Built-in tasks: prompts with one right answer each, made on this machine, to tune a model on and to score it.

Each task makes `TaskItem`\\s, a prompt and its answer, one user turn and one assistant turn once
written as a conversation::

    items = make_task("add", n=1000, seed=0)                  # to tune on
    held_out = make_task("add", n=200, seed=0, split="test")  # to score with
    items[0].conversation()  # [{"role": "user", "content": "What is 23 + 58?"}, {"role": "assistant", ...}]
    exact_match(reply, item.answer)

The tasks (`TASKS`):

- ``add``: the sum of two whole numbers from 0 to 99.
- ``spell``: a word with its letters separated by spaces.
- ``count``: the number of letters in a word.
- ``reverse``: three to five words in reverse order.
- ``speaker``: who says a line of a Shakespeare play, as the play's text names the speaker.
- ``next-line``: the line that follows a line of a Shakespeare speech.

The words are the lowercase alphabetic words of 3 to 8 letters in the built-in Shakespeare corpus
(seen at least twice, which leaves out one-off misprints); the lines are from the speeches of its
plays. Lines that occur more than once in the corpus, lines too short to place and stage
directions are never asked about, nor are speeches by a group (``ALL.``, ``BOTH.``, two names
joined by "and"), so each question has one right answer. Each prompt has one fixed wording.

Train and test never share an item: whether an item is a test item depends on its content alone
(the two numbers, whichever comes first; the word; the words in order; the line), through a hash,
whatever ``n`` and ``seed`` are asked for, so a test set made with any seed is held out of every
training set of that task. About `TEST_FRACTION` of the items are test items. ``spell`` and
``count`` share their test words, so a mixture of the two does not train on a word the other tests.

The same name, ``n``, ``seed`` and split give the same items. ``n`` larger than the train items a
task has (``add`` has about 9,000) repeats them, each pass in a new order; the test split refuses
to repeat, since a score over repeated items counts some twice.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import random
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from tinylm.errors import TinyLMError

TASKS = {
    "add": "the sum of two numbers from 0 to 99: What is 23 + 58? -> 81",
    "spell": "spell a word letter by letter: Spell 'water'. -> w a t e r",
    "count": "count a word's letters: How many letters are in 'water'? -> 5",
    "reverse": "reverse three to five words: Reverse the words: the king is dead -> dead is king the",
    "speaker": 'who says a line of Shakespeare: Who says: "..."? -> OTHELLO',
    "next-line": 'the next line of a Shakespeare speech: What line follows: "..."? -> the line',
}
"""The task names, each with what it asks and an example."""

SPLITS = ("train", "test")

TEST_FRACTION = 0.1
"""About this share of each task's items are test items, never made for its train split."""

TASK_PREFIX = "tasks:"


@dataclass(frozen=True)
class TaskItem:
    """One question with one right answer."""

    prompt: str
    answer: str

    def conversation(self) -> list[dict[str, str]]:
        """The item as a conversation: the prompt as the user's turn, the answer as the assistant's."""
        return [{"role": "user", "content": self.prompt}, {"role": "assistant", "content": self.answer}]


def exact_match(reply: str, answer: str) -> bool:
    """Whether a model's reply is the answer: equal once whitespace around both is stripped.

    Nothing else is forgiven (case, punctuation, spaces inside), since every task's answer has one
    exact form that the training items teach.
    """
    return reply.strip() == answer.strip()


def parse_task_spec(spec: str) -> list[str]:
    """The task names in a ``tasks:NAME`` or ``tasks:NAME+NAME+...`` data spec (a mixture), in order."""
    if not spec.startswith(TASK_PREFIX):
        raise TinyLMError(f"{spec!r} does not name built-in tasks; write {TASK_PREFIX}NAME or "
                          f"{TASK_PREFIX}NAME+NAME, with names from {', '.join(TASKS)}")
    names = [name.strip() for name in spec[len(TASK_PREFIX):].split("+")]
    if "" in names:
        raise TinyLMError(f"{spec!r} is missing a task name; write {TASK_PREFIX}NAME or {TASK_PREFIX}NAME+NAME, "
                          f"with names from {', '.join(TASKS)}")
    for name in names:
        _check_name(name)
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise TinyLMError(f"{spec!r} names {', '.join(repeated)} more than once; name each task once")
    return names


def _check_name(name: str) -> None:
    if name in TASKS:
        return
    close = difflib.get_close_matches(name, TASKS, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise TinyLMError(f"unknown task {name!r}{hint}; the tasks are {', '.join(TASKS)}")


def make_task(name: str, n: int, seed: int, split: str = "train") -> list[TaskItem]:
    """``n`` items of the task ``name`` from its ``split`` (``"train"`` or ``"test"``), the same for the same seed.

    Items do not repeat while the split has unused ones; past that the train split repeats them (a
    new order each pass) and the test split refuses, naming how many it has.
    """
    _check_name(name)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise TinyLMError(f"the number of task items must be a whole number of at least 1, got {n!r}")
    if split not in SPLITS:
        raise TinyLMError(f"the split must be one of {', '.join(SPLITS)}, got {split!r}")
    rng = random.Random(f"{name}\0{split}\0{seed}")
    if name == "reverse":
        return _reverse(n, rng, split == "test")
    pool = _pool(name, split)
    if split == "test" and n > len(pool):
        raise TinyLMError(f"the {name} task has {len(pool)} test items, fewer than the {n} asked for; "
                          f"ask for at most {len(pool)}")
    items: list[TaskItem] = []
    while len(items) < n:  # more than the pool: one pass after another, each in its own order
        order = list(pool)
        rng.shuffle(order)
        items.extend(order[: n - len(items)])
    return items


def is_test_item(content: str, fraction: float = TEST_FRACTION) -> bool:
    """Whether the item whose content (without its wording) is ``content`` belongs to the test split, which holds
    about ``fraction`` of the items."""
    digest = hashlib.blake2b(content.encode("utf-8"), digest_size=8, person=b"tinylm-task").digest()
    return int.from_bytes(digest, "big") < fraction * 2**64


@functools.cache
def _pool(name: str, split: str) -> tuple[TaskItem, ...]:
    """Every item of a task's split, in a fixed order; kept for the process, as the corpus tasks read Shakespeare."""
    test = split == "test"
    return tuple(item for key, item in _ITEMS[name]() if is_test_item(key) == test)


def _add_items() -> list[tuple[str, TaskItem]]:
    # a + b and b + a share a key, so the test split does not hold out a sum that trains the other way round
    return [(f"{min(a, b)}+{max(a, b)}", TaskItem(f"What is {a} + {b}?", str(a + b)))
            for a in range(100) for b in range(100)]


def _spell_items() -> list[tuple[str, TaskItem]]:
    return [(word, TaskItem(f"Spell '{word}'.", " ".join(word))) for word in words()]


def _count_items() -> list[tuple[str, TaskItem]]:
    return [(word, TaskItem(f"How many letters are in '{word}'?", str(len(word)))) for word in words()]


def _speaker_items() -> list[tuple[str, TaskItem]]:
    return [(line, TaskItem(f'Who says: "{line}"?', speaker)) for speaker, line, _ in _lines()]


def _next_line_items() -> list[tuple[str, TaskItem]]:
    return [(line, TaskItem(f'What line follows: "{line}"?', following))
            for _, line, following in _lines() if following is not None]


_ITEMS: dict[str, Callable[[], list[tuple[str, TaskItem]]]] = {
    "add": _add_items, "spell": _spell_items, "count": _count_items,
    "speaker": _speaker_items, "next-line": _next_line_items,
}


def _reverse(n: int, rng: random.Random, test: bool) -> list[TaskItem]:
    """Word sequences drawn afresh (too many to list), each kept when it is on the split's side, none twice."""
    vocabulary = words()
    if len(vocabulary) < 5:
        raise TinyLMError("the Shakespeare corpus has too few words for the reverse task")  # a damaged cache
    items, seen = [], set()
    while len(items) < n:
        chosen = rng.sample(vocabulary, rng.randint(3, 5))
        text = " ".join(chosen)
        if text in seen or is_test_item(text) != test:
            continue
        seen.add(text)
        items.append(TaskItem(f"Reverse the words: {text}", " ".join(reversed(chosen))))
    return items


# ----- reading Shakespeare ------------------------------------------------------------------------

_WORD = re.compile(r"[a-z]{3,8}")
_WORD_EDGES = ".,;:!?\"()[]{}-_"


@functools.cache
def words() -> tuple[str, ...]:
    """The corpus's lowercase alphabetic words of 3 to 8 letters seen at least twice, sorted."""
    tokens: Counter[str] = Counter()
    for text in shakespeare_texts():
        tokens.update(text.split())
    counts: Counter[str] = Counter()
    for token, count in tokens.items():  # each distinct token once: far fewer than the tokens
        word = token.strip(_WORD_EDGES)
        if _WORD.fullmatch(word):
            counts[word] += count
    return tuple(sorted(word for word, count in counts.items() if count >= 2))


def shakespeare_texts() -> list[str]:
    from tinylm.data.corpora import load_corpus  # read only by the tasks that need it

    return list(load_corpus("shakespeare").texts())


# A speech is a paragraph whose first line names the speaker: "ROMEO.", "Ham.", "FIRST WITCH.",
# "Mrs. Page."; A Midsummer Night's Dream writes its names in capitals without the full stop.
_SPEAKER = re.compile(r"[A-Z][A-Za-z'-]*\.?(?: +[A-Za-z'-]+\.?)*")
_PARAGRAPHS = re.compile(r"\n[ \t]*\n")
# ALL., BOTH., "Mar. and Ber.", CITIZENS.: a speech by more than one speaker
_GROUP_WORDS = frozenset({
    "all", "both", "and", "omnes", "citizens", "lords", "danes", "knights", "soldiers", "servants", "senators",
    "ladies", "gentlemen", "tribunes", "conspirators", "murderers", "players", "outlaws", "attendants", "witches",
})
_MIN_SPEECHES = 3  # a name heads this many speeches in its play, so that a lone short sentence is not taken for one
_MIN_WORDS = 4  # shorter lines ("My lord?") cannot be placed


def is_group(speaker: str) -> bool:
    """Whether a speech's heading names more than one speaker (ALL., BOTH., "Mar. and Ber.", CITIZENS.)."""
    return bool(_GROUP_WORDS & set(speaker.lower().replace(".", " ").split()))


@functools.cache
def _lines() -> tuple[tuple[str, str, str | None], ...]:
    """(speaker, line, the next line of the speech or None) for every line that can be asked about, in corpus order.

    Lines are stripped and their inner runs of spaces made one. A line is kept when it has at least
    `_MIN_WORDS` words, no stage direction in brackets, no double quote (the prompt quotes it), and
    it occurs once in the whole corpus, so its speaker and its next line are certain.
    """
    texts = shakespeare_texts()
    every_speech = [speech for text in texts for speech in speeches(text)]
    counts = Counter(" ".join(line.split()) for text in texts for line in text.split("\n"))
    out = []
    for speaker, lines in every_speech:
        if is_group(speaker):
            continue
        for i, line in enumerate(lines):
            if counts[line] != 1 or len(line.split()) < _MIN_WORDS or any(c in line for c in '[]"'):
                continue
            following = lines[i + 1] if i + 1 < len(lines) else None
            if following is not None and any(c in following for c in "[]"):
                following = None  # a stage direction is not the next line said
            out.append((speaker, line, following))
    return tuple(out)


def speeches(text: str) -> list[tuple[str, list[str]]]:
    """(speaker as the text writes it, less a final full stop; the speech's lines) for each speech of one play."""
    found = []
    for paragraph in _PARAGRAPHS.split(text):
        lines = [" ".join(line.split()) for line in paragraph.strip("\n").split("\n")]
        lines = [line for line in lines if line]
        if len(lines) >= 2 and len(lines[0]) <= 40 and _SPEAKER.fullmatch(lines[0]):
            if lines[0].endswith(".") or lines[0].isupper():
                found.append((lines[0], lines[1:]))
    heads = Counter(head for head, _ in found)
    return [(head.removesuffix("."), lines) for head, lines in found if heads[head] >= _MIN_SPEECHES]
