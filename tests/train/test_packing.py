"""Fine-tuning's packed rows: several conversations to a row, none attending to another."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tinylm.config import GPTConfig
from tinylm.data.chat_shards import pack_chats, packed_rows
from tinylm.model.attention import reference_attention, sdpa_attention
from tinylm.model.gpt import GPT, IGNORE_INDEX


def offsets_of(lengths: list[int]) -> np.ndarray:
    return np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)


def test_conversations_go_into_the_first_open_row_they_fit():
    # lengths 5, 3, 9, 2, 1 tokens fill 4, 2, 8, 1 and 0 positions of rows of 8
    rows = pack_chats(offsets_of([5, 3, 9, 2, 1]), np.arange(5), block_size=8)
    # by hand: 0 opens row A (4 left), 1 fits A (2 left), 2 needs a new row B (0 left), 3 fits A;
    # 4 has no target at all and is left out
    assert [r.tolist() for r in rows] == [[0, 1, 3], [2]]


def test_a_conversation_longer_than_the_context_fills_a_row_alone():
    rows = pack_chats(offsets_of([3, 40, 3]), np.array([1, 0, 2]), block_size=8)
    assert [r.tolist() for r in rows] == [[1], [0, 2]]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 30), min_size=1, max_size=80), st.integers(4, 32), st.randoms())
def test_every_conversation_is_packed_once_and_no_row_overflows(lengths, block_size, rnd):
    order = np.array(rnd.sample(range(len(lengths)), len(lengths)), dtype=np.int64)
    rows = pack_chats(offsets_of(lengths), order, block_size)
    packed = np.concatenate(rows) if rows else np.array([], dtype=np.int64)
    assert sorted(packed.tolist()) == [i for i, n in enumerate(lengths) if n > 1]
    for row in rows:
        assert 0 < sum(min(lengths[c] - 1, block_size) for c in row) <= block_size


def test_packed_rows_by_hand():
    tokens = np.array([10, 11, 12, 13, 20, 21, 22], dtype=np.uint16)  # conversation 0: 10..13, 1: 20..22
    trained = np.array([0, 0, 1, 1, 0, 1, 1], dtype=np.uint8)
    x, y, seg = packed_rows(tokens, trained, offsets_of([4, 3]), [np.array([1, 0])], block_size=8, pad_id=0,
                            ignore_index=IGNORE_INDEX)
    # conversation 1 first (2 positions), then 0 (3 positions): a row as long as its 5 positions
    assert x.tolist() == [[20, 21, 10, 11, 12]]
    assert y.tolist() == [[21, 22, IGNORE_INDEX, 12, 13]]  # 10 -> 11 is not trained, nor is anything across
    assert seg.tolist() == [[0, 0, 1, 1, 1]]
    x, y, seg = packed_rows(tokens, trained, offsets_of([4, 3]), [np.array([1]), np.array([0, 1])], block_size=8,
                            pad_id=0, ignore_index=IGNORE_INDEX)
    assert x.tolist() == [[20, 21, 0, 0, 0], [10, 11, 12, 20, 21]]
    assert seg[0].tolist() == [0, 0, 1, 1, 1]  # the padding is a segment of its own
    assert y[0].tolist() == [21, 22, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]


@pytest.mark.parametrize("positions", ["rope", "learned"])
@pytest.mark.parametrize("bigram", [0, 64])
def test_a_packed_row_predicts_each_conversation_as_if_it_were_alone(positions, bigram):
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=50, block_size=24, n_layer=2, d_model=32, n_head=4, n_kv_head=2,
                       positions=positions, bigram_hash=bigram)
    model = GPT(config).eval()
    a, b = torch.randint(1, 50, (1, 7)), torch.randint(1, 50, (1, 9))
    row = torch.cat([a, b, torch.zeros(1, 4, dtype=torch.long)], dim=1)  # (1, 20)
    segments = torch.tensor([[0] * 7 + [1] * 9 + [2] * 4])
    packed, _ = model(row, segment_ids=segments)
    torch.testing.assert_close(packed[:, :7], model(a)[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(packed[:, 7:16], model(b)[0], atol=1e-5, rtol=0)
    # without the segments the second conversation would read the first
    assert not torch.allclose(model(row)[0][:, 7:16], model(b)[0], atol=1e-3)


def test_segment_ids_are_refused_beside_padding_or_a_cache():
    model = GPT(GPTConfig(vocab_size=20, block_size=8, n_layer=1, d_model=16, n_head=2))
    idx = torch.ones(1, 4, dtype=torch.long)
    with pytest.raises(Exception, match="segment id of its own"):
        model(idx, attention_mask=torch.ones(1, 4, dtype=torch.bool), segment_ids=torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(Exception, match="segment_ids must be"):
        model(idx, segment_ids=torch.zeros(1, 5, dtype=torch.long))


def test_the_written_out_backward_agrees_with_the_definition_under_a_packing_mask(monkeypatch):
    """bfloat16 on a CPU takes the written-out backward for packed rows too; its gradients match the reference."""
    from tinylm.model import attention

    calls = []
    written_out = attention._CausalAttention.apply
    monkeypatch.setattr(attention._CausalAttention, "apply", lambda *a: calls.append(1) or written_out(*a))
    torch.manual_seed(3)
    B, nh, T, hs = 2, 4, 12, 8
    segments = torch.tensor([[0] * 5 + [1] * 4 + [2] * 3, [0] * 12])
    mask = segments[:, None, :, None] == segments[:, None, None, :]  # (B, 1, T, T)
    base = [torch.randn(B, nh, T, hs) for _ in range(3)]
    weights = torch.linspace(-1, 1, B * nh * T * hs).view(B, nh, T, hs)
    grads = []
    for fn, dtype in ((reference_attention, torch.float32), (sdpa_attention, torch.bfloat16)):
        q, k, v = (t.detach().to(dtype).requires_grad_() for t in base)
        y = fn(q, k, v, mask)
        (y.float() * weights).sum().backward()
        grads.append((y.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()))
    assert calls == [1]
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)


def test_short_conversations_in_a_long_context_pack_into_shorter_rows():
    from tinylm.train.batches import chat_width

    # the longest conversation fills 29 positions: rows of 128 in a context of 512 (4 times as many of them)
    assert chat_width(offsets_of([30, 12, 5]), 512) == 128
    assert chat_width(offsets_of([200, 12]), 512) == 256  # 199 positions need 256
    assert chat_width(offsets_of([600]), 512) == 512  # cut to the context
    assert chat_width(offsets_of([30]), 128) == 128  # never below 128 positions
    assert chat_width(offsets_of([30]), 384) == 192  # halved only while the half divides the context
    assert chat_width(offsets_of([30]), 96) == 96
