"""The static KV cache: its shapes and memory, and cached logits equal to recomputing everything."""

from __future__ import annotations

import pytest
import torch

from tinylm.errors import TinyLMError
from tinylm.generate.cache import KVCache, StaticKVCacheLayer, merge_rows
from tinylm.generate.fast import StaticDecoder
from tinylm.generate.steps import CachedDecoder, decode_one_token, left_pad, prefill

from toys import tiny_gpt

POSITIONS = ["learned", "sinusoidal", "rope", "none"]
KV_HEADS = {"MHA": 4, "GQA": 2, "MQA": 1}


def test_only_the_kv_heads_are_stored_and_the_memory_is_known_up_front():
    model = tiny_gpt(n_kv_head=2)  # 4 query heads share 2 kv heads, head size 8
    cache = KVCache.for_model(model, batch=3, max_len=20)
    assert len(cache) == 2  # one per layer
    assert cache[0].k.shape == (3, 2, 20, 8) and cache[0].v.shape == (3, 2, 20, 8)
    # 2 (K, V) x layers x batch x kv heads x max_len x head size x 4 bytes
    assert cache.nbytes == 2 * 2 * 3 * 2 * 20 * 8 * 4
    mha = KVCache.for_model(tiny_gpt(n_kv_head=4), batch=3, max_len=20)
    assert mha.nbytes == 2 * cache.nbytes


def test_update_appends_and_returns_everything_stored():
    layer = StaticKVCacheLayer(batch=1, n_kv_head=1, max_len=5, head_dim=2)
    a, b = torch.ones(1, 1, 2, 2), 2 * torch.ones(1, 1, 1, 2)
    k, v = layer.update(a, -a)
    assert layer.length == 2 and k.shape == (1, 1, 2, 2)
    k, v = layer.update(b, -b)
    assert layer.length == 3
    torch.testing.assert_close(k, torch.cat([a, b], dim=2))
    torch.testing.assert_close(v, -torch.cat([a, b], dim=2))
    with pytest.raises(TinyLMError, match="holds 5 positions"):
        layer.update(torch.ones(1, 1, 3, 2), torch.ones(1, 1, 3, 2))  # 6 > 5: an error, never a silent overwrite
    layer.reset()
    assert layer.length == 0


def test_a_cache_longer_than_the_context_is_refused():
    with pytest.raises(TinyLMError, match="block_size"):
        KVCache.for_model(tiny_gpt(), batch=1, max_len=129)


def test_reorder_moves_rows():
    layer = StaticKVCacheLayer(batch=3, n_kv_head=1, max_len=2, head_dim=1)
    layer.update(torch.arange(3.0).view(3, 1, 1, 1), torch.zeros(3, 1, 1, 1))
    layer.reorder(torch.tensor([2, 2, 0, 1]))
    assert layer.k[:, 0, 0, 0].tolist() == [2.0, 2.0, 0.0, 1.0]


# float64 shows the cache is exact (any mistake in positions, masks or kv heads is O(0.1)); float32
# shows the real dtype stays close: there a one-row matmul rounds differently from a many-row one,
# about 1e-5 on logits of size ~4. (Tiled attention keeps its running softmax sums in float32 by
# design, so in float64 it is as close as float32 allows.)
TOLERANCE = {torch.float64: 1e-10, torch.float32: 5e-5}
TILED_FLOAT64_TOLERANCE = 1e-5


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("attention", ["sdpa", "reference", "tiled"])
@pytest.mark.parametrize("heads", list(KV_HEADS))
@pytest.mark.parametrize("positions", POSITIONS)
def test_cached_logits_equal_recomputing_the_whole_sequence(positions, heads, attention, dtype):
    model = tiny_gpt(positions=positions, n_kv_head=KV_HEADS[heads], attention=attention, tile_size=16).to(dtype)
    seq = torch.randint(0, 97, (2, 60), generator=torch.Generator().manual_seed(1))  # (B, T)
    with torch.no_grad():
        full, _ = model(seq)  # (B, T, V): every position's logits, computed from scratch
        cache = KVCache.for_model(model, batch=2, max_len=60)
        cached = [prefill(model, seq[:, :8], cache)]  # the "prompt": positions 0..7
        for t in range(8, 60):
            cached.append(decode_one_token(model, seq[:, t], cache))  # one new token, at position t
    cached = torch.stack(cached, dim=1)  # (B, 53, V): predictions after positions 7..59
    tolerance = TILED_FLOAT64_TOLERANCE if attention == "tiled" and dtype == torch.float64 else TOLERANCE[dtype]
    torch.testing.assert_close(cached, full[:, 7:], atol=tolerance, rtol=0)
    assert cache.length == 60 and cache[0].k.dtype == dtype


# ----- rows joining and leaving a batch (the server's continuous batching) ---------------------------


def test_merge_rows_right_aligns_the_kept_rows_and_pads_with_zeros():
    a = torch.arange(1, 2 * 4 + 1).float().view(2, 4, 1)  # 2 rows, 4 columns filled
    b = -torch.arange(1, 3 * 2 + 1).float().view(3, 2, 1)  # 3 rows, 2 columns filled
    out = merge_rows([(a, torch.tensor([1]), 4), (b, torch.tensor([0, 2]), 2)], width=4, capacity=6)
    assert out.shape == (3, 6, 1)
    assert out[0, :, 0].tolist() == [5, 6, 7, 8, 0, 0]  # a's row 1, whole
    assert out[1, :, 0].tolist() == [0, 0, -1, -2, 0, 0]  # b's row 0, padded on the left
    assert out[2, :, 0].tolist() == [0, 0, -5, -6, 0, 0]


def test_merge_rows_keeps_the_last_columns_of_a_longer_buffer_and_merges_masks():
    mask = torch.tensor([[False, False, True, True, True]])  # 3 real tokens in 5 filled columns
    out = merge_rows([(mask[..., None], torch.tensor([0]), 5)], width=3, capacity=4)[..., 0]
    assert out.tolist() == [[True, True, True, False]]  # the padding columns are gone


def _decoder(kind, model, batch, capacity):
    return CachedDecoder(model, batch, capacity) if kind == "cached" else StaticDecoder(model, batch, capacity)


@pytest.mark.parametrize("kind", ["cached", "static"])
def test_merged_and_shrunk_decoders_give_each_row_its_logits_alone(kind):
    model = tiny_gpt(positions="rope", n_kv_head=2).eval()
    prompts = [[3, 14, 15, 92, 65], [35, 89], [7, 9, 3]]
    with torch.inference_mode():
        alone = []
        for p in prompts:
            d = _decoder(kind, model, 1, 12)
            d.start(*left_pad([p]))
            alone.append(d.step(torch.tensor([p[-1]]))[0])  # (V,): the logits after p + [p[-1]]
        first = _decoder(kind, model, 2, 5)
        first.start(*left_pad(prompts[:2]))
        second = _decoder(kind, model, 1, 3)
        second.start(*left_pad(prompts[2:]))
        # rows 0 and 1 of the first batch (row 1 padded), then the second's: right-aligned at column 5
        merged = type(first).merged([(first, torch.tensor([0, 1])), (second, torch.tensor([0]))], 5, 7)
        assert merged.length == 5 and merged.mask[:, :5].sum(1).tolist() == [5, 2, 3]
        logits = merged.step(torch.tensor([p[-1] for p in prompts]))  # (3, V)
        for b in range(3):
            torch.testing.assert_close(logits[b], alone[b], atol=1e-4, rtol=1e-4)
        merged.truncate(5)
        merged.reorder(torch.tensor([2]))  # the last row alone: shrinking keeps its columns
        torch.testing.assert_close(merged.step(torch.tensor([prompts[2][-1]]))[0], alone[2], atol=1e-4, rtol=1e-4)
