"""Text as it is generated: decode tokens into text pieces, hold back what is not yet certain.

Two things make "print each token as it arrives" wrong:

1. **Characters split across tokens.** A byte-level BPE token may end in the middle of a UTF-8
   character: an emoji is four bytes and can arrive as two tokens. Decoding each token alone
   prints garbage (U+FFFD) for both halves. `tinylm.tokenizers.StreamDecoder` holds the
   incomplete bytes back until the character completes.
2. **Stop strings split across tokens.** With the stop string "\\n\\n", a token "\\n" might be the
   start of it or just a newline; printing it before the next token arrives could print text
   that turns out to belong to the stop string (which is never part of the output). So the
   longest end of the pending text that could still grow into a stop string is held back until
   the next token decides.

`TextStream` does both for one sample; the engine keeps one per sample, and its `stream`
(`tinylm.generate.engine`) yields the pieces of one prompt's completion. Joining all pieces always
gives the completion's final text.
"""

from __future__ import annotations

from collections.abc import Sequence

from tinylm.tokenizers.base import Tokenizer


class TextStream:
    """Token ids in, safe text pieces out, for one sample; notices stop strings.

    ``push(token)`` returns the text that became certain (often "", never part of a stop string
    or of an unfinished character); after a stop string completes, ``stopped_by`` is that string
    and later pushes return "". ``finish()`` returns whatever was held back once no more tokens
    will come. ``text`` is everything returned so far.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        self.decoder = tokenizer.stream_decoder()
        self.stop = tuple(stop)
        self.pending = ""  # decoded, complete characters not yet released
        self.text = ""  # released so far
        self.stopped_by: str | None = None

    def push(self, token_id: int) -> str:
        if self.stopped_by is not None:
            return ""
        self.pending += self.decoder.push(token_id)
        return self._release(final=False)

    def finish(self) -> str:
        if self.stopped_by is not None:
            return ""
        self.pending += self.decoder.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        hit = self._first_stop()
        if hit is not None:
            position, stop = hit
            out, self.pending, self.stopped_by = self.pending[:position], "", stop
        else:
            keep = 0 if final else self._held_back()
            cut = len(self.pending) - keep
            out, self.pending = self.pending[:cut], self.pending[cut:]
        self.text += out
        return out

    def _first_stop(self) -> tuple[int, str] | None:
        """The earliest complete stop string in the pending text: (where it starts, which one)."""
        found = [(i, s) for s in self.stop if (i := self.pending.find(s)) >= 0]
        return min(found) if found else None

    def _held_back(self) -> int:
        """How many trailing characters could be the start of a stop string (0 if none)."""
        longest = max((len(s) for s in self.stop), default=1)
        for k in range(min(len(self.pending), longest - 1), 0, -1):
            tail = self.pending[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0
