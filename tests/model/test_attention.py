"""The three attention implementations compute the definition softmax_row(Q K^T / sqrt(d_h) + M) V."""

from __future__ import annotations

import math

import pytest
import torch
from torch.overrides import TorchFunctionMode

from tinylm.model.attention import reference_attention, repeat_kv, sdpa_attention, tiled_attention, window_keys

ATOL = 1e-5


def qkv(B: int, nh: int, n_kv: int, T_q: int, T_k: int, hs: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, nh, T_q, hs, generator=g)
    k = torch.randn(B, n_kv, T_k, hs, generator=g)
    v = torch.randn(B, n_kv, T_k, hs, generator=g)
    return q, k, v


def padding_mask(kind: str | None, B: int, T: int) -> torch.Tensor | None:
    """None, or (B, T) bool with False at padding: row b has b+1 padded positions on the given side."""
    if kind is None:
        return None
    mask = torch.ones(B, T, dtype=torch.bool)
    for b in range(B):
        if kind == "left":
            mask[b, : b + 1] = False
        else:
            mask[b, T - b - 1 :] = False
    return mask


def by_definition(q, k, v, mask, window=None):
    """The definition, softmax(q k^T / sqrt(d_h) + M) v, one head and one batch row at a time, with plain Python loops for M
    (with a ``window`` W, query i also stops seeing key j once i - j >= W)."""
    B, nh, T_q, hs = q.shape
    T_k = k.size(2)
    group = nh // k.size(1)
    out = torch.zeros_like(q)
    for b in range(B):
        for h in range(nh):
            M = torch.zeros(T_q, T_k)
            for i in range(T_q):
                for j in range(T_k):
                    i_abs = i + (T_k - T_q)
                    too_old = window is not None and i_abs - j >= window
                    if j > i_abs or too_old or (mask is not None and not mask[b, j]):
                        M[i, j] = float("-inf")
            Q, K, V = q[b, h], k[b, h // group], v[b, h // group]
            scores = Q @ K.T / math.sqrt(hs) + M
            for i in range(T_q):
                if torch.isinf(scores[i]).all():
                    continue  # a query with no visible key: output defined as zeros
                out[b, h, i] = torch.softmax(scores[i], dim=-1) @ V
    return out


HEADS = [(4, 4), (4, 2), (4, 1)]  # MHA, GQA, MQA


@pytest.mark.parametrize("nh,n_kv", HEADS, ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("pad", [None, "right", "left"])
@pytest.mark.parametrize("T_q,T_k", [(13, 13), (5, 13), (1, 13)], ids=["full", "cached", "one-step"])
def test_the_three_implementations_agree_with_the_definition(nh, n_kv, pad, T_q, T_k):
    q, k, v = qkv(3, nh, n_kv, T_q, T_k)
    mask = padding_mask(pad, 3, T_k)
    expected = by_definition(q, k, v, mask)
    torch.testing.assert_close(reference_attention(q, k, v, mask), expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(sdpa_attention(q, k, v, mask), expected, atol=ATOL, rtol=0)
    for tile in (1, 4, 5, 13, 64):  # 4 and 5 do not divide 13: a ragged last block
        torch.testing.assert_close(tiled_attention(q, k, v, mask, tile_size=tile), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("window", [1, 4, 13])
@pytest.mark.parametrize("pad", [None, "left"])
@pytest.mark.parametrize("T_q,T_k", [(13, 13), (5, 13), (1, 13)], ids=["full", "cached", "one-step"])
def test_a_sliding_window_is_the_definition_with_a_band_mask(window, pad, T_q, T_k):
    q, k, v = qkv(3, 4, 2, T_q, T_k)
    mask = padding_mask(pad, 3, T_k)
    expected = by_definition(q, k, v, mask, window)
    if window == 4:  # a window that hides keys changes the output; 13 keys in a window of 13 do not
        assert not torch.allclose(expected, by_definition(q, k, v, mask), atol=1e-3)
    torch.testing.assert_close(reference_attention(q, k, v, mask, window=window), expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(sdpa_attention(q, k, v, mask, window=window), expected, atol=ATOL, rtol=0)
    for tile in (1, 5, 64):
        torch.testing.assert_close(tiled_attention(q, k, v, mask, tile_size=tile, window=window), expected,
                                   atol=ATOL, rtol=0)
    # what the module does first: drop the keys no window reaches, then attend over the rest
    k2, v2, mask2, rest = window_keys(k, v, mask, T_q, window)
    assert k2.size(2) == min(T_k, T_q + window - 1)
    torch.testing.assert_close(sdpa_attention(q, k2, v2, mask2, window=rest), expected, atol=ATOL, rtol=0)


def test_a_windowed_model_never_takes_the_written_out_causal_backward(monkeypatch):
    """bfloat16 training on a CPU takes `_CausalAttention` for plain causal attention; its backward assumes
    the causal triangle, so a windowed model must go through the masked kernel instead."""
    from tinylm.model import attention

    calls = []
    written_out = attention._CausalAttention.apply

    def counted(*args):
        calls.append(1)
        return written_out(*args)

    monkeypatch.setattr(attention._CausalAttention, "apply", counted)
    q, k, v = (t.to(torch.bfloat16).requires_grad_() for t in qkv(2, 4, 4, 9, 9))
    sdpa_attention(q, k, v)
    assert calls == [1]  # the test sees the shortcut when it is taken
    y = sdpa_attention(q, k, v, window=3)
    assert calls == [1]
    torch.testing.assert_close(y.float(), by_definition(q.float(), k.float(), v.float(), None, 3), atol=2e-2, rtol=0)


@pytest.mark.parametrize("nh,n_kv", HEADS, ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("pad", [None, "left"])
def test_gradients_agree_and_stay_finite(nh, n_kv, pad):
    grads = []
    for fn in (reference_attention, sdpa_attention, lambda *a: tiled_attention(*a, tile_size=3)):
        q, k, v = (t.requires_grad_() for t in qkv(3, nh, n_kv, 7, 7, seed=1))
        y = fn(q, k, v, padding_mask(pad, 3, 7))
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        grads.append((q.grad, k.grad, v.grad))
    for g in grads:
        assert all(torch.isfinite(t).all() for t in g)
    for g in grads[1:]:
        for a, b in zip(g, grads[0]):
            torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def test_a_query_with_no_visible_key_outputs_zeros():
    # row 0 is left-padded by 3: queries 0..2 see only padding
    q, k, v = qkv(2, 2, 2, 6, 6)
    mask = torch.tensor([[False, False, False, True, True, True], [True] * 6])
    for y in (reference_attention(q, k, v, mask), sdpa_attention(q, k, v, mask), tiled_attention(q, k, v, mask, tile_size=2)):
        assert torch.isfinite(y).all()
        assert (y[0, :, :3] == 0).all()
        assert (y[0, :, 3:] != 0).any()


def test_a_worked_example_by_hand():
    # T = 3, d_h = 2, scale c = 1; v_1 = (1,0), v_2 = (0,1), v_3 = (1,1); the inner products
    # of q_2 with the keys are (0, 1, 1) and of q_3 are (2, 0, 1).
    k = torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    v = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]]) * math.sqrt(2)  # undo the 1/sqrt(d_h) for c = 1
    y, att = reference_attention(q[None, None], k[None, None], v[None, None], return_weights=True)
    expected_att = torch.tensor([[1.0, 0.0, 0.0], [0.269, 0.731, 0.0], [0.665, 0.090, 0.245]])
    torch.testing.assert_close(att[0, 0], expected_att, atol=5e-4, rtol=0)
    expected_y = torch.tensor([[1.0, 0.0], [0.269, 0.731], [0.910, 0.335]])
    torch.testing.assert_close(y[0, 0], expected_y, atol=1e-3, rtol=0)
    for fn in (sdpa_attention, lambda *a: tiled_attention(*a, tile_size=2)):
        torch.testing.assert_close(fn(q[None, None], k[None, None], v[None, None]), y, atol=ATOL, rtol=0)


def test_weights_are_causal_distributions():
    q, k, v = qkv(2, 4, 2, 9, 9)
    _, att = reference_attention(q, k, v, return_weights=True)
    torch.testing.assert_close(att.sum(-1), torch.ones(2, 4, 9))
    assert (att.triu(diagonal=1) == 0).all()


def test_repeat_kv_groups_consecutive_query_heads():
    k = torch.arange(2.0).view(1, 2, 1, 1)  # kv head 0 holds 0, kv head 1 holds 1
    assert repeat_kv(k, 3).flatten().tolist() == [0, 0, 0, 1, 1, 1]


class LargestResult(TorchFunctionMode):
    """Records the largest tensor any torch function returns while active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_tiled_attention_never_forms_the_T_by_T_matrix():
    B, nh, T, hs, tile = 1, 2, 64, 8, 8
    q, k, v = qkv(B, nh, nh, T, T, hs)
    full_scores = B * nh * T * T
    with LargestResult() as seen:
        reference_attention(q, k, v)
    assert seen.largest >= full_scores  # the probe does see the definition's T x T scores
    with LargestResult() as seen:
        tiled_attention(q, k, v, tile_size=tile)
    # the largest thing alive is a (T x tile) block of scores or the (T x hs) output
    assert seen.largest <= B * nh * T * max(tile, hs)


@pytest.mark.parametrize("nh,n_kv", HEADS)
def test_bfloat16_training_gradients_match_float64_autograd(nh, n_kv):
    """On a CPU, bfloat16 causal attention trains through a written-out backward pass; its
    gradients (through repeat_kv too) match autograd of the definition in float64 to bfloat16's precision."""
    q, k, v = (t.double().requires_grad_() for t in qkv(2, nh, n_kv, 24, 24, hs=16, seed=3))
    dy = torch.randn(2, nh, 24, 16, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    reference_attention(q, k, v).backward(dy)
    qb, kb, vb = (t.detach().bfloat16().requires_grad_() for t in (q, k, v))
    y = sdpa_attention(qb, kb, vb)
    assert "CausalAttention" in type(y.grad_fn).__name__
    y.backward(dy.bfloat16())
    for exact, got in ((q, qb), (k, kb), (v, vb)):
        scale = exact.grad.abs().max().item()
        assert (got.grad.double() - exact.grad).abs().max().item() < 0.02 * scale
    # the forward pass is the fused kernel's, unchanged
    torch.testing.assert_close(y.float(), reference_attention(qb.float(), kb.float(), vb.float()), atol=2e-2, rtol=0)


def test_written_out_backward_is_only_for_cpu_low_precision_training():
    q, k, v = qkv(1, 2, 2, 8, 8)
    assert "CausalAttention" not in type(sdpa_attention(q.requires_grad_(), k, v).grad_fn).__name__  # float32: fused
    qb = q.detach().bfloat16().requires_grad_()
    assert "CausalAttention" in type(sdpa_attention(qb, k.bfloat16(), v.bfloat16()).grad_fn).__name__
    with torch.no_grad():  # inference: nothing to differentiate, the fused kernel alone
        assert sdpa_attention(qb, k.bfloat16(), v.bfloat16()).grad_fn is None


def test_bfloat16_training_with_value_embeddings_through_the_written_out_backward():
    # value embeddings add a float32 term to v under autocast; the backward must still see one dtype
    from tinylm.config import GPTConfig
    from tinylm.model.gpt import GPT

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=40, block_size=16, n_layer=1, d_model=32, n_head=4, value_embed=True,
                          qk_norm=True))
    x, y = torch.randint(0, 40, (2, 16)), torch.randint(0, 40, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(x, y, return_logits=False)
    loss.backward()  # raised "expected scalar type Float but found BFloat16" before
    _, exact = model(x, y)
    grads = torch.autograd.grad(exact, [model.blocks[0].attn.W_v.weight, model.blocks[0].attn.ve_weight])
    assert torch.allclose(model.blocks[0].attn.W_v.weight.grad, grads[0], atol=0.05 * grads[0].abs().max().item())
    assert torch.allclose(model.blocks[0].attn.ve_weight.grad, grads[1], atol=0.05 * grads[1].abs().max().item())


def test_backward_inside_an_autocast_region_gives_the_same_gradients():
    q, k, v = (t.bfloat16().requires_grad_() for t in qkv(1, 2, 2, 16, 16, hs=8, seed=5))
    sdpa_attention(q, k, v).sum().backward()
    outside = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    y = sdpa_attention(q, k, v)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y.sum().backward()
    for a, t in zip(outside, (q, k, v)):
        torch.testing.assert_close(t.grad, a)
