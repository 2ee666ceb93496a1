"""Where an unprompted sample starts: inside the text, not at the top of a new document.

A sample started from a run's start token alone (`tinylm.run.start_ids`) begins a new document,
and a document begins with what documents begin with: a play's title page and cast list, a
module's licence header. That is a fair picture of the data, but a poor one of what the model
learned to write. So the closing sample of a training run and `tinylm sample` without a prompt
start from a line drawn from the validation split (text the model never trained on), chosen by
the sampling seed, and say which:

- a speaker's line, where the text is a play (a name in capitals followed by a period or colon at
  the start of a line, as Shakespeare's texts write ``KING.`` or ``ROMEO:``): the sample is a speech;
- otherwise the first line of a paragraph past a document's first two (past the front matter);
- otherwise (no data folder, or nothing that fits) the start of a new document, as before.

Usage::

    opening = opening_of_shards(ShardSet.open("data/shakespeare-bpe-8192"), seed=1337)
    opening.text, opening.source   # "KING.\\n", "a speaker's line drawn from the validation split"
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# a speaker's name at the start of a line: capitals (and spaces, apostrophes, hyphens between them), then a
# period or colon ending the line or followed by the speech; "ACT I." and "SCENE II." head a scene instead
_SPEAKER = re.compile(r"^(?P<name>[A-Z][A-Z'\- ]*[A-Z])(?P<mark>[.:])(?P<rest>[ \t]|$)", re.MULTILINE)
_NOT_SPEAKERS = re.compile(r"^(ACT|SCENE|THE END|FINIS|EPILOGUE|PROLOGUE|DRAMATIS PERSONAE)\b")
# a play has many speeches; a handful of capitalised lines in prose is not one
_MIN_SPEAKER_LINES = 5
# how far into the split to look: enough for many candidates, little to decode
_SCAN_TOKENS = 100_000
_MAX_LINE_CHARS = 80

NEW_DOCUMENT = "the start of a new document"


@dataclass(frozen=True)
class Opening:
    """The text a sample starts from (after the run's start token), and what it is, for the output."""

    text: str
    source: str

    def describe(self) -> str:
        """``a speaker's line drawn from the validation split, "KING."``, or the new-document fallback."""
        return f"{self.source}, {self.text.strip()!r}" if self.text else self.source


def speaker_lines(text: str) -> list[str]:
    """Every speaker's line in ``text`` as the prompt it makes (``"KING.\\n"`` or ``"KING."`` when the speech
    follows on the same line)."""
    out = []
    for m in _SPEAKER.finditer(text):
        name = m["name"]
        if _NOT_SPEAKERS.match(name):
            continue
        out.append(f"{name}{m['mark']}" + ("\n" if m["rest"] == "" else ""))
    return out


def paragraph_lines(documents: list[str]) -> list[str]:
    """The first line of each paragraph past a document's first two, cut to whole words within
    `_MAX_LINE_CHARS`, with its newline when it is whole."""
    out = []
    for doc in documents:
        paragraphs = [p for p in re.split(r"\n[ \t]*\n", doc) if p.strip()]
        for paragraph in paragraphs[2:]:
            line = paragraph.strip("\n").split("\n", 1)[0].rstrip()
            if not line.strip():
                continue
            if len(line) > _MAX_LINE_CHARS:
                line = line[:_MAX_LINE_CHARS].rsplit(" ", 1)[0]
            else:
                line += "\n"
            out.append(line)
    return out


def opening_of_text(documents: list[str], seed: int | None, where: str = "the validation split") -> Opening:
    """A line of ``documents`` to start a sample from, drawn by ``seed`` (None: at random; the rules are in the
    module docstring)."""
    rng = random.Random(seed)
    speakers = [line for doc in documents for line in speaker_lines(doc)]
    if len(speakers) >= _MIN_SPEAKER_LINES:
        return Opening(rng.choice(speakers), f"a speaker's line drawn from {where}")
    paragraphs = paragraph_lines(documents)
    if paragraphs:
        return Opening(rng.choice(paragraphs), f"a paragraph's first line drawn from {where}, past its "
                       "document's opening")
    return Opening("", NEW_DOCUMENT)


def opening_of_shards(shards: Any, seed: int | None) -> Opening:
    """`opening_of_text` over the start of ``shards``' validation split (a `tinylm.data.shards.ShardSet`)."""
    tokens = np.asarray(shards.tokens("val")[:_SCAN_TOKENS])
    tokenizer = shards.tokenizer()
    cuts = np.flatnonzero(tokens == shards.eos_id)
    documents = [tokenizer.decode(piece.tolist()) for piece in np.split(tokens, cuts) if len(piece)]
    documents = [doc for doc in documents if doc.strip()]
    return opening_of_text(documents, seed)


def opening_of_run(info: dict[str, Any], seed: int | None) -> Opening:
    """The opening for a trained run, from the data folder its run.json records; a new document when the
    folder is gone or holds other tokens than the run's tokenizer makes."""
    from tinylm.data.shards import ShardSet
    from tinylm.errors import TinyLMError

    data = info.get("data") or {}
    folder = data.get("dir")
    if not folder or not Path(folder).is_dir():
        return Opening("", f"{NEW_DOCUMENT} (the run's data folder is not there to draw a line from)")
    try:
        shards = ShardSet.open(folder)
    except TinyLMError:
        return Opening("", f"{NEW_DOCUMENT} (the run's data folder {folder} is unreadable)")
    recorded = data.get("tokenizer_fingerprint")
    if recorded is not None and shards.meta["tokenizer"]["fingerprint"] != recorded:
        return Opening("", f"{NEW_DOCUMENT} (the data folder {folder} now holds another tokenizer's shards)")
    return opening_of_shards(shards, seed)
