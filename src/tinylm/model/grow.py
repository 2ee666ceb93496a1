"""Growing a trained model's vocabulary: new token ids (chat markers) get rows in the embeddings and the head.

A model reads token x through row x of its embedding E and scores it through row x of its output
layer; a token added to the tokenizer after training needs both. Each new row starts as the mean of
the rows the model learned (as `transformers`' ``resize_token_embeddings`` does by default): a new
token then looks to the model like an average token instead of a random vector far from every other,
so the first fine-tuning steps do not start from huge losses on it, and its score starts near the
others' average rather than anywhere. Fine-tuning then teaches it its own meaning.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from tinylm.errors import TinyLMError

# the tensors with one row per token id, in every family that has them (tied heads share E's tensor)
VOCABULARY_ROWS = ("E.weight", "V_emb.weight", "lm_head.weight")


def grow_vocabulary(state: Mapping[str, Tensor], vocab_size: int) -> dict[str, Tensor]:
    """``state`` (a model's state dict) with every per-token tensor grown to ``vocab_size`` rows, each new
    row the mean of the old ones; the other tensors as they are."""
    grown = dict(state)
    for name in VOCABULARY_ROWS:
        rows = state.get(name)
        if rows is None:
            continue
        if vocab_size < rows.size(0):
            raise TinyLMError(f"cannot shrink {name} from {rows.size(0)} to {vocab_size} token rows")
        extra = vocab_size - rows.size(0)
        mean = rows.float().mean(dim=0, keepdim=True).to(rows.dtype)  # (1, d)
        grown[name] = torch.cat([rows, mean.expand(extra, -1)]) if extra else rows
    return grown
