"""How a text splits into tokens: the pieces with their ids and byte counts, as a table and a picture.

    from tinylm.tokenizers import load_tokenizer
    from tinylm.explain.tokens import token_pieces, format_pieces, plot_pieces
    pieces = token_pieces(load_tokenizer("tok.json"), "To be, or not to be", merges=True)
    print(format_pieces(pieces)); plot_pieces(pieces, "tokens.png")

Works for every tokenizer kind (`Tokenizer.pieces`): a char tokenizer gives one piece a character,
a word tokenizer one a word or space, a BPE tokenizer pieces of any length. A piece of BPE may be
only part of a character's UTF-8 bytes; its text then shows U+FFFD, and the byte count tells.

For a BPE tokenizer (tinylm's or an imported byte-level one), ``merges=True`` also gives the merge
steps that built each piece: a token made by merge r is the pair (a, b) of ``merges[r]``, each of
which was made the same way, down to single bytes. Every step's rank is smaller than the rank of the merge that
uses its result, so listing the ranks in increasing order is the order in which training learned them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from tinylm.errors import TinyLMError
from tinylm.explain.plots import save_figure
from tinylm.tokenizers import BPETokenizer, Tokenizer


@dataclass
class Piece:
    """One token of a text: its id, its bytes, and (BPE with ``merges``) the merge ranks that built it."""

    token_id: int
    token_bytes: bytes
    merges: list[int] | None = field(default=None)

    @property
    def text(self) -> str:
        return self.token_bytes.decode("utf-8", errors="replace")

    @property
    def n_bytes(self) -> int:
        return len(self.token_bytes)

    def to_json(self) -> dict:
        row = {"id": self.token_id, "text": self.text, "bytes": list(self.token_bytes), "n_bytes": self.n_bytes}
        if self.merges is not None:
            row["merges"] = self.merges
        return row


def merge_table(tokenizer: Tokenizer) -> dict[int, int]:
    """For a BPE tokenizer with a merge list (tinylm's, or an imported byte-level one): the id each merge
    made -> that merge's rank. tinylm's merge r makes id 256 + r; an imported tokenizer's ids can be in
    any order, so the made token is found by its bytes."""
    merges = getattr(tokenizer, "merges", None)
    if not merges:
        raise TinyLMError(f"--merges shows how a BPE tokenizer built its tokens from a merge list; this "
                          f"{tokenizer.kind} tokenizer has none")
    if isinstance(tokenizer, BPETokenizer):
        return {256 + rank: rank for rank in range(len(merges))}
    by_bytes = {}
    for i in range(tokenizer.vocab_size):
        if not tokenizer.is_special(i):
            by_bytes.setdefault(tokenizer.token_bytes(i), i)
    made = {by_bytes.get(tokenizer.token_bytes(a) + tokenizer.token_bytes(b)): rank
            for rank, (a, b) in enumerate(merges)}
    made.pop(None, None)
    return made


def merge_ranks(tokenizer: Tokenizer, token_id: int, table: dict[int, int] | None = None) -> list[int]:
    """The ranks of the merges that built ``token_id`` from single bytes, in the order training learned them."""
    table = merge_table(tokenizer) if table is None else table
    ranks: list[int] = []
    stack = [token_id]
    while stack:
        rank = table.get(stack.pop())
        if rank is not None:  # single bytes and special tokens were never merged
            ranks.append(rank)
            stack.extend(tokenizer.merges[rank])
    return sorted(ranks)


def token_pieces(tokenizer: Tokenizer, text: str, merges: bool = False) -> list[Piece]:
    """The pieces of ``text`` (special tokens are read as plain text); ``merges`` needs a BPE tokenizer."""
    table = merge_table(tokenizer) if merges else None
    return [Piece(i, b, merge_ranks(tokenizer, i, table) if merges else None) for i, b in tokenizer.pieces(text)]


def format_pieces(pieces: list[Piece]) -> str:
    """A plain-text table, one piece a line: position, id, bytes, the text in quotes (and the merge ranks)."""
    show_merges = any(p.merges is not None for p in pieces)
    lines = [f"{'#':>4}  {'id':>7}  {'bytes':>5}  {'piece':<18}" + ("  merges (rank order)" if show_merges else "")]
    for n, p in enumerate(pieces):
        shown = repr(p.text) if "\ufffd" not in p.text else repr(p.token_bytes)
        merges = "  " + (" ".join(map(str, p.merges)) or "-") if show_merges and p.merges is not None else ""
        lines.append(f"{n:>4}  {p.token_id:>7}  {p.n_bytes:>5}  {shown:<18}{merges}")
    total = sum(p.n_bytes for p in pieces)
    lines.append(f"{len(pieces)} tokens for {total} bytes ({total / max(len(pieces), 1):.2f} bytes per token)")
    return "\n".join(lines)


def plot_pieces(pieces: list[Piece], path: str | os.PathLike, title: str | None = None, per_row: int = 12) -> Path:
    """The pieces as coloured boxes in reading order, each with its text above and its id below (and, where the
    pieces carry them, the merge ranks that built it), into ``path``."""
    fig, ax = pieces_figure(pieces, per_row)
    return save_figure(fig, ax, path, title or f"{len(pieces)} tokens, {sum(p.n_bytes for p in pieces)} bytes")


def pieces_figure(pieces: list[Piece], per_row: int = 12):
    """`plot_pieces`' figure and axes, before the title and the file. A box's colour is its id's: the same
    token is the same colour wherever it occurs, and ids take the colours in the order they first appear."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    if not pieces:
        raise TinyLMError("the text has no tokens to draw; give a non-empty --text")
    rows = (len(pieces) + per_row - 1) // per_row
    fig = Figure(figsize=(min(per_row, len(pieces)) * 0.95 + 0.4, 0.9 * rows + 0.5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    colours = [f"C{k}" for k in range(10)]
    first_seen = {i: k for k, i in enumerate(dict.fromkeys(p.token_id for p in pieces))}
    for n, p in enumerate(pieces):
        x, y = n % per_row, -(n // per_row)
        ax.add_patch(Rectangle((x + 0.04, y + 0.05), 0.92, 0.6, color=colours[first_seen[p.token_id] % len(colours)],
                               alpha=0.35))
        shown = p.text.replace("\n", "\\n").replace(" ", "\u2423")  # an open box for a space, so it can be seen
        ax.text(x + 0.5, y + 0.38, shown, ha="center", va="center", fontsize=9, family="monospace")
        ax.text(x + 0.5, y - 0.08, f"{p.token_id} ({p.n_bytes}B)", ha="center", va="center", fontsize=6.5,
                color="0.3")
        if p.merges is not None:  # --merges: the ranks under the id, as the table lists them
            ranks = " ".join(map(str, p.merges[:4])) + (" ..." if len(p.merges) > 4 else "")
            ax.text(x + 0.5, y - 0.24, f"m {ranks}" if p.merges else "m -", ha="center", va="center", fontsize=5.5,
                    color="0.45")
    ax.set_xlim(0, min(per_row, len(pieces)))
    ax.set_ylim(-rows + (0.6 if any(p.merges is not None for p in pieces) else 0.8), 0.75)
    ax.set_axis_off()
    return fig, ax


__all__ = ["Piece", "format_pieces", "merge_ranks", "pieces_figure", "plot_pieces", "token_pieces"]
