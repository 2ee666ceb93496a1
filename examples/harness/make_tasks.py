"""Write the example lm-evaluation-harness tasks' data: the last word of lines of Shakespeare's verse.

Each item is two consecutive lines of verse from the complete works, the second without its last word:

    {"context": "Crowns him with flowers, and makes him all her joy:\\nAnd now they never meet in grove or",
     "answer": "green", "choices": ["true", "horrible", "spotted", "green"], "label": 3}

`shakespeare_cloze.yaml` asks the model to pick the answer among the four words by log-likelihood
(multiple choice; the three others are the last words of other items' lines); `shakespeare_lastword.yaml`
asks it to write the word greedily (generation, scored by exact match on the first word written).
The first ``FEWSHOT`` items go to fewshot.jsonl (the examples `--shots K` draws from), the rest to test.jsonl.

    python examples/harness/make_tasks.py          # rewrites fewshot.jsonl and test.jsonl beside this file
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from tinylm.data import load_corpus

FEWSHOT = 20
TEST = 100
CHOICES = 4
SEED = 0

# a line of verse: starts with a capital, no stage direction, ends with a lowercase word (3+ letters), then
# punctuation or nothing
LAST_WORD = re.compile(r"^(?P<head>[A-Z][^\[\]_]*?) (?P<word>[a-z]{3,})[,.;:!?]?$")


def verse_pairs(text: str) -> list[tuple[str, str, str]]:
    """(previous line, the line without its last word, the last word) for every line that fits `LAST_WORD`,
    whose previous line is verse too (not a speaker's name, a heading or a blank)."""
    lines = [line.strip() for line in text.splitlines()]
    pairs = []
    for before, line in zip(lines, lines[1:]):
        found = LAST_WORD.match(line)
        if not found or not 6 <= len(line.split()) <= 12:
            continue
        if len(before.split()) < 5 or before.isupper():
            continue
        pairs.append((before, found["head"], found["word"]))
    return pairs


def items(seed: int = SEED) -> list[dict]:
    """``FEWSHOT + TEST`` items drawn at random from the whole works, each with three distractor words."""
    pairs = [p for text in load_corpus("shakespeare").texts() for p in verse_pairs(text)]
    rng = random.Random(seed)
    chosen = rng.sample(pairs, FEWSHOT + TEST)
    words = sorted({word for _, _, word in chosen})
    made = []
    for before, head, word in chosen:
        choices = [word] + rng.sample([w for w in words if w != word], CHOICES - 1)
        rng.shuffle(choices)
        made.append({"context": f"{before}\n{head}", "answer": word, "choices": choices,
                     "label": choices.index(word)})
    return made


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")


def main() -> None:
    here = Path(__file__).parent
    made = items()
    write_jsonl(here / "fewshot.jsonl", made[:FEWSHOT])
    write_jsonl(here / "test.jsonl", made[FEWSHOT:])
    print(f"wrote {FEWSHOT} few-shot and {TEST} test items to {here}")


if __name__ == "__main__":
    main()
