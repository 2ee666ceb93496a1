"""The static KV cache: its shapes and memory, and cached logits equal to recomputing everything."""

from __future__ import annotations

import pytest
import torch

from tinylm.errors import TinyLMError
from tinylm.generate.cache import KVCache, StaticKVCacheLayer
from tinylm.generate.steps import decode_one_token, prefill

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
