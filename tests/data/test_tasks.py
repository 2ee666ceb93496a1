"""Built-in tasks: every answer checked against its prompt (or the Shakespeare text) by other means, train and
test items apart, the same items for the same seed, task specs and exact match."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from tinylm.data import tasks
from tinylm.data.tasks import TASKS, TaskItem, exact_match, is_test_item, make_task, parse_task_spec
from tinylm.errors import TinyLMError

SEEDS = (0, 1, 7)


@pytest.fixture(scope="module")
def corpus_lines(shakespeare_corpus) -> list[str]:
    """Every line of the corpus with its spaces made single, the plays separated by an empty line."""
    return [" ".join(line.split()) for text in shakespeare_corpus.texts() for line in text.split("\n") + [""]]


@pytest.fixture(scope="module")
def line_counts(corpus_lines) -> Counter[str]:
    return Counter(corpus_lines)


def matches(pattern: str, items: list[TaskItem]) -> list[tuple[re.Match, str]]:
    out = []
    for item in items:
        m = re.fullmatch(pattern, item.prompt)
        assert m, item.prompt
        out.append((m, item.answer))
    return out


# ----- answers ------------------------------------------------------------------------------------


@pytest.mark.parametrize("split", ["train", "test"])
def test_add_answers_are_the_sums(split):
    for seed in SEEDS:
        for m, answer in matches(r"What is (\d+) \+ (\d+)\?", make_task("add", 500, seed, split)):
            a, b = int(m[1]), int(m[2])
            assert 0 <= a <= 99 and 0 <= b <= 99
            assert answer == str(a + b)


def test_add_known_items():
    sums = {item.prompt: item.answer for split in tasks.SPLITS for item in tasks._pool("add", split)}
    assert len(sums) == 100 * 100
    assert sums["What is 23 + 58?"] == "81" and sums["What is 99 + 1?"] == "100"
    assert sums["What is 0 + 0?"] == "0" and sums["What is 99 + 99?"] == "198"
    # more items than the train split holds: every train item is among them
    assert set(make_task("add", 20_000, 0)) == set(tasks._pool("add", "train"))


@pytest.mark.parametrize("split", ["train", "test"])
def test_spell_count_and_reverse_answers(shakespeare_text, split):
    words = set(re.findall(r"[a-z]+", shakespeare_text))
    for seed in SEEDS:
        for m, answer in matches(r"Spell '([a-z]{3,8})'\.", make_task("spell", 300, seed, split)):
            assert m[1] in words
            assert answer == " ".join(m[1]) and answer.replace(" ", "") == m[1]
        for m, answer in matches(r"How many letters are in '([a-z]{3,8})'\?", make_task("count", 300, seed, split)):
            assert m[1] in words and answer == str(len(m[1]))
        for m, answer in matches(r"Reverse the words: ([a-z ]+)", make_task("reverse", 300, seed, split)):
            said = m[1].split(" ")
            assert 3 <= len(said) <= 5 and set(said) <= words
            assert answer.split(" ") == said[::-1]


def test_known_word_items():
    assert TaskItem("Spell 'water'.", "w a t e r").conversation() == [
        {"role": "user", "content": "Spell 'water'."}, {"role": "assistant", "content": "w a t e r"},
    ]
    spelled = {item.prompt: item.answer for item in make_task("spell", 50_000, 0)}
    counted = {item.prompt: item.answer for item in make_task("count", 50_000, 0)}
    word = "water" if not is_test_item("water") else "king"
    assert spelled[f"Spell '{word}'."] == " ".join(word)
    assert counted[f"How many letters are in '{word}'?"] == str(len(word))


def head_of_speech(lines: list[str], i: int) -> str:
    """The first line of the paragraph holding line ``i``, found by walking up to a blank line."""
    while i > 0 and lines[i - 1]:
        i -= 1
    return lines[i]


@pytest.mark.parametrize("split", ["train", "test"])
def test_speaker_answers_are_the_speakers_in_the_text(corpus_lines, line_counts, split):
    where = {line: i for i, line in enumerate(corpus_lines)}
    for seed in SEEDS:
        for m, answer in matches(r'Who says: "(.+)"\?', make_task("speaker", 100, seed, split)):
            line = m[1]
            assert line_counts[line] == 1 and len(line.split()) >= 4
            head = head_of_speech(corpus_lines, where[line])
            assert head in (answer, answer + ".")
            assert not {"ALL", "BOTH"} & set(answer.upper().split()) and " and " not in answer


@pytest.mark.parametrize("split", ["train", "test"])
def test_next_line_answers_follow_in_the_text(corpus_lines, line_counts, split):
    where = {line: i for i, line in enumerate(corpus_lines)}
    for seed in SEEDS:
        for m, answer in matches(r'What line follows: "(.+)"\?', make_task("next-line", 100, seed, split)):
            line = m[1]
            assert line_counts[line] == 1
            assert corpus_lines[where[line] + 1] == answer != ""


def test_known_lines(shakespeare_corpus):
    # worked out by reading the plays: the speaker as each text names them
    known = {
        "To be, or not to be,--that is the question:--": ("Ham", "Whether 'tis nobler in the mind to suffer"),
        "Friends, Romans, countrymen, lend me your ears;": ("ANTONY", "I come to bury Caesar, not to praise him."),
        "O Romeo, Romeo! wherefore art thou Romeo?": ("Juliet", "Deny thy father and refuse thy name;"),
    }
    for line, (speaker, following) in known.items():
        split = "test" if is_test_item(line) else "train"
        said = {item.prompt: item.answer for item in tasks._pool("speaker", split)}
        followed = {item.prompt: item.answer for item in tasks._pool("next-line", split)}
        assert said[f'Who says: "{line}"?'] == speaker
        assert followed[f'What line follows: "{line}"?'] == following


def test_group_speeches_and_short_lines_are_not_asked(shakespeare_corpus):
    speakers = Counter(item.answer for split in ("train", "test") for item in tasks._pool("speaker", split))
    assert not {"ALL", "BOTH", "Both", "CITIZENS", "LORDS", "Mar. and Ber"} & set(speakers)
    assert {"Ham", "IAGO", "Juliet", "FIRST WITCH", "MRS. PAGE", "HERMIA"} <= set(speakers)
    # "Double, double toil and trouble" is said by ALL, and "My lord?" by many: neither is asked about
    prompts = {item.prompt for split in ("train", "test") for item in tasks._pool("speaker", split)}
    assert not any("Double, double toil and trouble" in p or p == 'Who says: "My lord?"?' for p in prompts)


# ----- splits and determinism ---------------------------------------------------------------------


@pytest.mark.parametrize("name", list(TASKS))
def test_train_and_test_never_share_an_item(shakespeare_corpus, name):
    train = {item.prompt for seed in SEEDS for item in make_task(name, 3000, seed)}
    test = {item.prompt for seed in SEEDS for item in make_task(name, 300, seed, "test")}
    assert len(test) > 300 and not train & test


def test_held_out_content_is_held_out_across_wordings_and_sibling_tasks(shakespeare_corpus):
    train_sums = {tuple(sorted(map(int, re.findall(r"\d+", item.prompt)))) for item in make_task("add", 20_000, 0)}
    test_sums = {tuple(sorted(map(int, re.findall(r"\d+", item.prompt)))) for item in make_task("add", 300, 0, "test")}
    assert not train_sums & test_sums  # 23 + 58 held out holds out 58 + 23 too
    spell_test = {re.search(r"'(\w+)'", item.prompt)[1] for item in make_task("spell", 500, 0, "test")}
    count_train = {re.search(r"'(\w+)'", item.prompt)[1] for item in make_task("count", 20_000, 0)}
    assert spell_test and not spell_test & count_train


def test_test_split_is_about_a_tenth():
    n_test = sum(is_test_item(f"{a}+{b}") for a in range(100) for b in range(a, 100))
    assert 0.07 < n_test / 5050 < 0.13
    with pytest.raises(TinyLMError, match=r"the add task has \d+ test items, fewer than the 5000 asked for"):
        make_task("add", 5000, 0, "test")


@pytest.mark.parametrize("name", list(TASKS))
def test_same_seed_same_items_other_seed_other_items(shakespeare_corpus, name):
    first = make_task(name, 200, 5)
    assert make_task(name, 200, 5) == first
    assert make_task(name, 200, 6) != first
    assert make_task(name, 50, 5, "test") == make_task(name, 50, 5, "test")
    assert len(set(first)) == 200  # no repeats while the split has items left


def test_more_than_the_split_holds_repeats_each_item_evenly():
    items = make_task("add", 20_000, 0)
    counts = Counter(items)
    assert len(items) == 20_000 and set(counts.values()) <= {2, 3}  # about 9,000 train items, each two or three times


# ----- names, specs, exact match ------------------------------------------------------------------


def test_parse_task_spec():
    assert parse_task_spec("tasks:add") == ["add"]
    assert parse_task_spec("tasks:add+spell") == ["add", "spell"]
    assert parse_task_spec("tasks:next-line+speaker+count") == ["next-line", "speaker", "count"]
    assert parse_task_spec("tasks: add + reverse") == ["add", "reverse"]


@pytest.mark.parametrize("spec, message", [
    ("tasks:ad", r"unknown task 'ad' \(did you mean 'add'\?\); the tasks are add, spell, count, reverse, speaker, "
                 r"next-line"),
    ("tasks:add+next_line", r"unknown task 'next_line' \(did you mean 'next-line'\?\)"),
    ("tasks:algebra", r"unknown task 'algebra'; the tasks are add, spell"),
    ("tasks:", r"'tasks:' is missing a task name"),
    ("tasks:add+", r"'tasks:add\+' is missing a task name"),
    ("add", r"'add' does not name built-in tasks; write tasks:NAME"),
    ("tasks:add+spell+add", r"names add more than once"),
])
def test_parse_task_spec_errors(spec, message):
    with pytest.raises(TinyLMError, match=message):
        parse_task_spec(spec)


def test_make_task_refusals():
    with pytest.raises(TinyLMError, match=r"unknown task 'multiply'; the tasks are add"):
        make_task("multiply", 10, 0)
    for n in (0, -3, 2.5, True, "10"):
        with pytest.raises(TinyLMError, match=r"a whole number of at least 1"):
            make_task("add", n, 0)
    with pytest.raises(TinyLMError, match=r"the split must be one of train, test, got 'val'"):
        make_task("add", 10, 0, "val")


def test_exact_match():
    assert exact_match("81", "81")
    assert exact_match("  81\n", "81")
    assert exact_match("w a t e r\n", " w a t e r")
    assert not exact_match("81.", "81")
    assert not exact_match("The answer is 81", "81")
    assert not exact_match("W a t e r", "w a t e r")
    assert not exact_match("w  a t e r", "w a t e r")
    assert not exact_match("", "81")
