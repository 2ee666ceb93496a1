"""Make a chat file that teaches a new reply pattern: ``Repeat after me: WORDS`` answered ``You said: WORDS``.

The words are 2 to 4 drawn at random from the plays' ``--vocabulary`` most frequent lowercase words of 3 to 9
letters (2,000 by default; every held-out prompt is a combination no training prompt has), so the model has
to copy what the user wrote. Writes ``said.jsonl`` (training) and ``said_val.jsonl`` (held out) in OpenAI
chat form::

    python benchmarks/echo_chats.py --out /tmp/said
    tinylm finetune --from runs/tiny-shakespeare --data /tmp/said/said.jsonl \\
        --val-data /tmp/said/said_val.jsonl --out runs/said --max-steps 500
    tinylm eval --run runs/said --task /tmp/said/said_val.jsonl

This is a measurement's data, not a test.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from collections import Counter
from pathlib import Path

from tinylm.data.corpora import load_corpus


def vocabulary(size: int) -> list[str]:
    """The plays' ``size`` most frequent lowercase words of 3 to 9 letters."""
    counts = Counter(w for text in load_corpus("shakespeare").texts() for w in re.findall(r"[a-z]+", text.lower()))
    return sorted(w for w, _ in Counter({w: n for w, n in counts.items() if 3 <= len(w) <= 9}).most_common(size))


def chat(words: list[str]) -> dict:
    said = " ".join(words)
    return {"messages": [{"role": "user", "content": f"Repeat after me: {said}"},
                         {"role": "assistant", "content": f"You said: {said}"}]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="the folder to write said.jsonl and said_val.jsonl in")
    parser.add_argument("--train", type=int, default=3000, help="training conversations (default: 3000)")
    parser.add_argument("--val", type=int, default=200, help="held-out conversations (default: 200)")
    parser.add_argument("--vocabulary", type=int, default=2000, help="draw from this many of the most frequent "
                        "words (default: 2000; more means rarer words, which a small model copies less well)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    words = vocabulary(args.vocabulary)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    seen: set[str] = set()
    for name, n in (("said.jsonl", args.train), ("said_val.jsonl", args.val)):
        lines = []
        while len(lines) < n:
            picked = rng.sample(words, rng.randint(2, 4))
            if " ".join(picked) not in seen:  # no held-out prompt is also a training prompt
                seen.add(" ".join(picked))
                lines.append(json.dumps(chat(picked)))
        (out / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"{out / 'said.jsonl'}: {args.train} conversations, {out / 'said_val.jsonl'}: {args.val}, "
          f"words from a vocabulary of {len(words):,}")


if __name__ == "__main__":
    main()
