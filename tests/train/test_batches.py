"""Training batches: packed windows and padded documents, a pure function of (seed, step)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tinylm.data.shards import ShardSet
from tinylm.model import GPT, IGNORE_INDEX, GPTConfig
from tinylm.train.batches import BatchSource, micro_batches


@pytest.fixture(scope="module")
def shards(data_dir) -> ShardSet:
    return ShardSet.open(data_dir)


def source(shards: ShardSet, mode: str, batch_size: int = 4, block_size: int = 32, seed: int = 7) -> BatchSource:
    tok = shards.tokenizer()
    return BatchSource(shards, mode=mode, batch_size=batch_size, block_size=block_size, seed=seed,
                       bos_id=tok.bos_id, pad_id=tok.pad_id)


def test_packed_rows_are_shifted_windows_of_the_stream_and_a_function_of_the_step(shards):
    src = source(shards, "packed")
    batch = src.step_batch(5)
    assert batch.x.shape == batch.y.shape == (4, 32) and batch.attention_mask is None
    x, y = shards.sample_windows("train", 4, 32, np.random.default_rng([7, 5]))
    np.testing.assert_array_equal(batch.x, x)
    np.testing.assert_array_equal(batch.x[:, 1:], batch.y[:, :-1])  # targets: the next token
    np.testing.assert_array_equal(src.step_batch(5).x, batch.x)  # the same step, the same rows
    assert not np.array_equal(src.step_batch(6).x, batch.x)
    assert batch.n_targets == 4 * 32


def test_micro_batches_and_processes_partition_the_step_rows(shards):
    src = source(shards, "packed", batch_size=4)
    batch = src.step_batch(3, grad_accum=2)  # 8 rows
    whole = micro_batches(batch, 4)
    assert [m.x.shape[0] for m in whole] == [4, 4]
    ranks = [micro_batches(batch, 4, rank=r, world_size=2) for r in (0, 1)]
    for i in range(2):  # micro-batch i of the two processes, stacked, is micro-batch i of one process
        np.testing.assert_array_equal(np.concatenate([ranks[0][i].x, ranks[1][i].x]), whole[i].x)
    # accumulating two halves sees exactly the rows of one batch twice as big
    big = source(shards, "packed", batch_size=8).step_batch(3)
    np.testing.assert_array_equal(np.concatenate([m.x for m in whole]), big.x)


def test_document_rows_are_bos_document_eos_then_padding(shards):
    tok = shards.tokenizer()
    src = source(shards, "documents", batch_size=16)
    batch = src.step_batch(0)
    data = shards.tokens("train")
    ends = np.flatnonzero(data == tok.eos_id)
    starts = np.concatenate(([0], ends[:-1] + 1))
    documents = {tuple(data[s : e + 1]) for s, e in zip(starts, ends)}  # each with its EOS
    saw_padding = saw_truncation = False
    for x, y, mask in zip(batch.x, batch.y, batch.attention_mask):
        assert x[0] == tok.bos_id
        n_real = int(mask.sum())
        assert mask[:n_real].all() and not mask[n_real:].any()  # real tokens first, then padding
        assert (x[n_real:] == tok.pad_id).all()
        n_targets = int((y != IGNORE_INDEX).sum())
        assert (y[:n_targets] != IGNORE_INDEX).all() and (y[n_targets:] == IGNORE_INDEX).all()
        np.testing.assert_array_equal(y[: n_targets - 1], x[1:n_targets])  # targets: the next token
        row = tuple(y[:n_targets])  # the document's tokens as the row holds them
        if row[-1] == tok.eos_id:
            assert row in documents  # a whole document, EOS included
            if n_real < 32:
                saw_padding = True
                assert n_targets == n_real - 1  # the last real input (EOS) has only padding after it
        else:
            saw_truncation = True
            assert n_targets == 32 and n_real == 32
            assert any(doc[: len(row)] == row for doc in documents)  # the start of a longer document
    assert saw_padding and saw_truncation


def test_padded_positions_are_out_of_the_loss_and_out_of_attention(shards):
    """The loss of a padded document row equals the loss of the same document unpadded."""
    src = source(shards, "documents", batch_size=16)
    batch = src.step_batch(0)
    lengths = batch.attention_mask.sum(axis=1)
    r = int(np.argmin(lengths))
    n_real = int(lengths[r])
    assert n_real < 32
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=shards.vocab_size, block_size=32, n_layer=2, d_model=32, n_head=2)).eval()
    inputs = batch.rows(r, r + 1).to(torch.device("cpu"))
    x, y, mask = inputs["idx"], inputs["targets"], inputs["attention_mask"]
    _, padded = model(x, y, attention_mask=mask)
    _, alone = model(x[:, : n_real - 1], y[:, : n_real - 1])
    torch.testing.assert_close(padded, alone, rtol=1e-6, atol=1e-6)
    # and the real positions' logits do not see the padding at all
    logits_padded, _ = model(x, attention_mask=mask)
    logits_alone, _ = model(x[:, :n_real])
    torch.testing.assert_close(logits_padded[:, :n_real], logits_alone, rtol=1e-5, atol=1e-5)
