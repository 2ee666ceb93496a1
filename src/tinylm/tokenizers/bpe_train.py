"""Training byte-level BPE: learn the merge list from text, fast enough for hundreds of MB.

The algorithm is the plain one (count the adjacent pairs of every chunk's tokens, merge the most
frequent into a new token, repeat), with the same answer made fast: distinct chunks are counted
once in parallel, pair counts are updated only around each merge, a lazy max-heap finds the next
pair, ties go to the smallest pair, and a long text streams in pieces that move no chunk
boundary. docs/tokenizers.md ("Training fast") explains each step and why it is exact.

Usage::

    from tinylm.data import load_corpus
    from tinylm.tokenizers.bpe import PATTERNS

    texts = load_corpus("shakespeare").texts()  # a generator: one play at a time
    merges = train_merges(texts, vocab_size=8192, pattern=PATTERNS["gpt4"], progress=True)
    # or, for a ready tokenizer: tinylm.tokenizers.train_bpe(texts, 8192, "gpt4")
"""

from __future__ import annotations

import functools
import heapq
import itertools
import multiprocessing
import os
import warnings
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from typing import Any

import regex

from tinylm.errors import TinyLMError
from tinylm.tokenizers.base import special_token_names
from tinylm.tokenizers.bpe import PATTERNS, BPETokenizer, resolve_pattern
from tinylm.workers import in_order

# A text longer than this (in characters) is cut into pieces of about this size before it is
# split into chunks, so that one giant document does not become one giant list of chunks.
PIECE_CHARS = 1 << 20
# How much text (in characters) one counting task gets: small enough to keep every worker
# busy and memory flat, big enough that sending it to a worker costs little next to counting.
BATCH_CHARS = 1 << 18
# Below this much text, starting worker processes costs more than it saves: count in-process.
POOL_MIN_CHARS = 1 << 21

# Patterns for which cutting a text at a "safe cut" provably keeps every chunk the same (the
# argument is in `split_long_text`). Other patterns, "none" included, are never cut.
_CUTTABLE_PATTERNS = frozenset({PATTERNS["gpt2"], PATTERNS["gpt4"]})
# The safe cuts, as zero-width matches: right after a lone "\n" that has a non-whitespace
# character on each side, or between a letter and a space followed by a letter. `\s`, `\S`
# and `\p{L}` here mean exactly what they mean in the patterns.
_SAFE_CUT = regex.compile(r"(?<=\S\n)(?=\S)|(?<=\p{L})(?= \p{L})")


def train_merges(
    texts: Iterable[str],
    vocab_size: int,
    pattern: str,
    n_reserved: int = 0,
    workers: int | None = None,
    progress: bool = False,
) -> list[tuple[int, int]]:
    """Learn BPE merges from ``texts`` so the vocabulary, special tokens included, has ``vocab_size`` ids.

    ``texts`` is any iterable of documents (a list, or a generator that streams a corpus);
    a single string counts as one document. ``pattern`` is a resolved split regex (a value of
    `PATTERNS`, or the user's own). The vocabulary is the 256 bytes, the merges, then the
    special tokens (bos, eos, pad and ``n_reserved`` reserved ones), so
    ``vocab_size - 256 - 3 - n_reserved`` merges are learned, or fewer if the text runs out
    of pairs. ``workers`` processes count chunks (default: every core; 1 means no pool);
    ``progress`` shows a tqdm bar over the merges.
    Returns the merges in rank order: merge r joins ``(left, right)`` into token ``256 + r``.
    """
    n_special = len(special_token_names(n_reserved))
    minimum = 256 + n_special
    if vocab_size < minimum:
        raise TinyLMError(
            f"vocab_size {vocab_size} is too small: byte-level BPE needs at least {minimum} "
            f"(256 bytes + {n_special} special tokens)"
        )
    n_merges = vocab_size - minimum
    chunk_counts = count_chunks(texts, pattern, workers=workers)
    words = [list(chunk.encode("utf-8")) for chunk in chunk_counts]
    freqs = list(chunk_counts.values())
    del chunk_counts
    merges = _learn_merges(words, freqs, n_merges, progress)
    if len(merges) < n_merges:
        warnings.warn(
            f"the training text ran out of pairs to merge after {len(merges)} of {n_merges} merges; "
            f"the vocabulary has {minimum + len(merges)} tokens instead of {vocab_size}",
            stacklevel=2,
        )
    return merges


# ----- step 1: pre-tokenize and count, in parallel ------------------------------------------


def count_chunks(texts: Iterable[str], pattern: str, workers: int | None = None) -> Counter[str]:
    """How many times each distinct chunk of ``pattern`` occurs in ``texts``.

    Texts are read lazily, in batches of about `BATCH_CHARS` characters; a text longer than
    `PIECE_CHARS` is cut first where that cannot change its chunks (`split_long_text`). Once
    there is more than `POOL_MIN_CHARS` of text, the batches are counted by a pool of
    ``workers`` processes (default: one per core; 1 means count here).
    """
    if isinstance(texts, str):
        texts = [texts]
    if workers is None:
        workers = os.cpu_count() or 1
    if workers < 1:
        raise TinyLMError(f"workers must be 1 or more, got {workers}")
    if multiprocessing.current_process().daemon:
        workers = 1  # a daemon process (say, a data-loader worker) may not start processes
    max_piece = PIECE_CHARS if pattern in _CUTTABLE_PATTERNS else None
    batches = _batches(_pieces(texts, max_piece), BATCH_CHARS)

    # Read batches until there is enough text to be worth a pool, or the texts end.
    first: list[list[str]] = []
    seen = 0
    for batch in batches:
        first.append(batch)
        seen += sum(map(len, batch))
        if seen >= POOL_MIN_CHARS:
            break
    all_batches = itertools.chain(first, batches)

    total: Counter[str] = Counter()
    if workers == 1 or seen < POOL_MIN_CHARS:
        for batch in all_batches:
            _count_batch(pattern, batch, total)
        return total
    counted = in_order(functools.partial(_count_batch, pattern), all_batches, workers=workers,
                       died="a chunk-counting worker process died")
    for _, counts in counted:
        total.update(counts)
    return total


def _count_batch(pattern: str, texts: list[str], counts: Counter[str] | None = None) -> Counter[str]:
    """Add the chunks of ``texts`` to ``counts`` (a new Counter by default); runs in the workers."""
    if counts is None:
        counts = Counter()
    findall = regex.compile(pattern).findall  # `regex` caches compiled patterns
    for text in texts:
        counts.update(findall(text))
    return counts


def _pieces(texts: Iterable[str], max_piece: int | None) -> Iterator[str]:
    for text in texts:
        if not isinstance(text, str):
            raise TinyLMError(f"training texts must be str, got {type(text).__name__}")
        if max_piece is None or len(text) <= max_piece:
            yield text
        else:
            yield from split_long_text(text, max_piece)


def _batches(pieces: Iterable[str], batch_chars: int) -> Iterator[list[str]]:
    batch: list[str] = []
    size = 0
    for piece in pieces:
        batch.append(piece)
        size += len(piece)
        if size >= batch_chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def split_long_text(text: str, max_chars: int) -> Iterator[str]:
    """Cut ``text`` into pieces of a little over ``max_chars`` that chunk exactly like the whole.

    Only for the GPT-2 and GPT-4 patterns. A cut goes where no chunk of those patterns can
    cross it and where the end of the text cannot change how the text before it chunks:

    1. right after a lone line break between non-space characters: ``"question.\\n|Enter"``;
    2. before a space that sits between two letters: ``"to| be"``.

    Why the chunks stay the same. The patterns have no look-behind, so from a cut onward the
    pieces chunk exactly as the whole text does, as long as no chunk of the whole text runs
    across the cut. None does: a chunk holding a "\\n" is a run of whitespace (it stops at the
    non-space after the cut) or, in GPT-4, punctuation followed by line breaks (stops there
    too), and no chunk goes from a "\\n" on into letters; a run of letters stops at a space,
    and a chunk that starts with a space starts a new chunk. Before a cut, only a run of
    whitespace that touches the end could chunk differently, through ``\\s++$`` and
    ``\\s+(?!\\S)``: " \\n" at the very end is one chunk, but followed by a letter GPT-2
    makes it " " and "\\n". That is why rule 1 wants a non-space before the "\\n": the run is
    then the lone "\\n", one chunk (or the tail of a punctuation chunk) either way. Rule 2
    leaves no whitespace at the end at all. ("\\r\\n" line ends are not cut by rule 1:
    GPT-2 chunks them differently at the end of a text.)

    A text with no safe cut after ``max_chars`` is yielded in one piece.
    """
    start = 0
    while len(text) - start > max_chars:
        m = _SAFE_CUT.search(text, start + max_chars)
        if m is None:
            break
        yield text[start : m.start()]
        start = m.start()
    yield text[start:]


# ----- steps 2 and 3: merge the most frequent pair, updating counts incrementally ------------


def _learn_merges(
    words: list[list[int]], freqs: list[int], n_merges: int, progress: bool
) -> list[tuple[int, int]]:
    """The merge loop. ``words[i]`` (token ids) occurs ``freqs[i]`` times; edits ``words`` in place."""
    pair_counts, where = _count_pairs(words, freqs)
    # A min-heap on -count is a max-heap on count; equal counts pop the smallest pair first.
    heap = [(-count, a, b) for (a, b), count in pair_counts.items()]
    heapq.heapify(heap)

    vocab = [bytes([i]) for i in range(256)]  # token id -> its bytes
    known = set(vocab)  # every token's bytes, to refuse duplicates
    merges: list[tuple[int, int]] = []
    bar = _progress_bar(n_merges) if progress else None

    while len(merges) < n_merges and (pair := _pop_most_frequent(heap, pair_counts)) is not None:
        new_bytes = vocab[pair[0]] + vocab[pair[1]]
        if new_bytes in known:  # would duplicate a token: never merge this pair
            continue
        z = 256 + len(merges)
        merges.append(pair)
        vocab.append(new_bytes)
        known.add(new_bytes)
        new_counts, new_where = _replace_pair(pair, z, where.pop(pair), words, freqs, pair_counts)
        del pair_counts[pair]  # every occurrence is gone
        for new_pair, count in new_counts.items():
            pair_counts[new_pair] = count
            where[new_pair] = new_where[new_pair]
            heapq.heappush(heap, (-count, *new_pair))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return merges


def _count_pairs(
    words: list[list[int]], freqs: list[int]
) -> tuple[defaultdict[tuple[int, int], int], defaultdict[tuple[int, int], set[int]]]:
    """Every adjacent pair's count over all words, and which words hold it."""
    pair_counts: defaultdict[tuple[int, int], int] = defaultdict(int)
    where: defaultdict[tuple[int, int], set[int]] = defaultdict(set)
    for i, (word, freq) in enumerate(zip(words, freqs)):
        for pair in zip(word, word[1:]):
            pair_counts[pair] += freq
            where[pair].add(i)
    return pair_counts, where


def _pop_most_frequent(
    heap: list[tuple[int, int, int]], pair_counts: dict[tuple[int, int], int]
) -> tuple[int, int] | None:
    """The pair with the highest count (of equal counts, the smallest pair), or None once no pair is left.

    The heap is lazy: an entry whose count is no longer the pair's is stale, and goes back in with
    the pair's current count, if it still occurs at all.
    """
    while heap:
        neg_count, a, b = heapq.heappop(heap)
        count = pair_counts.get((a, b), 0)
        if count == -neg_count:
            return a, b
        if count > 0:  # stale entry: the pair lost occurrences since it was pushed
            heapq.heappush(heap, (-count, a, b))
    return None


def _replace_pair(
    pair: tuple[int, int],
    z: int,
    holders: set[int],
    words: list[list[int]],
    freqs: list[int],
    pair_counts: defaultdict[tuple[int, int], int],
) -> tuple[defaultdict[tuple[int, int], int], defaultdict[tuple[int, int], set[int]]]:
    """Replace ``pair`` by ``z`` in every word of ``holders``, and update the pairs around each replacement.

    The pairs that lose occurrences are counted down in ``pair_counts``. Pairs with z are all new:
    they are collected apart and returned, with the words that hold them, for the caller to add.
    """
    a, b = pair
    new_counts: defaultdict[tuple[int, int], int] = defaultdict(int)
    new_where: defaultdict[tuple[int, int], set[int]] = defaultdict(set)
    for w in holders:
        word = words[w]
        freq = freqs[w]
        n = len(word)
        out: list[int] = []  # the word after the merge
        copied = 0  # word[:copied] is already in `out`
        prev_end = -1  # where the previous replacement in this word ended
        start = 0  # where to look for the next `a`
        while True:
            try:
                i = word.index(a, start)  # C-speed search for the next candidate
            except ValueError:
                break
            if i >= n - 1:
                break
            if word[i + 1] != b:
                start = i + 1
                continue
            # word[i:i+2] == (a, b): replace it by z.
            out.extend(word[copied:i])
            out.append(z)
            copied = i + 2
            if i > 0:  # the left neighbour
                if prev_end == i:  # ... is the z we just made: (b, a) was already removed
                    new_pair = (z, z)
                else:
                    left = word[i - 1]
                    pair_counts[left, a] -= freq
                    new_pair = (left, z)
                new_counts[new_pair] += freq
                new_where[new_pair].add(w)
            if i + 2 < n:  # the right neighbour
                right = word[i + 2]
                pair_counts[b, right] -= freq
                # if another (a, b) starts right here, that replacement adds (z, z)
                if not (right == a and i + 3 < n and word[i + 3] == b):
                    new_pair = (z, right)
                    new_counts[new_pair] += freq
                    new_where[new_pair].add(w)
            prev_end = start = i + 2
        if copied:
            out.extend(word[copied:])
            words[w] = out
    return new_counts, new_where


def _progress_bar(total: int) -> Any:
    from tqdm.auto import tqdm  # imported here: only training with progress=True needs it

    return tqdm(total=total, desc="BPE merges", unit="merge")


def train_bpe(
    texts: Iterable[str],
    vocab_size: int,
    pattern: str = "gpt4",
    n_reserved: int = 0,
    **kwargs: Any,
) -> BPETokenizer:
    """Train a byte-level BPE tokenizer: `train_merges` on ``texts``, the merges as a `BPETokenizer`."""
    merges = train_merges(texts, vocab_size=vocab_size, pattern=resolve_pattern(pattern), n_reserved=n_reserved, **kwargs)
    return BPETokenizer(merges, pattern=pattern, n_reserved=n_reserved)
