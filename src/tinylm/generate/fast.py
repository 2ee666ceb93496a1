"""The decoding step of a GPT laid out for speed: the same numbers, read the way a CPU reads them fastest.

Generating one token reads every weight matrix once to multiply it by one vector. For a small
model the time goes less to arithmetic than to how the matrices are read and how many small
operations run around them. `DecodeWeights` keeps a copy of a `tinylm.model.GPT`'s matrices for
decoding (the model, its checkpoints and its export are untouched):

- stored (in, out), the transpose of nn.Linear's (out, in): MKL multiplies one row vector by
  such a matrix faster than ``F.linear`` does with the (out, in) one on this kind of CPU (with the
  fusions below, the engine's "before" and "engine" rows of `benchmarks/generate.py --run`:
  1.4-1.6x);
- W_q, W_k and W_v side by side as one matrix, and a gated MLP's W_1 and W_3 likewise, so a layer
  makes four products instead of seven;
- RoPE's cos and sin tabulated once for every position of the context (twice with Gemma 3's
  own base for the windowed layers).

A compiled step (``compile=True``) keeps another copy of the matrices, (out, in), and writes each
product as a sum that inductor turns into C++ loops (`_product_reduced`). Whether that is faster
depends on the model and the machine (twice as fast on the default run, a third slower on the
`small` preset here), so the decoder times both once per shape and keeps the faster
(`StaticDecoder._compiled_is_faster`).

`StaticDecoder` is the cache that goes with it, static as in gpt-fast: keys and values for
every slot of the window, allocated once, and a mask of the slots that hold real tokens. A
step writes its tokens' keys and values into their slots and attends over the slots written so
far with the mask (key j is seen by the query in slot i when j <= i, j holds a real token and,
with a sliding window, i - j < W): the cache's shapes never change, only how many slots are read.
The one-token step compiled ahead of time takes that count as its one free size
(`tinylm.generate.aot`); `torch.compile`'s graphs (a padded speculative round) read the whole
buffer, so they too keep their shapes. Rolling back is free: slots past the current length are
never visible to a query, so forgetting them is setting the length (speculative decoding does
that after a rejected draft).

What the step computes is `GPT.forward` with a KV cache, term for term; the products are summed
in another order, so logits agree to float rounding (the tests pin them to the model's), and
the engine's greedy tokens stay the model's.

A model quantized to int8 (`tinylm.model.quant`) lays out the same way: its fused matrices are
`Int8Matrix` rows stacked, multiplied by the int8 kernel measured fastest (eager) or by a written-out
int8 sum (compiled).

Models this layout does not cover (a bigram-hash table, whose pairs cross the cache; other
families) decode through the model itself (`supports` says which).
"""

from __future__ import annotations

import functools
import math
import mmap
import statistics
import time
import warnings
import weakref
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tinylm.errors import TinyLMError
from tinylm.generate.aot import AOTStep
from tinylm.generate.cache import merge_rows
from tinylm.generate.steps import CachedDecoder, real_positions
from tinylm.generate.threads import DecodeThreads, command_setting, decode_settings
from tinylm.model import GPT
from tinylm.model.attention import causal_visible, soft_cap
from tinylm.model.gpt import mlp_activation
from tinylm.model.positions import apply_rope
from tinylm.model.quant import Int8Linear, Int8Matrix, stack_rows


# slots past the context in a compiled decoder's cache: where a padded speculative round of up to 8 drafts writes
ROUND_SLOTS = 8

# `StaticDecoder` times a compiled step against the eager one before using it (False: always the compiled one)
MEASURE_COMPILED = True
COMPARE_ROUNDS = 7

# matrices of at least this many bytes are copied to memory backed by huge pages (`on_huge_pages`)
HUGE_PAGE = 2 * 2**20
USE_HUGE_PAGES = True

# the compiled one-token step: every intermediate vector kept in memory rather than recomputed inside the products
# that read it (inductor's default for cheap producers, which doubled their time). Letting the C++ compiler fuse
# multiply-adds and reorder sums as well made the whole step no faster (`benchmarks/decode_step.py`), so it does not.
ONE_TOKEN_INDUCTOR_OPTIONS = {"realize_reads_threshold": 1, "realize_cpu_opcount_threshold": 1}
# the compiled one-token step as an ahead-of-time package (`tinylm.generate.aot`); False: torch.compile's
AHEAD_OF_TIME = True
# greedy tokens a call of the compiled run-ahead package (`StaticDecoder.greedy_ahead`); 0: one a call
GREEDY_TOKENS = 4
# one-token steps run with the thread count and pinning measured fastest (`tinylm.generate.threads`) where the
# command chose its count itself; False: the command's count
CHOOSE_THREADS = True


def supports(model: nn.Module) -> bool:
    """Whether `DecodeWeights` can lay out ``model``: a GPT without a bigram-hash table or Mixture-of-Experts MLPs."""
    return isinstance(model, GPT) and not model.config.bigram_hash and not model.config.moe_experts


def _fused(linears: tuple[nn.Linear, ...], in_out: bool) -> tuple[Tensor | Int8Matrix, Tensor | None]:
    """The linears' weights as one matrix, (in, sum of outs) or (sum of outs, in), and their biases as one vector.

    Int8 linears (`tinylm.model.quant`) give one `Int8Matrix`, their rows stacked, whatever the layout.
    """
    if isinstance(linears[0], Int8Linear):
        weight = stack_rows([lin.matrix for lin in linears])
    else:
        weight = torch.cat([lin.weight.detach() for lin in linears])  # (outs, in)
        weight = weight.T.contiguous() if in_out else weight.contiguous()
    biases = [lin.bias for lin in linears]
    if all(b is None for b in biases):
        return weight, None
    like = next(b for b in biases if b is not None)
    bias = torch.cat([b.detach() if b is not None else like.new_zeros(lin.out_features)
                      for b, lin in zip(biases, linears)])
    return weight, bias


def _product_in_out(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x (..., in) times W stored (in, out): MKL's fastest one-row product."""
    if isinstance(weight, Int8Matrix):
        return weight.matmul(x, bias)
    y = x @ weight
    return y + bias if bias is not None else y


def _product_out_in(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x (..., in) times W stored (out, in) (nn.Linear's layout)."""
    if isinstance(weight, Int8Matrix):
        return weight.matmul(x, bias)
    return F.linear(x, weight, bias)


def _product_reduced(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x (..., in) times W stored (out, in), written as a sum for the compiler: out[o, m] = sum_i W[o, i] x[m, i].

    The compiled one-token step uses it: inductor writes it as one C++ loop over W's rows, fused
    with the norm or activation that makes x, instead of a call into MKL. Over several tokens
    inductor fused each product into the next and recomputed it per row (while this was written,
    a 6-token round took about 20 times one token), so those steps call MKL. Whether the compiled
    step wins at all is measured at run time (`StaticDecoder._compiled_is_faster`).
    """
    if isinstance(weight, Int8Matrix):
        return weight.written_out(x, bias)
    rows = x.reshape(-1, x.size(-1))  # (M, in)
    y = (weight[:, None, :] * rows[None, :, :]).sum(-1).T  # (M, out)
    y = y.reshape(*x.shape[:-1], weight.size(0))
    return y + bias if bias is not None else y


def _write_slots(cache: Tensor, layer: int, slots: Tensor, values: Tensor) -> None:
    """cache[layer, :, :, slots] = values (B, n_kv, T, hs), as one scatter into the whole cache.

    For a compiled step: written as ``cache[layer].index_copy_`` (a write through a view of the input),
    inductor copied the whole cache, every layer's, once per layer and per write, and that copying took
    most of the step. One index_put on the input itself is done in place.
    """
    layers = torch.full_like(slots, layer)
    torch.ops.aten.index_put_(cache, [layers, None, None, slots], values.permute(2, 0, 1, 3))  # values (T, B, n_kv, hs)


def on_huge_pages(tensor: Tensor) -> Tensor:
    """A copy of a large CPU tensor in memory the kernel backs with 2 MB pages (transparent huge pages), else ``tensor``.

    A decoding step streams every matrix from memory once per token; with 4 KB pages that walk misses the
    address cache (TLB) every few kilobytes. On GPT-2 124M's matrices here, one thread, a pass over all of
    them took 25 ms on huge pages against 28 ms on ordinary ones. Linux only (``madvise(MADV_HUGEPAGE)`` on an
    anonymous mapping, before anything is written to it); elsewhere, and for tensors under 2 MB, nothing changes.
    """
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or tensor.device.type != "cpu" or tensor.nbytes < HUGE_PAGE or not USE_HUGE_PAGES:
        return tensor
    try:
        region = mmap.mmap(-1, tensor.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(advice)
    except (OSError, ValueError):
        return tensor
    with warnings.catch_warnings():  # (frombuffer warns that the mapping is writable: it is meant to be)
        warnings.simplefilter("ignore", UserWarning)
        copy = torch.frombuffer(region, dtype=tensor.dtype, count=tensor.numel()).view(tensor.shape)
    return copy.copy_(tensor)  # (the tensor keeps the mapping alive)


def _keep(module: nn.Module, name: str, value: Tensor | Int8Matrix | None) -> None:
    """``value`` as ``module``'s buffer (a tensor, or None; a large one moved to huge pages) or submodule (an
    `Int8Matrix`, its rows moved to huge pages) called ``name``."""
    if isinstance(value, nn.Module):
        value.q = on_huge_pages(value.q)
        module.add_module(name, value)
    else:
        module.register_buffer(name, None if value is None else on_huge_pages(value))


class _Layer(nn.Module):
    """One block's laid-out matrices and vectors. ``layer["qkv"]`` is (weight, bias); ``layer["q_norm"]`` a vector
    or None. They are registered buffers (or submodules), so that each has a name of its own: the name the
    ahead-of-time step (`tinylm.generate.aot`) is given the tensor by."""

    def __init__(self, entries: dict) -> None:
        super().__init__()
        self.pairs = {key for key, value in entries.items() if isinstance(value, tuple)}
        for key, value in entries.items():
            if key in self.pairs:
                _keep(self, key, value[0])
                _keep(self, f"{key}_bias", value[1])
            else:
                _keep(self, key, value)

    def __getitem__(self, key: str):
        if key in self.pairs:
            return getattr(self, key), getattr(self, f"{key}_bias")
        return getattr(self, key)



class DecodeWeights(nn.Module):
    """A GPT's weights for decoding (module docstring) and the step over a static cache."""

    def __init__(self, model: GPT, compiled: bool = False) -> None:
        super().__init__()
        if not supports(model):
            raise TinyLMError("the fast decoding layout covers GPT models without a bigram-hash table")
        cfg = model.config
        self.config = cfg
        self.n_head, self.n_kv, self.hs = cfg.n_head, cfg.kv_heads, cfg.head_dim
        self.pre_norm = cfg.norm_position in ("pre", "sandwich")
        self.mlp_kind = cfg.mlp
        self.windows = [cfg.layer_window(i) for i in range(cfg.n_layer)]  # Gemma's whole-context layers: None
        self.softcap = cfg.logit_softcap
        self.attn_softcap = cfg.attn_softcap
        self.scale = 1.0 / math.sqrt(cfg.head_dim) if cfg.attn_scale_dim is None else cfg.attn_scale_dim ** -0.5
        self.embed_scale = math.sqrt(cfg.d_model) if cfg.embed_scale else None
        self.E = model.E  # shared: an embedding lookup reads rows, which nn.Embedding stores already
        self.V_emb = model.V_emb
        self.pos_emb = model.pos_emb
        self.norm_f = model.norm_f
        self.norm_1 = nn.ModuleList(block.norm_1 for block in model.blocks)
        self.norm_2 = nn.ModuleList(block.norm_2 for block in model.blocks)
        self.norm_1_out = nn.ModuleList(block.norm_1_out for block in model.blocks)  # sandwich; else identities
        self.norm_2_out = nn.ModuleList(block.norm_2_out for block in model.blocks)
        # eager: (in, out) matrices for MKL; compiled: (out, in) for the written-out product
        self.compiled = compiled
        in_out = not compiled
        self.product = _product_in_out if in_out else _product_out_in
        with torch.no_grad():
            layers = []
            for block in model.blocks:
                attn, mlp = block.attn, block.mlp
                up = (mlp.W_1, mlp.W_3) if cfg.gated else (mlp.W_1,)
                layers.append({
                    "qkv": _fused((attn.W_q, attn.W_k, attn.W_v), in_out), "o": _fused((attn.W_o,), in_out),
                    "up": _fused(up, in_out), "down": _fused((mlp.W_2,), in_out),
                    "q_norm": attn.q_norm.weight.detach() if attn.q_norm is not None else None,
                    "k_norm": attn.k_norm.weight.detach() if attn.k_norm is not None else None,
                    "ve": attn.ve_weight.detach() if attn.ve_weight is not None else None,
                })
            self.layers = nn.ModuleList(_Layer(entries) for entries in layers)
            _keep(self, "head", _fused((model.lm_head,), in_out)[0])  # (d, V) or (V, d)
            every = torch.arange(cfg.block_size, device=self.head.device)[None]
            for name, rotary in (("rope", model.rope), ("rope_local", model.rope_local or model.rope)):
                cos, sin = rotary(every) if rotary is not None else (None, None)  # 2 x (1, 1, S, hs)
                for part, table in (("cos", cos), ("sin", sin)):  # (S, hs)
                    self.register_buffer(f"{name}_{part}", None if table is None else table[0, 0].to(self.head.dtype))
        self.eps = cfg.norm_eps
        self._compiled: dict[tuple, Callable] = {}
        self.faster: dict[tuple, bool] = {}  # by shape: whether the compiled step beat the eager one
        self.ahead_faster: dict[tuple, bool] = {}  # by shape: whether greedy tokens a few a call beat one a call
        # by (rows, compiled, the command's thread choice): (the prompt's setting, one-token steps'), or None
        self.thread_settings: dict[tuple, tuple[DecodeThreads, DecodeThreads] | None] = {}

    @property
    def rope(self) -> tuple[Tensor, Tensor] | None:
        """RoPE's cos and sin for every position, 2 x (S, hs); None without RoPE."""
        return None if self.rope_cos is None else (self.rope_cos, self.rope_sin)

    @property
    def rope_local(self) -> tuple[Tensor, Tensor] | None:
        """The windowed layers' tables (Gemma 3's own base), else `rope`'s."""
        return None if self.rope_local_cos is None else (self.rope_local_cos, self.rope_local_sin)

    # -- the step ----------------------------------------------------------------------------

    def hidden(self, tokens: Tensor, slots: Tensor, positions: Tensor, key_mask: Tensor,
               k_cache: Tensor, v_cache: Tensor, written_out: bool = False) -> Tensor:
        """The final hidden states (B, T, d) of ``tokens`` (B, T) written into cache ``slots`` (T,).

        ``positions`` (B, T) are the tokens' positions (rows count their real tokens from 0);
        ``key_mask`` (B, L) marks the slots holding real tokens among the first L, the slots attention reads (the
        written ones: L may be less than the cache's S); ``k_cache`` and ``v_cache`` are (n_layer, B, n_kv, S, hs),
        updated in place (``slots`` < L). ``written_out`` computes attention as the
        plain formula instead of the fused kernel (faster once compiled).
        """
        B, T = tokens.shape
        nh, n_kv, hs = self.n_head, self.n_kv, self.hs
        L = key_mask.size(1)  # the slots attention reads: 0..L-1
        # the written-out product only for one token: over several, inductor fuses each product into the
        # next and recomputes it per output row (a round of 6 tokens took 20x a single one)
        product = _product_reduced if written_out and B * T == 1 else self.product
        h = self.E(tokens)  # (B, T, d)
        if self.embed_scale is not None:
            h = h * self.embed_scale
        ve = self.V_emb(tokens) if self.V_emb is not None else None  # (B, T, n_kv * hs)
        if self.pos_emb is not None:
            h = h + self.pos_emb(positions)
        ropes = {}  # by whether the layer is windowed: 2 x (B, 1, T, hs)
        for windowed, table in ((False, self.rope), (True, self.rope_local)):
            if table is not None:
                ropes[windowed] = (table[0][positions][:, None], table[1][positions][:, None])
        # which slots each query sees: the past (its own slot included), real tokens only, within the window
        # (one mask per window size among the layers: Gemma's alternate)
        j = torch.arange(L, device=tokens.device)
        own = j[None, :] == slots[:, None]  # (T, L): a padding query sees itself, so its row stays finite
        masks = {}
        for window in set(self.windows):
            visible = causal_visible(slots, j, window)  # (T, L)
            masks[window] = ((visible[None] & key_mask[:, None, :]) | own[None])[:, None]  # (B, 1, T, L)
        for i, layer in enumerate(self.layers):
            mask, rope = masks[self.windows[i]], ropes.get(self.windows[i] is not None)
            x = self.norm_1[i](h) if self.pre_norm else h
            qkv = product(x, *layer["qkv"])  # (B, T, (nh + 2 n_kv) hs)
            q, k, v = qkv.split((nh * hs, n_kv * hs, n_kv * hs), dim=-1)
            if ve is not None:
                v = v + layer["ve"] * ve
            q = q.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
            k = k.view(B, T, n_kv, hs).transpose(1, 2)  # (B, n_kv, T, hs)
            v = v.view(B, T, n_kv, hs).transpose(1, 2)
            if layer["q_norm"] is not None:
                q = F.rms_norm(q, (hs,), layer["q_norm"], self.eps)
                k = F.rms_norm(k, (hs,), layer["k_norm"], self.eps)
            if rope is not None:
                q, k = apply_rope(q, *rope), apply_rope(k, *rope)
            if written_out:
                _write_slots(k_cache, i, slots, k)
                _write_slots(v_cache, i, slots, v)
            else:
                k_cache[i].index_copy_(2, slots, k)
                v_cache[i].index_copy_(2, slots, v)
            # compiled: plain products and a softmax, which inductor fuses; capped scores (Gemma 2) too,
            # since the fused kernel has no place for the cap
            if written_out or self.attn_softcap is not None:
                kk, vv = k_cache[i, :, :, :L], v_cache[i, :, :, :L]  # (B, n_kv, L, hs)
                if n_kv != nh:
                    kk, vv = kk.repeat_interleave(nh // n_kv, dim=1), vv.repeat_interleave(nh // n_kv, dim=1)
                scores = soft_cap((q @ kk.transpose(-2, -1)) * self.scale, self.attn_softcap)  # (B, nh, T, L)
                y = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ vv  # (B, nh, T, hs)
            else:
                y = F.scaled_dot_product_attention(q, k_cache[i, :, :, :L], v_cache[i, :, :, :L], attn_mask=mask,
                                                   scale=self.scale,
                                                   enable_gqa=n_kv != nh)  # (B, nh, T, hs)
            a = product(y.transpose(1, 2).reshape(B, T, nh * hs), *layer["o"])  # (B, T, d)
            h = h + self.norm_1_out[i](a) if self.pre_norm else self.norm_1[i](h + a)
            x = self.norm_2[i](h) if self.pre_norm else h
            up = product(x, *layer["up"])  # (B, T, d_ff), or (B, T, 2 d_ff) gated: [x W_1, x W_3]
            gated = self.mlp_kind in ("swiglu", "geglu")
            hidden = mlp_activation(self.mlp_kind, *(up.chunk(2, dim=-1) if gated else (up,)))
            m = product(hidden, *layer["down"])
            h = h + self.norm_2_out[i](m) if self.pre_norm else self.norm_2[i](h + m)
        return self.norm_f(h)

    def logits(self, h: Tensor, written_out: bool = False) -> Tensor:
        """Logits (..., V) for hidden states (..., d)."""
        one = h.numel() == h.size(-1)
        logits = (_product_reduced if written_out and one else self.product)(h, self.head, None)
        if self.softcap is not None:
            logits = self.softcap * torch.tanh(logits / self.softcap)
        return logits

    def step(self, tokens: Tensor, slots: Tensor, positions: Tensor, key_mask: Tensor,
             k_cache: Tensor, v_cache: Tensor, written_out: bool = False) -> Tensor:
        """`hidden` then `logits`: (B, T, V)."""
        return self.logits(self.hidden(tokens, slots, positions, key_mask, k_cache, v_cache, written_out), written_out)

    def greedy_step(self, shape: tuple[int, ...], args: tuple[Tensor, ...], n: int) -> Callable | None:
        """The package making ``n`` greedy tokens a call (`tinylm.generate.aot.greedy_run`) for one (B, T, S); None
        where it cannot be built."""
        key = ("greedy", n, *shape)
        if key not in self._compiled:
            from tinylm.generate.aot import greedy_run

            self._compiled[key] = greedy_run(self, args, n, ONE_TOKEN_INDUCTOR_OPTIONS)
        return self._compiled[key]

    def compiled_step(self, shape: tuple[int, ...], args: tuple[Tensor, ...] | None = None) -> Callable:
        """`step` compiled for one (B, T, S) (one graph per shape, made on first use): for one token, an
        ahead-of-time package (`tinylm.generate.aot`, built from ``args``' shapes) where it can be built, else
        and for several tokens `torch.compile`."""
        if shape not in self._compiled and shape[0] * shape[1] == 1 and args is not None and AHEAD_OF_TIME:
            from tinylm.generate.aot import one_token_step

            step = one_token_step(self, args, ONE_TOKEN_INDUCTOR_OPTIONS)
            if step is not None:
                self._compiled[shape] = step
        if shape not in self._compiled:
            options = ONE_TOKEN_INDUCTOR_OPTIONS if shape[0] * shape[1] == 1 else {}
            self._compiled[shape] = torch.compile(functools.partial(self.step, written_out=True),
                                                  dynamic=False, fullgraph=True, options=options)
        return self._compiled[shape]


# the laid-out weights of each model, rebuilt when its parameters change (training steps, loading)
_LAYOUTS: weakref.WeakKeyDictionary[nn.Module, dict[bool, tuple[tuple, DecodeWeights]]] = weakref.WeakKeyDictionary()


def _fingerprint(model: nn.Module) -> tuple:
    # (inference tensors, made under torch.inference_mode, keep no version counter)
    return tuple((p.data_ptr(), -1 if p.is_inference() else p._version, p.dtype, p.device) for p in model.parameters())


def decode_weights(model: GPT, compiled: bool = False) -> DecodeWeights:
    """The model's `DecodeWeights` (for eager or compiled steps), made once and kept while its parameters are unchanged."""
    key = _fingerprint(model)
    kept = _LAYOUTS.setdefault(model, {}).get(compiled)
    if kept is not None and kept[0] == key:
        return kept[1]
    weights = DecodeWeights(model, compiled)
    _LAYOUTS[model][compiled] = (key, weights)
    return weights


class StaticDecoder:
    """The static cache and its step (module docstring): slots 0..S-1 for a batch of B rows, a `Decoder`.

    ``extra`` slots past ``capacity`` let a fixed-size step (a compiled speculative round) write
    padding past the end of the window; they are never seen by a real token.
    """

    def __init__(self, model: GPT, batch: int, capacity: int, compile: bool = False, extra: int = 0) -> None:
        cfg = model.config
        if capacity > cfg.block_size:
            raise TinyLMError(f"a cache of {capacity} positions exceeds the model's context "
                              f"(block_size = {cfg.block_size})")
        self.model = model
        self.weights = decode_weights(model)  # eager steps (a prefill, a window of several tokens)
        self.compiled_weights = decode_weights(model, compiled=True) if compile else None
        self.capacity = capacity
        self.compile = compile
        self.extra = extra
        dtype, device = self.weights.head.dtype, self.weights.head.device
        size = (cfg.n_layer, batch, cfg.kv_heads, capacity + extra, cfg.head_dim)
        self.k = torch.zeros(size, dtype=dtype, device=device)
        self.v = torch.zeros(size, dtype=dtype, device=device)
        self.mask = torch.zeros(batch, capacity + extra, dtype=torch.bool, device=device)  # real tokens' slots
        self.slots = torch.arange(capacity + extra, device=device)  # a step's slots are a slice (no new tensor a token)
        self.nothing_banned: Tensor | None = None  # (1, V) all False: `greedy_ahead` without excluded ids
        self.ahead_slower = False  # `greedy_ahead` measured slower than one token a call
        self.device = device
        self.settings: tuple[DecodeThreads, DecodeThreads] | None = None  # (prompt, one-token steps): `_thread_settings`
        self.settled = False
        self.reset()

    @property
    def max_len(self) -> int:
        return self.capacity

    def _shape(self, tokens: Tensor) -> tuple[int, ...]:
        """What a compiled step is made and chosen for: (B, T, S) and the thread count (a package built for one
        thread runs on one thread, and which step is faster changes with the count)."""
        return (*tokens.shape, self.k.size(3), torch.get_num_threads())

    def _compiled_is_faster(self, args: tuple) -> bool:
        """Whether the compiled step beats the eager one for this shape: measured once per model and shape.

        The first call compiles; then both run ``COMPARE_ROUNDS`` times in turns on these very inputs
        (writing a slot twice stores the same keys and values) and the lower median wins. The compiled
        one-token step doubled the default run's speed but slowed the `small` preset's by a third
        (`benchmarks/generate.py --run`), so neither is assumed.
        """
        shape = self._shape(args[0])
        chosen = self.compiled_weights.faster
        if shape not in chosen:
            step = self.compiled_weights.compiled_step(shape, args)
            compiled_args = self._compiled_args(step, args)
            step(*compiled_args)  # compiles (guards evaluated)
            chosen[shape] = not MEASURE_COMPILED or _first_is_faster(lambda: _call_warm(step, compiled_args),
                                                                     lambda: self.weights.step(*args))
        return chosen[shape]

    def greedy_ahead(self, token: Tensor, excluded: Tensor | None) -> tuple[list[int], list[float]] | None:
        """`GREEDY_TOKENS` greedy tokens after ``token`` (1,) in one call of a compiled package, where that was
        measured faster per token than the one-token step: their ids and log-probabilities; else None (nothing done).

        ``token`` and the tokens made but the last are written to the cache; ids marked in ``excluded`` (V,) are
        never chosen. Only for one row, with ``compile``, while the window has room for them all.
        """
        n = GREEDY_TOKENS
        if not (n and self.compile and AHEAD_OF_TIME and self.mask.size(0) == 1 and self.length + n <= self.capacity) \
                or self.ahead_slower:
            return None
        V = self.weights.config.vocab_size
        if excluded is None and self.nothing_banned is None:
            self.nothing_banned = torch.zeros(1, V, dtype=torch.bool, device=self.device)
        banned = excluded.view(1, V) if excluded is not None else self.nothing_banned
        args = (token.view(1, 1), self.slots[self.length:self.length + 1], self.next_position,
                self._written(self.length + n), self.k, self.v, banned)
        settings = self._thread_settings(args[:6])
        if settings is not None:
            settings[1].apply()
        if not self._ahead_is_faster(args, n):
            self.ahead_slower = True  # (for this decoder's life: its thread setting and shape stay)
            return None
        tokens, logprobs = self.compiled_weights.greedy_step(self._shape(args[0]), args, n)(*args)
        self.length += n
        self.next_position = self.next_position + n
        return tokens[0].tolist(), logprobs[0].tolist()

    def _ahead_is_faster(self, args: tuple, n: int) -> bool:
        """Whether n tokens a call beat n one-token steps (compiled, or eager where that won) with the engine's work on
        each step's logits (the argmax, the log-probability, reading them out): measured once per shape, on these
        inputs, as `_compiled_is_faster` measures (a measuring call writes the same slots again)."""
        shape = self._shape(args[0])
        chosen = self.compiled_weights.ahead_faster
        if shape not in chosen:
            ahead = self.compiled_weights.greedy_step(shape, args, n)
            if ahead is None:
                chosen[shape] = False
                return False
            one = (args[0], args[1], args[2], self._written(self.length + 1), self.k, self.v)
            if self._compiled_is_faster(one):
                compiled = self.compiled_weights.compiled_step(shape, one)
                one_step = lambda *inputs: _call_warm(compiled, self._compiled_args(compiled, inputs))  # noqa: E731
            else:
                one_step = self.weights.step
            ahead(*args)

            def one_at_a_time() -> None:  # the step, and what the engine does with its logits (`Engine._decode`)
                for _ in range(n):
                    logits = one_step(*one)[:, -1].masked_fill(args[-1], float("-inf"))
                    token = logits.argmax(-1)
                    torch.log_softmax(logits, dim=-1).gather(-1, token[:, None]).tolist()
                    token.tolist()

            chosen[shape] = not MEASURE_COMPILED or _first_is_faster(lambda: ahead(*args)[0].tolist(), one_at_a_time)
        return chosen[shape]

    def reset(self) -> None:
        self.length = 0
        self.mask.zero_()
        self.next_position = torch.zeros(self.mask.size(0), 1, dtype=torch.long, device=self.device)

    def truncate(self, length: int, last_token: int | None = None) -> None:
        """Forget the slots from ``length`` on (nothing is erased: no query sees a slot past its own).
        ``last_token`` is not needed here (no bigram-hash table)."""
        if not 0 <= length <= self.length:
            raise TinyLMError(f"cannot truncate a cache of {self.length} positions to {length}")
        self.next_position = self.next_position - (self.length - length)
        self.length = length

    def reorder(self, rows: Tensor) -> None:
        """Row b becomes old row rows[b] (a batch keeping its unfinished rows)."""
        self.k, self.v = self.k.index_select(1, rows), self.v.index_select(1, rows)
        self.mask, self.next_position = self.mask[rows], self.next_position[rows]

    @classmethod
    def merged(cls, parts: Sequence[tuple[StaticDecoder, Tensor]], width: int, capacity: int) -> StaticDecoder:
        """The kept rows (decoder, rows) of several decoders as one, right-aligned at slot ``width`` (`merge_rows`)."""
        first = parts[0][0]
        decoder = cls(first.model, sum(len(rows) for _, rows in parts), capacity, extra=first.extra)
        size = capacity + first.extra
        for name in ("k", "v"):  # rows first for the merge: (B, n_layer, n_kv, S, hs)
            rows_first = merge_rows([(getattr(d, name).transpose(0, 1), rows, d.length) for d, rows in parts],
                                    width, size)
            setattr(decoder, name, rows_first.transpose(0, 1).contiguous())
        decoder.mask = merge_rows([(d.mask[..., None], rows, d.length) for d, rows in parts], width, size)[..., 0]
        decoder.next_position = torch.cat([d.next_position[rows] for d, rows in parts])
        decoder.length = width
        return decoder

    def start(self, idx: Tensor, mask: Tensor, every: bool = False) -> Tensor:
        """Read left-padded windows idx (B, T) (mask False at padding) from slot 0; the last logits (B, V), or
        every position's (B, T, V) with ``every``."""
        self.reset()
        logits = self.run(idx, real_positions(mask), mask, last=not every)  # each row counts its own tokens
        return logits if every else logits[:, -1]

    def step(self, tokens: Tensor) -> Tensor:
        """One new token per row (B,) after the last; the next logits (B, V)."""
        return self.run(tokens[:, None], self.next_position, compiled=self.compile)[:, -1]

    def extend(self, tokens: Tensor, pad_to: int | None = None) -> Tensor:
        """Append ``tokens`` (B, T) after the cached ones; their logits (B, T, V).

        With ``pad_to`` (a compiled decoder's speculative round, one row) the step always reads ``pad_to``
        tokens, so that one compiled graph serves every round: the padding repeats the last token in
        the slots after these (``extra`` of them), and the length counts the real ones only.
        """
        T = tokens.size(1)
        positions = self.next_position + torch.arange(T, device=self.device)  # (B, T)
        if pad_to is None or not self.compile or T == 1:
            return self.run(tokens, positions, compiled=self.compile and T == 1)
        start, after = self.length, self.next_position + T
        tokens = torch.cat([tokens, tokens[:, -1:].expand(1, pad_to - T)], dim=1)
        positions = (self.next_position + torch.arange(pad_to, device=self.device)).clamp(
            max=self.weights.config.block_size - 1)
        logits = self.run(tokens, positions, compiled=True)
        self.length, self.next_position = start + T, after
        return logits[:, :T]

    def run(self, tokens: Tensor, positions: Tensor, real: Tensor | None = None, compiled: bool = False,
            last: bool = False) -> Tensor:
        """Write ``tokens`` (B, T) at positions (B, T) into the next T slots; logits (B, T, V), or with ``last``
        the last position's alone (B, 1, V): a prefill skips the head's product at every other position.
        ``real`` (B, T) marks the real tokens (False: padding, never attended to; default all real)."""
        T = tokens.size(1)
        start, end = self.length, self.length + T
        if end > self.k.size(3):
            raise TinyLMError(f"the cache holds {self.k.size(3)} slots; {end} do not fit")
        self.mask[:, start:end] = True if real is None else real
        slots = self.slots[start:end]
        args = (tokens, slots, positions, self._written(end), self.k, self.v)
        settings = self._thread_settings(args if T == 1 else None)
        if settings is not None:
            settings[T == 1].apply()  # one token: the step's setting; several: the prompt's
        if T == 1:
            logits = self._one_token(args, compiled)
        elif compiled and self.compiled_weights is not None and self._compiled_is_faster(args):
            step = self.compiled_weights.compiled_step(self._shape(tokens), args)
            logits = _call_warm(step, self._compiled_args(step, args))
        elif last:
            logits = self.weights.logits(self.weights.hidden(*args)[:, -1:])
        else:
            logits = self.weights.step(*args)
        self.length = end
        self.next_position = positions[:, -1:] + 1
        return logits

    def _one_token(self, args: tuple[Tensor, ...], compiled: bool) -> Tensor:
        """One token per row (``args`` as `run` makes them) by the step that is faster at the present thread count:
        compiled (with ``compiled``, where it measured faster) or eager."""
        if compiled and self.compiled_weights is not None and self._compiled_is_faster(args):
            step = self.compiled_weights.compiled_step(self._shape(args[0]), args)
            return _call_warm(step, self._compiled_args(step, args))
        return self.weights.step(*args)

    def _written(self, end: int) -> Tensor:
        """The mask of the slots a step attends over when slots 0..end-1 are written: those alone (the slots past
        them hold no token yet, so reading them is wasted time), at least 2 (a compiled step's shapes are
        exported for 2 or more)."""
        return self.mask[:, :max(end, 2)]

    def _compiled_args(self, step: Callable, args: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        """``args`` for a compiled step: an ahead-of-time package reads as many slots as the mask is wide (it is
        built for any width); `torch.compile`'s graphs are made for one width, the whole cache."""
        return args if isinstance(step, AOTStep) else (*args[:3], self.mask, *args[4:])

    def _thread_settings(self, args: tuple[Tensor, ...] | None) -> tuple[DecodeThreads, DecodeThreads] | None:
        """(the prompt's thread setting, one-token steps') where the command chose its thread count itself: measured
        (`tinylm.generate.threads`) once per model, for one row and for batches, and kind of step under the
        command's choice, on ``args`` (a one-token step's inputs; the measuring calls write the same slot again).
        Without ``args`` nothing is measured: the command's count for both until a one-token step has been. Kept for
        the decoder's life (a batch that `reorder` shrinks to one row keeps the batch's)."""
        if self.settled:
            return self.settings
        from tinylm.device import active_choice

        key = (self.k.size(1) == 1, self.compile, active_choice())  # one row or a batch
        chosen = self.weights.thread_settings
        if not CHOOSE_THREADS or command_setting() is None or self.device.type != "cpu":
            self.settled = True
        elif key in chosen:
            self.settings, self.settled = chosen[key], True
        elif args is not None:
            chosen[key] = self.settings = decode_settings(lambda: self._one_token(args, self.compile))
            self.settled = True
        else:  # a prompt before anything was measured: the command's count (a step may have left another)
            command = command_setting()
            return command, command
        return self.settings

    def prepare_steps(self) -> None:
        """Measure the one-token steps' thread setting now (`_thread_settings`), after the prompt and before the first
        token is shown, so that the line saying it does not land in the middle of streamed text. It times a step of
        token 0 in the next slot, which the real step writes again."""
        end = self.length + 1
        if self.settled or end > self.k.size(3):
            return
        rows = self.mask.size(0)
        tokens = torch.zeros(rows, 1, dtype=torch.long, device=self.device)
        self._thread_settings((tokens, self.slots[self.length:end], self.next_position, self._written(end), self.k,
                               self.v))
        if self.settings is not None:
            self.settings[0].apply()  # (the first token is chosen before any step: the command's count till then)

    def command_threads(self) -> None:
        """Back to the command's thread setting, once decoding is over (what comes next in the command, an evaluation
        say, runs with the command's count, not the one-token steps')."""
        if self.settings is not None:
            self.settings[0].apply()


def _first_is_faster(first: Callable[[], object], second: Callable[[], object]) -> bool:
    """Whether ``first`` has the lower median time over `COMPARE_ROUNDS` calls of each, taken in turns (a change of
    load on a shared machine hits both alike)."""
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(COMPARE_ROUNDS):
        for which, call in enumerate((first, second)):
            started = time.perf_counter()
            call()
            times[which].append(time.perf_counter() - started)
    return statistics.median(times[0]) < statistics.median(times[1])


def _call_warm(step: Callable, args: tuple) -> Tensor:
    """Call a compiled step that has run once (an ahead-of-time package has no guards: called as it is). Each compiled function serves one shape, and every call passes
    a decoder's own buffers with fixed dtypes and sizes, so dynamo's guards cannot fail: they are skipped
    (on the default run, about a tenth of a compiled step when this was written)."""
    if isinstance(step, AOTStep):
        return step(*args)
    with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
        return step(*args)


def make_decoder(model: nn.Module, batch: int, capacity: int, compile: bool = False,
                 draft_k: int = 0) -> StaticDecoder | CachedDecoder:
    """The fastest decoder for ``model``: a `StaticDecoder` where `supports` says so, else the model's own.

    ``compile`` compiles the one-token step (`torch.compile`); the cache then spans the whole context
    (``block_size`` slots) plus `ROUND_SLOTS` (or ``draft_k``) for a speculative round's padding, so that
    every generation, speculative or not, reuses the same compiled graphs.
    """
    if not supports(model):
        return CachedDecoder(model, batch, capacity)
    if compile:
        return StaticDecoder(model, batch, model.config.block_size, compile=True, extra=max(ROUND_SLOTS, draft_k))
    return StaticDecoder(model, batch, capacity, extra=draft_k)
